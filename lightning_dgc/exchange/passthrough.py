"""DDP's own step at density 1: the bucket all-reduced, nothing selected, nothing held back.

At density 1 DGC and DEFT (``Algorithm.dense_is_ddp``) send every value, so a step there is DDP + SGD: each rank
sends its velocity whole (``v + m u + g``, the momentum it took over from SGD applied), and the average is the
update. Once no rank holds a residual (at the start of a run, or after one such step), the ranks' momenta enter
that average only through their mean. :func:`enter_passthrough` then replaces every rank's momentum by the mean
(one all-reduce), and from the next backward pass the hook runs :func:`exchange_passthrough`: each bucket divided
by the world size and all-reduced in place, as DDP's default hook does, and after the backward pass SGD's weight
decay and momentum on the average (:func:`momentum_on_average`), as the optimizer would apply them. A run dense
from its start is then DDP's, bit for bit. Any other exchange (another density, a backward pass that adds to a
step an earlier pass exchanged, a non-fp32 bucket) leaves it; the front doors try to enter it again before the
next backward pass at density 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_dgc.algorithms import BucketWork, Message, WireCost
from lightning_dgc.comm import Collectives
from lightning_dgc.tensor_ops.memory import bucket_order_flat

if TYPE_CHECKING:
    from lightning_dgc.algorithms.sparse import SparsePlan
    from lightning_dgc.exchange.state import ExchangeState

__all__ = ["can_pass_through", "enter_passthrough", "exchange_passthrough", "momentum_on_average"]

#: The measured extras of a bucket whose exchange measured none (``BucketWork.stats``).
_NOTHING_MEASURED = BucketWork([], torch.empty(0))


def can_pass_through(state: ExchangeState) -> bool:
    """Whether ``state``'s run may take DDP's own step at density 1: a flat exchange of an algorithm whose dense
    step is DDP's (``Algorithm.dense_is_ddp``: DGC, DEFT), fp32 parameters, and no local clipping (which acts on
    each rank's gradient before the average)."""
    return (
        state.topology is None and state.algorithm.dense_is_ddp and state.config.density is not None
        and getattr(state.config, "local_clip_norm", None) is None
        and all(state.param(n).dtype == torch.float32 for n in state.param_names.values())
    )  # fmt: skip


def enter_passthrough(state: ExchangeState, collectives: Collectives | None = None) -> bool:
    """Take DDP's own step from the next backward pass on, if no rank holds a residual: every rank at once (a
    collective over ``collectives``, by default the state's without ``density="auto"``'s timing: the momenta
    averaged, the residual's sum of squares with them). The front doors call it before a backward pass at
    density 1. Returns whether it was entered."""
    if not can_pass_through(state) or state.density != 1.0:
        return False
    if collectives is None:
        collectives = state.collectives.unwrapped
    committed = state.memory.committed
    names = sorted(n for n in committed.get("momentum", {}) if not state.is_dense(n))  # dense ones are one already
    momenta = [committed["momentum"][n] for n in names]
    residual = list(committed.get("velocity", {}).values())
    device = state.param(next(iter(state.param_names.values()))).device
    held = torch.stack([v.square().sum() for v in residual]).sum() if residual else torch.zeros((), device=device)
    flat = torch.cat([*(m.reshape(-1) for m in momenta), held.reshape(1).to(device)])
    collectives.all_reduce(flat, "all-reduce of the momenta (entering DDP's step)").wait()
    if float(flat[-1]) != 0.0:
        return False
    if momenta:
        flat.div_(state.world_size)
        torch._foreach_copy_(momenta, list(flat[:-1].split([m.numel() for m in momenta])))
    state.passthrough = True
    return True


def exchange_passthrough(
    state: ExchangeState, plan: SparsePlan, params: list[Tensor], buffer: Tensor
) -> torch.futures.Future[Tensor]:
    """DDP's own step for a bucket of ``params`` (in ``state.passthrough``; ``plan``: the bucket's, from
    ``state.plan``): the bucket divided by the world size and all-reduced in place, as DDP's default hook does;
    once the backward pass is over, SGD's weight decay and momentum (the optimizer's, taken over) on the average
    (:func:`momentum_on_average`), in ``finish_step()``. The step is skipped on every rank if the average is not
    finite, as any other exchange's."""
    nbytes = plan.dense_bytes
    cost = WireCost((Message("all_reduce", nbytes, "dense"),), nbytes, sum(s.numel for s in plan.layout))
    pending = state.collectives.all_reduce(buffer.div_(state.world_size), "all-reduce of the bucket (dense)")

    def done() -> Tensor:
        state.memory.note_finite(torch.isfinite(buffer.sum()))
        return buffer

    scale = state.grad_scale
    return state.record(
        cost, _NOTHING_MEASURED, 0.0, [pending], done, buffer.device,
        deliver=lambda finite: momentum_on_average(state, plan, params, scale) if finite else None,
    )  # fmt: skip


def momentum_on_average(state: ExchangeState, plan: SparsePlan, params: list[Tensor], scale: float) -> None:
    """SGD's weight decay and momentum on the averaged gradients of ``params`` (in ``.grad``), in place, grouped as
    the top-k plan groups them for its own step (``decay_groups``, ``memory_groups``, ``dense_momentum_groups``):
    ``g' = g + wd p``; ``b' = m b + g'``, ``.grad = b'`` (Nesterov ``g' + m b'``); for a tensor whose momentum the
    exchange keeps as DGC's ``u = m b`` (not averaged dense, Nesterov), ``u' = m (u + g')``, ``.grad = g' + u'``.
    ``scale``: the loss scale the gradients carry (divided out of what enters the momentum). A parameter
    without a gradient (unused on every rank) is neither decayed nor has its momentum moved, as under SGD."""
    memory, entries = state.memory, plan.entries
    momentum_groups = [  # (momentum, DGC's u convention, Nesterov, members)
        *((m, nesterov, nesterov, members) for (m, nesterov), members in plan.memory_groups if m),
        *((m, False, nesterov, members) for (m, nesterov), members in plan.dense_momentum_groups if m),
    ]
    touched = {i for _, members in plan.decay_groups for i in members}
    touched.update(i for *_, members in momentum_groups for i in members)
    grads = {i: bucket_order_flat(params[i].grad) for i in sorted(touched) if params[i].grad is not None}
    if scale != 1.0:
        torch._foreach_mul_(list(grads.values()), 1.0 / scale)
    for decay, members in plan.decay_groups:
        used = [i for i in members if i in grads]
        if used:
            weights = [bucket_order_flat(params[i].detach()) for i in used]
            torch._foreach_add_([grads[i] for i in used], weights, alpha=decay)
    for momentum, u_convention, nesterov, members in momentum_groups:
        used = [i for i in members if i in grads]
        if not used:
            continue
        g = [grads[i] for i in used]
        momenta = [memory.buffer("momentum", entries[i].name, entries[i].numel, g[0].device) for i in used]
        if u_convention:  # u' = m (u + g); d = g + u'
            torch._foreach_add_(momenta, g)
            torch._foreach_mul_(momenta, momentum)
            torch._foreach_add_(g, momenta)
        else:  # b' = m b + g; d = b' (Nesterov: g + m b')
            torch._foreach_mul_(momenta, momentum)
            torch._foreach_add_(momenta, g)
            if nesterov:
                torch._foreach_add_(g, momenta, alpha=momentum)
            else:
                torch._foreach_copy_(g, momenta)
    if scale != 1.0:
        torch._foreach_mul_(list(grads.values()), scale)
