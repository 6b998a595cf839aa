"""The one place where strategy names are registered with Lightning.

Every strategy gets the family of names Lightning registers for its own ``DDPStrategy``, with ``ddp`` replaced by
the strategy's name, in the Trainer's registry (``Trainer(strategy="dgc")``) and in Fabric's
(``Fabric(strategy="dgc")``), with the same start method and ``find_unused_parameters`` as its ``ddp`` twin:

* the Trainer's: ``"<name>"`` (``start_method="popen"``), ``"<name>_spawn"``, ``"<name>_fork"``,
  ``"<name>_notebook"`` (``"fork"``: how a notebook runs several processes),
  ``"<name>_find_unused_parameters_true"`` / ``"_false"`` and their ``_spawn``, ``_fork`` and ``_notebook``
  forms (``"<name>_spawn_find_unused_parameters_true"``, ...);
* Fabric's: ``"<name>"``, ``"<name>_spawn"``, ``"<name>_fork"``, ``"<name>_notebook"`` and
  ``"<name>_find_unused_parameters_true"``.

``<name>`` is every registered algorithm's (``"dgc"``, ``"deft"``, ``"powersgd"``, an outside one) and
``"diloco"``. The family is read from Lightning's ``DDPStrategy.register_strategies`` itself, so it follows
Lightning's. ``"dgc"`` and ``"deft"`` are the Trainer's :class:`~lightning_dgc.front.strategy.DGCStrategy` and
:class:`~lightning_dgc.front.strategy.DEFTStrategy` (typed arguments for the CLI); any other algorithm is
:class:`~lightning_dgc.front.strategy.CompressionStrategy` with ``algorithm=<name>``. A sharded model's strategy is
no DDP and has one name per algorithm in the Trainer's registry, ``"<name>_hsdp"``
(:class:`~lightning_dgc.front.hsdp.HSDPCompressionStrategy`), and ``"diloco_hsdp"``
(:class:`~lightning_dgc.local_steps.hsdp.HSDPDiLoCoStrategy`).

:func:`register_strategies` adds what is missing and nothing else, so it runs wherever a name may be missing:
right after ``lightning.pytorch`` is imported (the package's import hook, :mod:`lightning_dgc`), at the end of
each front-door module, and when an outside algorithm is registered (:func:`lightning_dgc.algorithms.register`).
While a front-door module is still loading (it imports Lightning first, whose import runs the hook) nothing is
registered, since the doors import one another (the sharded door imports the Trainer's): the loading module's own
last line registers every name (``register_strategies(__name__)``).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from lightning_dgc import algorithms
from lightning_dgc.algorithms.base import on_register

#: Every front door: (its module, its class, whose registry: ``"trainer"`` or ``"fabric"``, and its names:
#: ``"algorithms"``, every registered algorithm's, ``"diloco"``, ``"sharded"``: every algorithm's ``"<name>_hsdp"``, or
#: ``"diloco_hsdp"``: that one name).
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
#: DiLoCo on a sharded model's one name (a sharded model's strategy is no DDP: no family of names).
DILOCO_SHARDED = f"{DILOCO}{SHARDED}"
#: The prefix of Lightning's DDP names; the rest of each name (``"_spawn"``, ...) is kept.
DDP = "ddp"


class _Recorded(dict):
    """A stand-in registry that keeps what a strategy class's ``register_strategies`` registers: name -> arguments."""

    def register(self, name: str, strategy: Any = None, description: str | None = None, **init_params: Any) -> None:
        self[name] = init_params


def ddp_family(kind: str) -> dict[str, dict[str, Any]]:
    """The names Lightning registers for its own ``DDPStrategy`` in the Trainer's (``kind="trainer"``) or Fabric's
    (``"fabric"``) registry, by what follows ``"ddp"`` (``""``, ``"_spawn"``, ``"_fork_find_unused_parameters_true"``,
    ...), each with its arguments (``start_method``, ``find_unused_parameters``)."""
    if kind == "trainer":
        from lightning.pytorch.strategies import DDPStrategy
    else:
        from lightning.fabric.strategies import DDPStrategy
    recorded = _Recorded()
    DDPStrategy.register_strategies(recorded)
    return {name[len(DDP) :]: params for name, params in recorded.items() if name == DDP or name.startswith(f"{DDP}_")}


def register_strategies(finished: str | None = None) -> None:
    """Register every strategy name not yet registered, in the Trainer's and Fabric's registries; ``finished``:
    the front-door module that calls this on its last line (complete, though its import has not returned)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    if any(name != finished and _loading(name) for name, *_ in FRONT_DOORS):
        return  # a front door is still loading: it calls this when done
    registries = {"trainer": StrategyRegistry, "fabric": STRATEGY_REGISTRY}
    families = {kind: ddp_family(kind) for kind in registries}
    for module_name, class_name, kind, names in FRONT_DOORS:
        module = importlib.import_module(module_name)
        registry, family = registries[kind], families[kind]
        if names == DILOCO:
            _register_family(registry, family, DILOCO, getattr(module, class_name), "DiLoCo", {})
            continue
        if names == DILOCO_SHARDED:
            description = "DiLoCo on a sharded model: FSDP2 inside the node, outer steps across nodes on each shard"
            _register(registry, DILOCO_SHARDED, getattr(module, class_name), description, {})
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
            _register_family(registry, family, name, strategy, f"{strategy.__name__} ({name})", fixed)


def _loading(module_name: str) -> bool:
    """Whether the module is being imported (its body has not finished running)."""
    module = sys.modules.get(module_name)
    return module is not None and bool(getattr(module.__spec__, "_initializing", False))


def _register_family(
    registry: Any, family: dict[str, dict[str, Any]], name: str, strategy: type, what: str, fixed: dict[str, Any]
) -> None:
    """``name`` and each of its DDP-like forms (``family``), for ``strategy`` with ``fixed`` arguments besides."""
    for suffix, ddp_params in family.items():
        settings = ", ".join(f"{key}={value!r}" for key, value in ddp_params.items())
        description = f"{what}, as '{DDP}{suffix}': {settings}"
        _register(registry, f"{name}{suffix}", strategy, description, {**fixed, **ddp_params})


def _register(registry: Any, name: str, strategy: type, description: str, init_params: dict[str, Any]) -> None:
    if name not in registry:
        registry.register(name, strategy, description=description, **init_params)


def _register_outside_algorithm(cls: type) -> None:
    """An algorithm registered from outside the package gets its strategy names at once if Lightning is loaded
    (else they come with :func:`register_strategies` when it is)."""
    if "lightning.pytorch" in sys.modules:
        register_strategies()


on_register(_register_outside_algorithm)
