"""The exchange state in checkpoints: rank files, the manifest, saving, checking, restoring."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_MODULES = ("exchange", "files", "rank_files")


def __getattr__(name: str) -> Any:
    """A name of the single ``lightning_dgc.checkpoint`` module of the previous release, for one more release."""
    if name.startswith("__") or name in _MODULES:  # a submodule not yet imported: the import system's own
        raise AttributeError(f"module 'lightning_dgc.checkpoint' has no attribute {name!r}")
    for module in (importlib.import_module(f"{__name__}.{sub}") for sub in _MODULES):
        if hasattr(module, name):
            warnings.warn(
                f"`lightning_dgc.checkpoint.{name}` moved to `{module.__name__}.{name}`; the old path is deprecated"
                " and goes in the next release",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(module, name)
    raise AttributeError(f"module 'lightning_dgc.checkpoint' has no attribute {name!r}")
