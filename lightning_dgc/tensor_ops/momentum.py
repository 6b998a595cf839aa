"""The tensor math of the exchange's momentum: DGC's momentum correction (Lin et al., 2018: ``u <- m u + g``,
``v <- v + u``, Nesterov ``u <- m (u + g)``, ``v <- v + u + g``), its continuation by another backward pass
of the same optimizer step, local clipping, and the conversion between SGD's momentum buffer and the
exchange's momentum. Pure functions on tensors: no state, no ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def clip_by_norm_(grad: Tensor, max_norm: float) -> Tensor:
    """Scale ``grad`` in place so that its L2 norm is at most ``max_norm``; return it.

    DGC's local gradient clipping: applied on each worker before accumulation, with ``max_norm``
    already scaled by ``N ** -0.5`` by the caller (the sum of N independent gradients has about
    ``sqrt(N)`` times the norm of one).
    """
    clip_each_by_norm_([grad], max_norm)
    return grad


def clip_each_by_norm_(grads: Sequence[Tensor], max_norm: float) -> None:
    """:func:`clip_by_norm_` on every tensor of ``grads`` (each by its own norm), in a few fused ops."""
    if not grads:
        return
    norms = torch.stack(torch._foreach_norm(list(grads)))
    scales = torch.clamp(max_norm / (norms + 1e-6), max=1.0)
    torch._foreach_mul_(list(grads), list(scales.to(grads[0].dtype).unbind()))


def momentum_from_sgd(buffer: Tensor, momentum: float, nesterov: bool, dense: bool) -> Tensor:
    """The momentum ``u`` that continues SGD's ``momentum_buffer`` (flat, in bucket order) exactly.

    SGD keeps ``b <- m b + g`` and steps by ``b`` (Nesterov: by ``g + m b``). Momentum correction
    steps by ``u <- m u + g`` (the same ``b``), and for Nesterov by ``u + g`` with ``u <- m (u + g)``,
    that is ``u = m b``. Tensors averaged dense keep SGD's own ``b`` (:func:`_apply_dense_momentum`).
    """
    return buffer * momentum if nesterov and not dense else buffer


def momentum_to_sgd(u: Tensor, momentum: float, nesterov: bool, dense: bool) -> Tensor:
    """SGD's ``momentum_buffer`` that continues the momentum ``u`` (the inverse of :func:`momentum_from_sgd`)."""
    return u / momentum if nesterov and not dense else u


def momentum_correction(
    grad: Tensor,
    momentum_buf: Tensor,
    velocity_buf: Tensor,
    momentum: float,
    nesterov: bool,
    momentum_out: Tensor,
    velocity_out: Tensor,
) -> None:
    """Write the corrected momentum and velocity for this step into ``momentum_out``/``velocity_out``.

    The inputs stay untouched (they are the committed state). ``momentum == 0`` reduces to plain
    error feedback: ``v <- v + g``.
    """
    if momentum == 0.0:
        torch.add(velocity_buf, grad, out=velocity_out)
        return
    if nesterov:
        torch.add(momentum_buf, grad, out=momentum_out)
        momentum_out.mul_(momentum)
        torch.add(velocity_buf, momentum_out, out=velocity_out)
        velocity_out.add_(grad)
    else:
        torch.mul(momentum_buf, momentum, out=momentum_out)
        momentum_out.add_(grad)
        torch.add(velocity_buf, momentum_out, out=velocity_out)


def continuation_factors(momentum: float, nesterov: bool) -> tuple[float, float]:
    """``(c_u, c_v)``: what another backward pass of the same optimizer step adds to ``u`` and ``v`` per unit
    of its gradient ``g``, so that the momentum is applied once per optimizer step, however many backward
    passes feed it.

    One pass of the step's whole gradient ``G = g_1 + g_2`` gives ``u' = m u + G`` and ``v' = v + u'``
    (Nesterov: ``u' = m (u + G)``, ``v' = v + u' + G``). The first pass applies the momentum to ``g_1``; the
    next one adds what ``g_2`` contributes to both: ``(1, 1)``, Nesterov ``(m, 1 + m)``. Plain error
    feedback (``m = 0``) is ``(0, 1)``: every pass is ``v <- v + g``.
    """
    if momentum == 0.0:
        return 0.0, 1.0
    return (momentum, 1.0 + momentum) if nesterov else (1.0, 1.0)


def compensated_velocity_each(
    grads: Sequence[Tensor],
    velocity: Sequence[Tensor],
    out: Sequence[Tensor],
    momentum: float,
    nesterov: bool,
    momentum_buf: Sequence[Tensor] = (),
    continuing: bool = False,
) -> None:
    """This step's velocity ``v'`` (:func:`momentum_correction`) into ``out``; the memory stays untouched.

    What selection reads, in a buffer that lives only from the hook until the selection is done. The
    memory itself is updated at commit by :func:`momentum_correction_each_`, with the same operations in
    the same order, so that the velocity it commits is, bit for bit, the one the values were selected
    from (IEEE addition is commutative: ``u' + v`` and ``v + u'`` are the same number).

    ``continuing``: another backward pass of an optimizer step whose momentum an earlier pass applied
    (:func:`continuation_factors`): ``v' = v + c g``, the momentum not decayed again.
    """
    if not grads:
        return
    out, grads = list(out), list(grads)
    if momentum == 0.0 or continuing:  # v' = v + g (continuing: v + c g)
        torch._foreach_copy_(out, list(velocity))
        torch._foreach_add_(out, grads, alpha=continuation_factors(momentum, nesterov)[1] if continuing else 1.0)
        return
    torch._foreach_copy_(out, list(momentum_buf))
    if nesterov:  # u' = m (u + g); v' = u' + v + g
        torch._foreach_add_(out, grads)
        torch._foreach_mul_(out, momentum)
        torch._foreach_add_(out, list(velocity))
        torch._foreach_add_(out, grads)
    else:  # u' = m u + g; v' = u' + v
        torch._foreach_mul_(out, momentum)
        torch._foreach_add_(out, grads)
        torch._foreach_add_(out, list(velocity))


def momentum_correction_each_(
    grads: Sequence[Tensor],
    velocity: Sequence[Tensor],
    momentum: float,
    nesterov: bool,
    momentum_buf: Sequence[Tensor] = (),
    continuing: bool = False,
) -> None:
    """Momentum correction in place: ``u <- u'``, ``v <- v'`` (the commit of :func:`compensated_velocity_each`)."""
    if not grads:
        return
    grads, velocity = list(grads), list(velocity)
    if momentum == 0.0:
        torch._foreach_add_(velocity, grads)
        return
    u = list(momentum_buf)
    if continuing:  # u <- u + c_u g, v <- v + c_v g (see continuation_factors)
        to_momentum, to_velocity = continuation_factors(momentum, nesterov)
        torch._foreach_add_(u, grads, alpha=to_momentum)
        torch._foreach_add_(velocity, grads, alpha=to_velocity)
        return
    if nesterov:
        torch._foreach_add_(u, grads)
        torch._foreach_mul_(u, momentum)
        torch._foreach_add_(velocity, u)
        torch._foreach_add_(velocity, grads)
    else:
        torch._foreach_mul_(u, momentum)
        torch._foreach_add_(u, grads)
        torch._foreach_add_(velocity, u)
