"""The step of a Trainer front door (:mod:`lightning_dgc.front.strategy`, :mod:`lightning_dgc.front.hsdp`): the
exchange finished right after each backward pass, the optimizer step skipped on every rank when it was not finite.

No Lightning import at module level: the front doors import this while Lightning's import registers their names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["TrainerExchangeSteps"]


class TrainerExchangeSteps:
    """Mixin of a Trainer front door (before its Lightning strategy base, after :class:`ExchangeAccess`): the
    exchange's step finished right after each backward pass, the optimizer step skipped on every rank when it was not
    finite, and the rank checks after it."""

    @override
    def backward(
        self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """Lightning's backward, with the exchange's step finished right after the backward pass itself.

        So the parameters' ``.grad`` hold the averaged update (and the memory is committed, or left as it
        was) before ``on_after_backward`` and anything after it reads them, as under DDP.
        """
        self.pre_backward(closure_loss)  # type: ignore[attr-defined]
        assert self.lightning_module is not None  # type: ignore[attr-defined]
        precision, module = self.precision_plugin, self.lightning_module  # type: ignore[attr-defined]
        closure_loss = precision.pre_backward(closure_loss, module)
        self._backward_pass(lambda: precision.backward(closure_loss, module, optimizer, *args, **kwargs))  # type: ignore[attr-defined]
        closure_loss = precision.post_backward(closure_loss, module)
        self.post_backward(closure_loss)  # type: ignore[attr-defined]
        return closure_loss

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        def closure_then_finish() -> Any:
            result = closure()
            self._close_step(optimizer)  # type: ignore[attr-defined]
            return result

        result = super().optimizer_step(optimizer, closure_then_finish, model, **kwargs)  # type: ignore[misc]
        module = self.lightning_module if self.model is not None else None  # type: ignore[attr-defined]
        self._after_optimizer_step(module.named_parameters() if module is not None else ())  # type: ignore[attr-defined]
        return result
