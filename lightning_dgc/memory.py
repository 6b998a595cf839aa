"""Momentum correction, local clipping, momentum factor masking and the residual memory.

DGC (Lin et al., 2018) keeps, per compressed tensor and per worker,

* ``momentum`` u: the local momentum, ``u <- m * u + g`` (Nesterov: ``u <- m * (u + g)``);
* ``velocity`` v: the accumulated, not yet sent update, ``v <- v + u`` (Nesterov: ``v <- v + u + g``).

Values are selected from v; what is sent is cleared from v and, with momentum factor masking, from
u, so that stale momentum does not keep pushing coordinates that were just applied.

Every update is computed into *scratch* buffers and only committed when the whole step turned out
finite on every rank (:meth:`ResidualMemory.commit`); a skipped step (inf/NaN anywhere, e.g. under a
GradScaler) leaves the memory exactly as it was, so nothing is lost or poisoned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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


def bucket_order_flat(tensor: Tensor) -> Tensor:
    """``tensor`` as a 1-D tensor in the order DDP lays its gradient out in a bucket.

    DDP matches the parameter's memory layout when the parameter is non-overlapping and dense
    (``channels_last`` weights included) and falls back to C order otherwise; so the flat bucket
    segment of a ``channels_last`` weight is in memory order, not in ``reshape(-1)``'s logical order.
    A view where possible (always for dense tensors), else a copy.
    """
    if tensor.is_contiguous():
        return tensor.view(-1)
    by_stride = tensor.permute(sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d)))
    if by_stride.is_contiguous():  # non-overlapping and dense: memory order
        return by_stride.view(-1)
    return tensor.reshape(-1)


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


#: Tensors with at least this many values get momentum correction tensor by tensor with fused
#: ``out=`` operations (fewest passes over memory); smaller ones are batched into ``torch._foreach_*``
#: calls (fewest operator dispatches, which dominate for small tensors).
FOREACH_MAX_NUMEL = 1 << 16


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


def momentum_correction_each(grads: Sequence[Tensor], buffers: Sequence[_Buffers], momentum: float,
                             nesterov: bool) -> None:  # fmt: skip
    """:func:`momentum_correction` for many tensors: committed buffers in, scratch buffers out.

    Large tensors go one by one; the small ones together through a handful of ``torch._foreach_*``
    calls whatever their number (a Python loop costs several microseconds per operation, which for a
    model of a few hundred small tensors was most of the hook's time).
    """
    small: list[tuple[Tensor, _Buffers]] = []
    for g, b in zip(grads, buffers, strict=True):
        if g.numel() >= FOREACH_MAX_NUMEL:
            momentum_correction(
                g, b.momentum, b.velocity, momentum, nesterov, b.momentum_next, b.velocity_next
            )
        else:
            small.append((g, b))
    if not small:
        return
    g = [t for t, _ in small]
    mom = [b.momentum for _, b in small]
    mom_out = [b.momentum_next for _, b in small]
    vel_out = [b.velocity_next for _, b in small]
    torch._foreach_copy_(vel_out, [b.velocity for _, b in small])
    if momentum == 0.0:
        torch._foreach_add_(vel_out, g)
        return
    if nesterov:  # u' = m (u + g); v' = v + u' + g
        torch._foreach_copy_(mom_out, mom)
        torch._foreach_add_(mom_out, g)
        torch._foreach_mul_(mom_out, momentum)
        torch._foreach_add_(vel_out, mom_out)
        torch._foreach_add_(vel_out, g)
    else:  # u' = m u + g; v' = v + u'
        torch._foreach_copy_(mom_out, g)
        torch._foreach_add_(mom_out, mom, alpha=momentum)
        torch._foreach_add_(vel_out, mom_out)


@dataclass
class _Buffers:
    """Committed and scratch buffers of one parameter (flat fp32)."""

    momentum: Tensor
    velocity: Tensor
    momentum_next: Tensor
    velocity_next: Tensor


@dataclass
class _Pending:
    """An update computed this step that waits for :meth:`ResidualMemory.commit`."""

    sent: Tensor | None  # indices cleared from the velocity (None: the whole tensor was sent)
    masked: bool  # whether the sent indices are also cleared from the momentum


@dataclass
class ResidualMemory:
    """Per-parameter momentum and velocity buffers, keyed by parameter name.

    Names, not DDP bucket indices, are the keys: DDP rebuilds its buckets after the first step.
    Dense (uncompressed) parameters use the same buffers for their plain momentum (``velocity``
    stays zero for them).
    """

    buffers: dict[str, _Buffers] = field(default_factory=dict)
    pending: dict[str, _Pending] = field(default_factory=dict)

    def get(self, name: str, numel: int, device: torch.device) -> _Buffers:
        """The buffers of ``name``, created as zeros on first use."""
        buf = self.buffers.get(name)
        if buf is None or buf.momentum.numel() != numel or buf.momentum.device != device:
            zeros = [torch.zeros(numel, dtype=torch.float32, device=device) for _ in range(4)]
            buf = _Buffers(*zeros)
            self.buffers[name] = buf
        return buf

    def set_momentum(self, name: str, momentum: Tensor) -> None:
        """Start ``name``'s momentum from ``momentum`` (flat, in bucket order), its residual from zero."""
        flat = momentum.detach().reshape(-1)
        self.get(name, flat.numel(), flat.device).momentum.copy_(flat)

    def stage(self, name: str, sent: Tensor | None, masked: bool) -> None:
        """Record that ``name``'s scratch buffers hold this step's update (sent = indices sent)."""
        self.pending[name] = _Pending(sent, masked)

    def commit(self) -> None:
        """Make every staged update the committed state, then clear what was sent."""
        zero = []
        for name, pend in self.pending.items():
            buf = self.buffers[name]
            buf.momentum, buf.momentum_next = buf.momentum_next, buf.momentum
            buf.velocity, buf.velocity_next = buf.velocity_next, buf.velocity
            if pend.sent is None:
                zero.append(buf.velocity)
                if pend.masked:
                    zero.append(buf.momentum)
            else:
                buf.velocity.index_fill_(0, pend.sent, 0.0)
                if pend.masked:
                    buf.momentum.index_fill_(0, pend.sent, 0.0)
        if zero:
            torch._foreach_zero_(zero)
        self.pending.clear()

    def discard(self) -> None:
        """Forget every staged update: the committed state stays as it was before the step."""
        self.pending.clear()

    def residual_norm(self) -> float:
        """L2 norm of all velocities: the size of what is held back, for monitoring."""
        if not self.buffers:
            return 0.0
        sq = sum(float(torch.linalg.vector_norm(b.velocity)) ** 2 for b in self.buffers.values())
        return sq**0.5

    def state_dict(self) -> dict[str, dict[str, Tensor]]:
        """Committed buffers only (``{"momentum": {name: t}, "velocity": {name: t}}``), on CPU."""
        return {
            "momentum": {n: b.momentum.detach().cpu().clone() for n, b in self.buffers.items()},
            "velocity": {n: b.velocity.detach().cpu().clone() for n, b in self.buffers.items()},
        }

    def load_state_dict(
        self, state: dict[str, dict[str, Tensor]], device: torch.device | None = None
    ) -> None:
        """Restore buffers saved by :meth:`state_dict` (scratch buffers are recreated)."""
        self.buffers.clear()
        self.pending.clear()
        for name, mom in state["momentum"].items():
            vel = state["velocity"][name]
            dev = device if device is not None else mom.device
            self.buffers[name] = _Buffers(
                mom.to(dev, torch.float32).clone(),
                vel.to(dev, torch.float32).clone(),
                torch.zeros_like(mom, dtype=torch.float32, device=dev),
                torch.zeros_like(vel, dtype=torch.float32, device=dev),
            )
