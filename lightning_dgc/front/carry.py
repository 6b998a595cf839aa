"""Several backward passes that each ran the exchange before one optimizer step: one momentum per step
(:class:`GradientCarry`, which every compression front door keeps, :mod:`lightning_dgc.front.core`)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_dgc.exchange.state import ExchangeState


class GradientCarry:
    """Several backward passes that each ran the exchange before one optimizer step: one momentum per step.

    Under DDP such passes add up in ``.grad``. An exchange that applies momentum (DGC's momentum correction,
    the SGD momentum it takes over) must apply it once per optimizer step too, to the step's whole gradient,
    not once per pass. The front doors call :meth:`before_backward` before every backward pass,
    :meth:`after_backward` once it is over, and :meth:`stepped` when an optimizer steps:

    * a parameter whose gradient an earlier pass exchanged, and that no optimizer has stepped since
      (Lightning's manual accumulation, two ``manual_backward`` or ``fabric.backward`` calls before one step,
      the discriminator's gradients carried past the generator's step), enters the pass with its ``.grad``
      set aside and zeroed, so that the pass exchanges its own gradient only; the exchange applies no
      momentum or weight decay to it again (:attr:`ExchangeState.continuing`), and the set-aside gradient is
      added back afterwards. It costs one copy of those gradients while the pass runs;
    * a parameter whose exchanged gradient was dropped (``zero_grad()``) before any optimizer stepped it,
      while the exchange had applied momentum to it, cannot be made to equal DDP (its momentum already moved):
      that is an error at the next backward pass, which says how to fix the loop.
    """

    def __init__(self) -> None:
        self.unstepped: set[str] = set()  # exchanged since their optimizer last stepped
        self.finite = True  # the verdict of every pass whose gradients ``.grad`` holds
        self._set_aside: list[tuple[torch.Tensor, torch.Tensor]] = []

    def before_backward(self, state: ExchangeState, owner: str) -> None:
        carried, dropped = [], []
        for name in sorted(self.unstepped):
            param = state.registered(name)
            if param.grad is not None:
                carried.append(name)
                self._set_aside.append((param, param.grad.clone()))
                param.grad.zero_()
            elif state.settings_for(name).momentum:
                dropped.append(name)
        self.unstepped = set(carried)
        if not carried:
            self.finite = True  # fresh gradients
        state.continuing = frozenset(carried)
        if dropped:
            shown = ", ".join(dropped[:5]) + (f" and {len(dropped) - 5} more" if len(dropped) > 5 else "")
            raise RuntimeError(
                f"{owner}: the gradients of {shown} were exchanged, with momentum applied in the exchange, and then"
                " dropped (`zero_grad()`) before any optimizer stepped them. Under DDP that gradient would be lost"
                " with the optimizer's momentum untouched; here the exchange's momentum has already taken it in."
                " Step the optimizer after each synchronised backward pass (or accumulate without zero_grad),"
                " skip the backward pass instead of discarding its gradients, or use momentum=0 / strategy='ddp'."
            )

    def after_backward(self, state: ExchangeState, finite: bool | None) -> None:
        """``finite``: the verdict of the exchange this pass ran (``None``: it ran none, e.g. under ``no_sync``)."""
        for param, carried in self._set_aside:  # (DDP may have made .grad a view of a rebuilt bucket)
            if param.grad is None:
                param.grad = carried
            else:
                param.grad.add_(carried)
        self._set_aside = []
        state.continuing = frozenset()
        if finite is not None:
            self.finite = self.finite and finite
            if finite:
                self.unstepped.update(
                    name for name in state.param_names.values() if state.registered(name).grad is not None
                )

    def stepped(self, state: ExchangeState, optimizer: Any) -> None:
        """An optimizer stepped: its parameters' gradients are consumed."""
        ids = {id(p) for group in getattr(optimizer, "param_groups", []) for p in group["params"]}
        self.unstepped = {name for name in self.unstepped if id(state.registered(name)) not in ids}
