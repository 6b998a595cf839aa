"""Argument checks shared by the configurations and callbacks: clear errors that name the argument."""

from __future__ import annotations

import math
import numbers

import numpy as np


def real_number(value: object, name: str) -> float:
    """``value`` as a float if it is a real number of any type (numpy scalars too, not bool or str).

    Raises a ``ValueError`` naming the argument otherwise, so that ``momentum="0.9"`` fails with a
    message that says what to pass rather than a bare ``TypeError`` from a comparison.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"`{name}` must be a number, got {value!r} ({type(value).__name__}).")
    return float(value)


def whole_number(value: object, name: str) -> int:
    """``value`` as an int if it is an integer of any type (numpy integers too, not bool, float or str)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"`{name}` must be an integer, got {value!r} ({type(value).__name__}).")
    return int(value)


def flag(value: object, name: str) -> bool:
    """``value`` as a bool if it is one (numpy's too)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"`{name}` must be True or False, got {value!r} ({type(value).__name__}).")
    return bool(value)


def check_density(density: object, name: str = "density") -> float:
    """Return ``density`` as a float if it lies in (0, 1]; raise a ``ValueError`` naming the fix."""
    value = real_number(density, name)
    if not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite number in (0, 1], got {density!r}.")
    if not 0.0 < value <= 1.0:
        raise ValueError(
            f"`{name}` is the fraction of gradient values sent each step and must lie in (0, 1], got {value}."
            " Use 0.001 for DGC's 99.9% sparsity, or 1.0 to send everything."
        )
    return value


#: DDP arguments that install another communication hook: a compression strategy installs its own.
FOREIGN_HOOK_ARGUMENTS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")


def drop_foreign_hook_arguments(kwargs: dict[str, object], owner: str, alternative: str) -> None:
    """Refuse (a ``ValueError``) any of :data:`FOREIGN_HOOK_ARGUMENTS` set in ``kwargs``; drop the unset ones."""
    for name in FOREIGN_HOOK_ARGUMENTS:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{owner} installs its own DDP communication hook; `{name}` cannot be combined with it."
                f" Use {alternative} for other hooks."
            )
        kwargs.pop(name, None)


def sparse_gradient_message(names: list[str]) -> str:
    """The error for parameters whose gradients are sparse tensors (``nn.Embedding(sparse=True)``)."""
    return (
        f"Parameter(s) {names} get sparse gradients (e.g. nn.Embedding(sparse=True) or nn.EmbeddingBag(sparse=True)),"
        " which the compressed exchange cannot take: it selects from dense gradient buckets. Create the module"
        " with sparse=False (the exchange already sends only the largest values), or train with"
        " strategy='ddp'."
    )


def check_schedulable(strategy: object, owner: str) -> None:
    """A ``TypeError`` naming the fix unless ``strategy`` has a density that a schedule (``owner``) can change."""
    if getattr(strategy, "density", None) is not None:
        return
    algorithm = getattr(strategy, "algorithm", None)
    what = f"{type(strategy).__name__} ({algorithm})" if algorithm else type(strategy).__name__
    raise TypeError(
        f"{owner} changes the density of a sparse exchange, but the Trainer's strategy is {what}, which has none."
        ' Use `Trainer(strategy="dgc")` (or `strategy=DGCStrategy(...)`, or "deft") with this callback.'
    )
