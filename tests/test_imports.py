"""The package imports in any order, registers its strategy names, its pure parts load without Lightning, and
no import circle runs through it.

Each case runs in a fresh interpreter (import order is process state); the interpreters run side by side."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning_dgc

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


def module_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``path`` imports when it loads or is type-checked (imports inside functions, which
    run later, do not count)."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.ClassDef):
                visit(node.body)
            elif isinstance(node, ast.If):
                visit(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.update(
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                    for a in node.names
                )

    visit(ast.parse(path.read_text()).body)
    return {name for name in found if name in modules}


def test_the_package_has_no_import_circle_type_checking_imports_included() -> None:
    root = Path(lightning_dgc.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {name: module_imports(path, modules) - {name} for name, path in modules.items()}
    assert graph["lightning_dgc.algorithms.sparse"], "the scan finds imports"

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


def test_no_module_of_the_package_is_over_450_lines() -> None:
    root = Path(lightning_dgc.__file__).parent
    long = {str(p.relative_to(root)): n for p in root.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450}
    assert not long, f"split these by concern (see CONTRIBUTING.md, Layout): {long}"
