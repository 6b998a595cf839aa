"""The package imports in any order, registers its strategy names, its pure parts load without Lightning, and
no import circle runs through it.

Each case runs in a fresh interpreter (import order is process state); the interpreters run side by side."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import lightning_dgc
import lightning_dgc.checkpoint

REGISTERED = """
from lightning.pytorch.strategies import StrategyRegistry
from lightning.fabric.strategies import STRATEGY_REGISTRY
names = ("dgc", "dgc_spawn", "deft", "deft_spawn", "powersgd", "diloco")
missing = [n for n in names if n not in StrategyRegistry] + [f"fabric {n}" for n in names if n not in STRATEGY_REGISTRY]
assert not missing, missing
assert STRATEGY_REGISTRY["diloco"]["strategy"].__name__ == "FabricDiLoCoStrategy"
assert StrategyRegistry["dgc_spawn"]["strategy"].__name__ == "DGCStrategy"
assert StrategyRegistry["dgc_spawn"]["init_params"] == {"start_method": "spawn"}
assert StrategyRegistry["powersgd"]["strategy"].__name__ == "CompressionStrategy"
assert StrategyRegistry["powersgd"]["init_params"] == {"algorithm": "powersgd", "start_method": "popen"}
assert STRATEGY_REGISTRY["deft"]["init_params"] == {"algorithm": "deft", "start_method": "popen"}
"""
CASES = {
    # the package's names before Lightning: this crashed with a circular import
    "names first": "from lightning_dgc import DGCStrategy" + REGISTERED,
    "strategy module first": "import lightning_dgc.front.strategy" + REGISTERED,
    "Fabric's DiLoCo module first": "import lightning_dgc.local_steps.fabric" + REGISTERED,
    "package, then Lightning": "import lightning_dgc\nimport lightning.pytorch" + REGISTERED,
    "Lightning, then package": "import lightning\nimport lightning_dgc" + REGISTERED,
    "pure parts": """
import sys
import lightning_dgc.perfmodel, lightning_dgc.algorithms, lightning_dgc.exchange.hook
assert "lightning" not in sys.modules, "a pure module imported Lightning"
""",
}


def test_any_import_order_registers_every_strategy_name_and_pure_parts_need_no_lightning() -> None:
    running = {
        name: subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)], stderr=subprocess.PIPE, text=True
        )
        for name, code in CASES.items()
    }
    failed = {}
    for name, process in running.items():
        _, stderr = process.communicate(timeout=180)
        if process.returncode != 0:
            failed[name] = stderr[-2000:]
    assert not failed, failed


#: The package's rooms, top to bottom: a module imports from its own room or from a room below it, never above.
LAYERS = (
    "lightning_dgc",  # the public API
    "kit",
    "local_steps",
    "front",
    "schedules",
    "perfmodel",
    "checkpoint",
    "exchange",
    "algorithms",
    "comm",
    "tensor_ops",
)


def package_modules() -> dict[str, Path]:
    root = Path(lightning_dgc.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def module_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` (at ``path``) imports: every import statement, at module level, under
    ``TYPE_CHECKING`` or deferred into a function alike."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # an attribute of a module: the module
                target = target.rpartition(".")[0]
            if target:
                found.add(target)
    return found - {name}


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: module_imports(name, path, modules) for name, path in modules.items()}


def test_the_package_has_no_import_circle_deferred_imports_included() -> None:
    graph = import_graph()
    assert "lightning_dgc.tensor_ops.memory" in graph["lightning_dgc.algorithms.context"], "the scan finds imports"
    assert "lightning_dgc.kit.run" in graph["lightning_dgc.kit.replay"], "the scan finds imports"

    def circle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        seen = set()
        while stack:
            name, path = stack.pop()
            for nxt in graph[name]:
                if nxt == start:
                    return [*path, start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
        return None

    circles = [c for c in map(circle_from, sorted(graph)) if c]
    assert not circles, " -> ".join(circles[0])


def test_no_module_imports_from_a_room_above_its_own() -> None:
    graph = import_graph()
    rooms = {room_of(name) for name in graph}
    assert rooms == set(LAYERS), f"rooms without a layer: {rooms - set(LAYERS)}; layers without a room: {set(LAYERS) - rooms}"
    floor = {room: i for i, room in enumerate(LAYERS)}
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        for target in targets
        if floor[room_of(target)] < floor[room_of(name)]
    )
    assert not upward, upward


def test_the_package_top_holds_at_most_a_dozen_entries() -> None:
    root = Path(lightning_dgc.__file__).parent
    entries = sorted(p.name for p in root.iterdir() if p.name != "__pycache__")
    assert len(entries) <= 12, entries


def test_no_module_of_the_package_is_over_450_lines() -> None:
    root = Path(lightning_dgc.__file__).parent
    long = {str(p.relative_to(root)): n for p in root.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450}
    assert not long, f"split these by concern (see CONTRIBUTING.md, Layout): {long}"


@pytest.mark.parametrize("old", sorted(lightning_dgc._MOVED))
def test_an_old_module_path_is_the_module_that_holds_it_now_with_a_deprecation_warning(old: str) -> None:
    sys.modules.pop(f"lightning_dgc.{old}", None)
    with pytest.warns(DeprecationWarning, match=f"`lightning_dgc.{old}` moved to"):
        module = importlib.import_module(f"lightning_dgc.{old}")
    assert module is importlib.import_module(f"lightning_dgc.{lightning_dgc._MOVED[old]}")


def test_the_old_checkpoint_module_names_resolve_with_a_deprecation_warning() -> None:
    from lightning_dgc.checkpoint.exchange import inline_exchange_state

    with pytest.warns(DeprecationWarning, match="checkpoint.exchange.inline_exchange_state"):
        assert lightning_dgc.checkpoint.inline_exchange_state is inline_exchange_state
