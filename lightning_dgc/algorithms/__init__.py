"""Compression algorithms, one file each: ``dgc.py``, ``deft.py``, ``powersgd.py``, ... (``deft_partition.py``
is DEFT's partitioning of a bucket among the ranks, beside it).

Every module of this package is imported here, and each algorithm registers its :class:`Algorithm` with
:func:`register`, so that adding an algorithm is adding a file: the strategy names
(``Trainer(strategy="<name>")``), the statistics and the performance model pick it up by name.
"""

from __future__ import annotations

import importlib
import pkgutil

from lightning_dgc.algorithms.base import (
    Algorithm,
    AlgorithmConfig,
    BucketPlan,
    BucketWork,
    Message,
    TensorSpec,
    WireCost,
    config_of,
    get,
    layout_of,
    register,
    registered,
)
from lightning_dgc.algorithms.context import ExchangeContext, ParamSettings

__all__ = [
    "Algorithm",
    "AlgorithmConfig",
    "BucketPlan",
    "BucketWork",
    "ExchangeContext",
    "Message",
    "ParamSettings",
    "TensorSpec",
    "WireCost",
    "config_of",
    "get",
    "layout_of",
    "register",
    "registered",
]

for _module in pkgutil.iter_modules(__path__):
    if _module.name not in ("base", "context"):
        importlib.import_module(f"{__name__}.{_module.name}")
