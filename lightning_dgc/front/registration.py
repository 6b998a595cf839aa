"""The one place where strategy names are registered with Lightning.

For the Trainer (``Trainer(strategy="dgc")``) and for Fabric (``Fabric(strategy="dgc")``): every registered
algorithm under its name (``start_method="popen"``) and ``"<name>_spawn"``, and ``"diloco"``; for the Trainer, each
algorithm's ``"<name>_hsdp"`` and ``"diloco_hsdp"`` (sharded models). ``"dgc"`` and
``"deft"`` are the Trainer's :class:`~lightning_dgc.front.strategy.DGCStrategy` and
:class:`~lightning_dgc.front.strategy.DEFTStrategy` (typed arguments for the CLI); any other algorithm is
:class:`~lightning_dgc.front.strategy.CompressionStrategy` with ``algorithm=<name>``.

:func:`register_strategies` adds what is missing and nothing else, so it runs wherever a name may be missing:
right after ``lightning.pytorch`` is imported (the package's import hook, :mod:`lightning_dgc`), at the end of
each front-door module, and when an outside algorithm is registered (:func:`lightning_dgc.algorithms.register`).
A front-door module that is still loading (it imports Lightning first, whose import runs the hook) is left
alone: its own last line registers its names (``register_strategies(__name__)``).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from lightning_dgc import algorithms
from lightning_dgc.algorithms.base import on_register

#: Every front door: (its module, its class, whose registry: ``"trainer"`` or ``"fabric"``, and its names:
#: ``"algorithms"``, every registered algorithm's, ``"sharded"``: every algorithm's ``"<name>_hsdp"``, or one of
#: :data:`SINGLE`'s names).
FRONT_DOORS = (
    ("lightning_dgc.front.strategy", "CompressionStrategy", "trainer", "algorithms"),
    ("lightning_dgc.local_steps.strategy", "DiLoCoStrategy", "trainer", "diloco"),
    ("lightning_dgc.front.fabric", "FabricCompressionStrategy", "fabric", "algorithms"),
    ("lightning_dgc.local_steps.fabric", "FabricDiLoCoStrategy", "fabric", "diloco"),
    ("lightning_dgc.front.hsdp", "HSDPCompressionStrategy", "trainer", "sharded"),
    ("lightning_dgc.local_steps.hsdp", "HSDPDiLoCoStrategy", "trainer", "diloco_hsdp"),
)
#: The suffix of a sharded model's names (``"dgc_hsdp"``: FSDP2 inside the node, DGC across nodes).
SHARDED = "_hsdp"
#: The Trainer's strategies with the algorithm's settings as typed arguments (the rest take ``algorithm=``).
TYPED = {"dgc": "DGCStrategy", "deft": "DEFTStrategy"}
DILOCO = "diloco"
#: The front doors registered under one name each, with their descriptions.
SINGLE = {
    DILOCO: "DiLoCo: local steps, outer Nesterov SGD",
    f"{DILOCO}{SHARDED}": "DiLoCo on a sharded model: FSDP2 inside the node, outer steps across nodes on each shard",
}


def register_strategies(finished: str | None = None) -> None:
    """Register every strategy name not yet registered, in the Trainer's and Fabric's registries; ``finished``:
    the front-door module that calls this on its last line (complete, though its import has not returned)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    registries = {"trainer": StrategyRegistry, "fabric": STRATEGY_REGISTRY}
    for module_name, class_name, kind, names in FRONT_DOORS:
        loading = sys.modules.get(module_name)
        if module_name != finished and loading is not None and getattr(loading.__spec__, "_initializing", False):
            continue  # still loading: it calls this when done
        module = importlib.import_module(module_name)
        registry = registries[kind]
        if names in SINGLE:
            _register(registry, names, getattr(module, class_name), SINGLE[names], {})
            continue
        if names == "sharded":
            for name in algorithms.registered():
                strategy = getattr(module, class_name)
                description = f"{class_name} ({name}): FSDP2 inside the node, {name} across nodes"
                _register(registry, f"{name}{SHARDED}", strategy, description, {"algorithm": name})
            continue
        for name in algorithms.registered():
            typed = TYPED.get(name) if kind == "trainer" else None
            strategy = getattr(module, typed or class_name)
            fixed = {} if typed else {"algorithm": name}
            for registered, start_method in ((name, "popen"), (f"{name}_spawn", "spawn")):
                description = f"{strategy.__name__} ({name}), start_method '{start_method}'"
                _register(registry, registered, strategy, description, {**fixed, "start_method": start_method})


def _register(registry: Any, name: str, strategy: type, description: str, init_params: dict[str, Any]) -> None:
    if name not in registry:
        registry.register(name, strategy, description=description, **init_params)


def _register_outside_algorithm(cls: type) -> None:
    """An algorithm registered from outside the package gets its strategy names at once if Lightning is loaded
    (else they come with :func:`register_strategies` when it is)."""
    if "lightning.pytorch" in sys.modules:
        register_strategies()


on_register(_register_outside_algorithm)
