"""lightning-dgc: compressed gradient exchanges (DGC, DEFT, PowerSGD, ...) as PyTorch Lightning strategies.

Importing the package registers every algorithm's strategy name with Lightning (``"dgc"``,
``"deft"``, ``"powersgd"``, ..., each with the forms Lightning has for DDP: ``"dgc_spawn"``, ``"dgc_notebook"``,
...), so ``Trainer(strategy="dgc")`` and ``Fabric(strategy="dgc")`` work (and ``"diloco"`` through both). The names
are registered as soon as ``lightning.pytorch`` is imported (at once if it already is): the package
itself imports Lightning only when a name that needs it is used, so that the pure parts (the
algorithms, the performance model) load without it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "CompressionMonitor": "lightning_dgc.schedules.warmup",
    "CriticalRegimes": "lightning_dgc.schedules.regimes",
    "breakeven_density": "lightning_dgc.perfmodel.breakeven",
    "SparsityWarmup": "lightning_dgc.schedules.warmup",
    "warmup_density": "lightning_dgc.schedules.warmup",
    "CompressionStrategy": "lightning_dgc.front.strategy",
    "DEFTStrategy": "lightning_dgc.front.strategy",
    "DGCStrategy": "lightning_dgc.front.strategy",
    "HSDPCompressionStrategy": "lightning_dgc.front.hsdp",
    "DiLoCoStrategy": "lightning_dgc.local_steps.strategy",
    "HSDPDiLoCoStrategy": "lightning_dgc.local_steps.hsdp",
    "FabricCompressionStrategy": "lightning_dgc.front.fabric",
    "FabricHSDPCompressionStrategy": "lightning_dgc.front.hsdp_fabric",
    "FabricDiLoCoStrategy": "lightning_dgc.local_steps.fabric",
    "DEFTConfig": "lightning_dgc.algorithms.deft",
    "DGCConfig": "lightning_dgc.algorithms.dgc",
    "PowerSGDConfig": "lightning_dgc.algorithms.powersgd",
    "ExchangeState": "lightning_dgc.exchange.state",
    "exchange_hook": "lightning_dgc.exchange.hook",
    "ExchangeProfiler": "lightning_dgc.front.profiler",
    "Network": "lightning_dgc.perfmodel",
    "Prediction": "lightning_dgc.perfmodel",
    "Profile": "lightning_dgc.perfmodel",
    "predict": "lightning_dgc.perfmodel",
    "destroy_process_group": "lightning_dgc.comm",
    # the algorithm contract, for new algorithms (from the package, so that the built-in ones are registered)
    "Algorithm": "lightning_dgc.algorithms",
    "AlgorithmConfig": "lightning_dgc.algorithms",
    "BucketPlan": "lightning_dgc.algorithms",
    "BucketWork": "lightning_dgc.algorithms",
    "ExchangeContext": "lightning_dgc.algorithms",
    "Message": "lightning_dgc.algorithms",
    "TensorSpec": "lightning_dgc.algorithms",
    "WireCost": "lightning_dgc.algorithms",
    "register": "lightning_dgc.algorithms",
    "check_algorithm": "lightning_dgc.kit",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lightning_dgc' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


def _register_strategies() -> None:
    from lightning_dgc.front.registration import register_strategies

    register_strategies()


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Runs :func:`_register_strategies` right after ``lightning.pytorch`` has been imported."""

    target = "lightning.pytorch"

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> Any:
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)  # once; the other finders locate the real module
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            exec_module = spec.loader.exec_module

            def exec_then_register(module: ModuleType) -> None:
                exec_module(module)
                _register_strategies()

            spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


#: Module paths of the previous release, kept for one more release: each imports the module that holds its code
#: now (the same module object), with a ``DeprecationWarning`` naming the new path.
_MOVED = {
    "agreement": "exchange.agreement",
    "auto_density": "schedules.auto_density",
    "callbacks": "schedules.warmup",
    "checks": "algorithms.checks",
    "codec": "tensor_ops.codec",
    "diloco": "local_steps.strategy",
    "diloco_front": "local_steps.core",
    "entry": "exchange.entry",
    "fabric": "front.fabric",
    "fabric_diloco": "local_steps.fabric",
    "heap": "tensor_ops.heap",
    "hook": "exchange.hook",
    "memory": "tensor_ops.memory",
    "momentum": "tensor_ops.momentum",
    "outer": "local_steps.outer",
    "passthrough": "exchange.passthrough",
    "predict_cli": "perfmodel.cli",
    "profiler": "front.profiler",
    "rank_files": "checkpoint.rank_files",
    "regimes": "schedules.regimes",
    "registration": "front.registration",
    "replay": "kit.replay",
    "rounds": "local_steps.rounds",
    "selection": "tensor_ops.selection",
    "shards": "exchange.shards",
    "state": "exchange.state",
    "stats": "exchange.stats",
    "strategy": "front.strategy",
    "takeover": "exchange.takeover",
    "testing": "kit",
    "two_level": "exchange.two_level",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path of :data:`_MOVED` (or a module under it) as the module that now holds it."""

    def __init__(self) -> None:
        self._specs: dict[str, Any] = {}

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None) -> Any:
        top, _, rest = fullname.partition(".")
        return importlib.util.spec_from_loader(fullname, self) if top == __name__ and _new_path(rest) else None

    def create_module(self, spec: Any) -> ModuleType:
        new = f"{__name__}.{_new_path(spec.name.partition('.')[2])}"
        warnings.warn(
            f"`{spec.name}` moved to `{new}`; the old path is deprecated and goes in the next release",
            DeprecationWarning,
            stacklevel=2,  # the import statement (the import system's frames are skipped)
        )
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__  # the import system sets the old path's spec on it
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._specs.pop(module.__spec__.name, module.__spec__)  # type: ignore[union-attr]


def _new_path(old: str) -> str | None:
    first, _, rest = old.partition(".")
    return None if first not in _MOVED else f"{_MOVED[first]}.{rest}" if rest else _MOVED[first]



if "lightning.pytorch" in sys.modules:
    _register_strategies()
elif not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterImport())
if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())  # before the path finder, which would load a second copy
