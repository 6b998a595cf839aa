"""The package imports in any order, registers its strategy names, and its pure parts load without Lightning.

Each case runs in a fresh interpreter (import order is process state); the interpreters run side by side."""

from __future__ import annotations

import subprocess
import sys
import textwrap

REGISTERED = """
from lightning.pytorch.strategies import StrategyRegistry
from lightning.fabric.strategies import STRATEGY_REGISTRY
names = ("dgc", "dgc_spawn", "deft", "deft_spawn", "powersgd", "diloco")
missing = [n for n in names if n not in StrategyRegistry] + [f"fabric {n}" for n in names if n not in STRATEGY_REGISTRY]
assert not missing, missing
assert STRATEGY_REGISTRY["diloco"]["strategy"].__name__ == "FabricDiLoCoStrategy"
"""
CASES = {
    # the package's names before Lightning: this crashed with a circular import
    "names first": "from lightning_dgc import DGCStrategy" + REGISTERED,
    "strategy module first": "import lightning_dgc.strategy" + REGISTERED,
    "Fabric's DiLoCo module first": "import lightning_dgc.fabric_diloco" + REGISTERED,
    "package, then Lightning": "import lightning_dgc\nimport lightning.pytorch" + REGISTERED,
    "Lightning, then package": "import lightning\nimport lightning_dgc" + REGISTERED,
    "pure parts": """
import sys
import lightning_dgc.perfmodel, lightning_dgc.algorithms, lightning_dgc.hook
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
