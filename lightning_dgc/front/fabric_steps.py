"""The step of a Fabric front door (:mod:`lightning_dgc.front.fabric`, :mod:`lightning_dgc.front.hsdp_fabric`): the
exchange finished right after each ``fabric.backward``, the optimizer step skipped on every rank when it was not
finite, and the rank checks after it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.nn import Module
from typing_extensions import override

__all__ = ["FabricExchangeSteps"]


class FabricExchangeSteps:
    """Mixin of a Fabric front door (before its Fabric strategy base, after its exchange mixin); the door says which
    parameters the rank checks read (:meth:`_checked_parameters`)."""

    def _checked_parameters(self) -> Iterable[tuple[str, torch.Tensor]] | None:
        """The trained module's named parameters (``None`` before ``fabric.setup``)."""
        raise NotImplementedError

    @override
    def backward(self, tensor: torch.Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """The backward pass, with the exchange's step finished right after it (``.grad`` then holds the
        averaged update, and the memory is committed, or left as it was, as under DDP)."""
        backward = super().backward  # type: ignore[misc]
        self._backward_pass(lambda: backward(tensor, module, *args, **kwargs))  # type: ignore[attr-defined]

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Skip the step on every rank if the gradients it applies were not finite, then step.

        With a ``closure`` (e.g. LBFGS) this is checked after each call of the closure, which runs backward.
        """
        closure = kwargs.get("closure")
        if closure is None:
            self._close_step(optimizer)  # type: ignore[attr-defined]
        else:

            def closure_then_finish() -> Any:
                result = closure()
                self._close_step(optimizer)  # type: ignore[attr-defined]
                return result

            kwargs["closure"] = closure_then_finish
        result = super().optimizer_step(optimizer, **kwargs)  # type: ignore[misc]
        checked = self._checked_parameters()
        if checked is not None:
            self._after_optimizer_step(checked)  # type: ignore[attr-defined]
        return result
