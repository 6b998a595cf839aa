"""PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019): low-rank gradient compression.

The peer users would pick instead of DGC: every matrix ``M`` (a gradient viewed as ``shape[0] x rest``)
is replaced by a rank-``r`` approximation ``P Q^T`` found by one step of power iteration, and the
factors are all-reduced instead of ``M``. Behaviour follows torch's DDP hook
(``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``), which is the reference: with the same
settings both train to the same parameters. Per bucket and step:

* before ``start_iter`` optimizer steps: plain all-reduce of the bucket (DDP rebuilds its buckets
  after the first step, and compressing from the very start costs accuracy);
* then: 2. **compensate**: add the error the approximation missed last step (error feedback) and keep
  a copy of the result; 3. **select**: ``Q`` from the previous step (warm start, orthogonalised) or
  random (the same seed on every rank), and ``P = M Q``; 4. **exchange**: all-reduce of the tensors
  left uncompressed (too small to gain ``min_compression_rate``), all-reduce of every ``P`` (the hook
  waits for it), orthogonalise, ``Q = M^T P``, all-reduce of every ``Q``; 5. **decode**: ``M ~= P Q^T
  / N``, the error ``M - P Q^T / N`` kept for the next step.

Unlike torch's hook, the error and ``Q`` are kept per parameter name (not per bucket index) and are
committed only when the step is finite on every rank, as every memory here is; they and the random
generator are saved in checkpoints, per rank. The optimizer keeps its own momentum and weight decay.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from lightning_dgc.algorithms.base import (
    Algorithm,
    BucketWork,
    Message,
    TensorSpec,
    WireCost,
    layout_of,
    register,
)
from lightning_dgc.algorithms.powersgd_config import (
    VALUE_BYTES,
    PowerSGDConfig,
    compressed_rank,
    matrix_shape,
)

if TYPE_CHECKING:
    from lightning_dgc.algorithms.context import ExchangeContext
    from lightning_dgc.comm import Collectives, Pending

__all__ = ["VALUE_BYTES", "PowerSGD", "PowerSGDConfig", "compressed_rank", "matrix_shape", "orthogonalize_"]


def orthogonalize_(matrices: Tensor, epsilon: float = 0.0) -> None:
    """Orthonormalise the columns of each ``n x r`` matrix of the batch, in place.

    Gram-Schmidt for ranks up to 2 (and half precision, where QR does not work), QR otherwise, as
    torch's PowerSGD hook decides; with ``epsilon > 0`` a column's norm gets ``epsilon`` added. A column
    that is all zeros (a zero gradient, or a matrix of lower rank than ``r``) stays zeros: torch's hook
    divides it by its zero norm (NaN, with ``epsilon=0``); every other column is bit for bit torch's.
    """
    rank = matrices.shape[2]
    if rank <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        for i in range(rank):
            col = matrices[:, :, i : i + 1]
            norm = torch.norm(col, dim=1, keepdim=True)
            col /= norm + epsilon if epsilon else torch.where(norm == 0, 1.0, norm)
            if i + 1 < rank:
                rest = matrices[:, :, i + 1 :]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
    else:
        r_factor = torch.empty(matrices.shape[0], rank, rank, device=matrices.device, dtype=matrices.dtype)
        torch.linalg.qr(matrices, out=(matrices, r_factor))


@dataclass
class Factor:
    """One compressed tensor: where it is in the bucket, its matrix shape, and views of P and Q."""

    spec: TensorSpec
    n: int
    m: int
    r: int
    p: Tensor  # (1, n, r) view of the plan's flat P
    q: Tensor  # (1, m, r) view of the plan's flat Q


@dataclass
class PowerSGDPlan:
    layout: list[TensorSpec]
    dense_bytes: int
    uncompressed: list[TensorSpec]  # bucket order
    factors: list[Factor]  # grouped by matrix shape, shapes in first-seen order (as torch's hook)
    p_flat: Tensor  # every P of the bucket, all-reduced at once
    q_flat: Tensor  # every Q
    uncompressed_index: Tensor | None  # bucket positions of the uncompressed tensors (None: none)


@dataclass
class PowerSGDWork(BucketWork):
    compressing: bool = True
    warm: bool = False  # Q starts from the previous step's (every compressed tensor has one)
    input_copy: Tensor | None = None  # the error-compensated gradient (for the next error)
    averaged: bool = False  # Q and the uncompressed tensors' sum divided by the world size already
    uncompressed: Pending | None = None
    q: Pending | None = None
    plain: Pending | None = None
    q_start: Tensor | None = None  # warm start: the orthonormal Q this step started from


@register
class PowerSGD(Algorithm[PowerSGDConfig, PowerSGDPlan, PowerSGDWork]):
    """PowerSGD with error feedback and warm start (see the module docstring)."""

    name = "powersgd"
    config_class = PowerSGDConfig
    memory_kinds = ("error", "q")
    residual_kind = "error"
    state_settings = ("matrix_approximation_rank",)

    def __init__(self, config: PowerSGDConfig, state: ExchangeContext) -> None:
        super().__init__(config, state)
        # Seeds of the random Q: the same sequence on every rank, a draw per bucket that starts (or per
        # bucket and step without warm start).
        self.rng = np.random.RandomState(config.seed)
        # Names whose Q was first made in a step not yet known to be committed: (step, skipped steps then).
        # A skipped step leaves that Q at zeros, which must not warm-start the next step.
        self._q_made: dict[str, tuple[int, int]] = {}
        self._rank_warned: set[str] = set()  # parameters already named in the rank-too-large warning

    def compressing(self) -> bool:
        return self.state.step >= self.config.start_iter

    # -- the plan ------------------------------------------------------------------------------------------
    def plan(self, layout: list[TensorSpec], buffer: Tensor) -> PowerSGDPlan:
        device = buffer.device
        uncompressed, by_shape = [], {}
        for spec in layout:
            r = compressed_rank(spec, self.config)
            if r:
                n, m = matrix_shape(spec)
                by_shape.setdefault((n, m), []).append(spec)
            else:
                uncompressed.append(spec)
        self._warn_rank_too_large(uncompressed)
        grouped = [spec for specs in by_shape.values() for spec in specs]
        p_flat = torch.empty(
            sum(matrix_shape(s)[0] * compressed_rank(s, self.config) for s in grouped), device=device
        )
        q_flat = torch.empty(
            sum(matrix_shape(s)[1] * compressed_rank(s, self.config) for s in grouped), device=device
        )
        factors, p_at, q_at = [], 0, 0
        for spec in grouped:
            (n, m), r = matrix_shape(spec), compressed_rank(spec, self.config)
            p, q = p_flat[p_at : p_at + n * r].view(1, n, r), q_flat[q_at : q_at + m * r].view(1, m, r)
            factors.append(Factor(spec, n, m, r, p, q))
            p_at, q_at = p_at + n * r, q_at + m * r
        index = None
        if uncompressed:
            index = torch.cat(
                [torch.arange(s.offset, s.offset + s.numel, device=device) for s in uncompressed]
            )
        return PowerSGDPlan(
            layout, buffer.numel() * buffer.element_size(), uncompressed, factors, p_flat, q_flat, index
        )

    def _warn_rank_too_large(self, uncompressed: list[TensorSpec]) -> None:
        """Warn (once per parameter) about matrices left dense only because ``matrix_approximation_rank``
        is too large for them: a rank-1 approximation would have been compressed."""
        cfg = self.config
        rank_one = replace(cfg, matrix_approximation_rank=1)
        dense = [s for s in uncompressed if s.name not in self._rank_warned and compressed_rank(s, rank_one)]
        if not dense:
            return
        self._rank_warned.update(s.name for s in dense)
        limits = []
        for s in dense:
            n, m = matrix_shape(s)
            largest = min(n, m, math.ceil(n * m / ((n + m) * cfg.min_compression_rate)) - 1)
            limits.append(f"{s.name} ({n} x {m}): at most {largest}")
        warnings.warn(
            f"PowerSGD: matrix_approximation_rank={cfg.matrix_approximation_rank} is too large for"
            f" {len(dense)} matrix(es), which are therefore all-reduced dense every step: {'; '.join(limits)}"
            f" (min_compression_rate={cfg.min_compression_rate:g}). Lower `matrix_approximation_rank` to"
            " compress them.",
            stacklevel=2,
        )

    def _matrix(self, work: PowerSGDWork, factor: Factor) -> Tensor:
        spec = factor.spec
        return work.flat[spec.offset : spec.offset + spec.numel].view(1, factor.n, factor.m)

    # -- step 2 ----------------------------------------------------------------------------------------------
    def compensate(self, plan: PowerSGDPlan, grads: list[Tensor], flat: Tensor) -> PowerSGDWork:
        work = PowerSGDWork(grads, flat, compressing=self.compressing())
        if not work.compressing:
            return work
        memory = self.state.memory
        # Buffers that live across steps are made here, on the hook's stream, never in the decode.
        if self.config.warm_start:
            work.warm = all(self._has_q(f.spec.name) for f in plan.factors)
            for f in plan.factors:
                memory.buffer("q", f.spec.name, (f.m, f.r), flat.device)
                memory.scratch("q", f.spec.name)
                if not work.warm:
                    self._q_made[f.spec.name] = (self.state.step, self.state.skipped_steps)
        if not self.config.use_error_feedback:
            return work
        errors = [memory.buffer("error", s.name, s.numel, flat.device) for s in plan.layout]
        torch._foreach_add_(grads, errors)
        if self.state.finish_writes_grads:  # the bucket keeps M until the commit (replay) reads it
            memory.note_replay([s.name for s in plan.layout], lambda skip: self.replay(plan, work, skip))
        else:  # the decode overwrites M: a copy, and the new error into scratch made here (not in the decode)
            work.input_copy = flat.clone()
            work.keep.append(work.input_copy)
            for s in plan.layout:
                memory.scratch("error", s.name)
        return work

    def _has_q(self, name: str) -> bool:
        """Whether ``name`` has a committed ``Q`` from an earlier step (one made in a skipped step has not)."""
        if not self.state.memory.has("q", name):
            return False
        made = self._q_made.get(name)
        if made is None:  # committed long ago, or loaded from a checkpoint
            return True
        step, skipped = made
        if self.state.step > step and self.state.skipped_steps == skipped:  # no step skipped since
            del self._q_made[name]
            return True
        return False

    def replay(self, plan: PowerSGDPlan, work: PowerSGDWork, skip: Any) -> None:
        """The new error ``M - P Q^T / N`` (uncompressed tensors: ``M`` minus their average), written in place
        at commit from ``M`` in the bucket, with the decode's own operations (the same bits)."""
        self._average(plan, work)
        errors = self.state.memory.committed["error"]
        averages = {}
        if work.uncompressed is not None:
            parts = work.uncompressed.output.split([s.numel for s in plan.uncompressed])
            averages = {s.name: part for s, part in zip(plan.uncompressed, parts, strict=True)}
        for f in plan.factors if work.q is not None else ():
            if not skip(f.spec.name):
                torch.bmm(f.p, f.q.transpose(1, 2), out=errors[f.spec.name].view(1, f.n, f.m))
        for spec in plan.layout:
            if skip(spec.name):
                continue
            error, local = errors[spec.name], work.flat[spec.offset : spec.offset + spec.numel]
            torch.sub(local, averages.get(spec.name, error), out=error)

    def _average(self, plan: PowerSGDPlan, work: PowerSGDWork) -> None:
        """Divide what was summed by the world size, once (the replay and the decode both read it)."""
        if work.averaged:
            return
        work.averaged = True
        if work.uncompressed is not None:
            work.uncompressed.output.div_(self.state.world_size)
        if work.q is not None:
            plan.q_flat.div_(self.state.world_size)

    def decoded_finite(self, plan: PowerSGDPlan, work: PowerSGDWork) -> Tensor | None:
        if not work.compressing or work.input_copy is not None or not self.config.use_error_feedback:
            return None  # nothing to gain: decode in the callback
        sums = [p.output.sum() for p in (work.uncompressed, work.q) if p is not None]
        return torch.isfinite(torch.stack(sums).sum()) if sums else torch.ones((), dtype=torch.bool)

    # -- step 3 ----------------------------------------------------------------------------------------------
    def select(self, plan: PowerSGDPlan, work: PowerSGDWork) -> None:
        """``Q`` (warm or random) and ``P = M Q`` for every compressed tensor."""
        if not work.compressing or not plan.factors:
            return
        memory, epsilon = self.state.memory, self.config.orthogonalization_epsilon
        if work.warm:
            for f in plan.factors:
                f.q.copy_(memory.committed["q"][f.spec.name].view_as(f.q))
                orthogonalize_(f.q, epsilon)
        else:
            # The same seed on every rank; a CPU generator of its own (the global one stays untouched, and
            # simulated ranks in threads do not share it), drawing what torch's hook draws.
            generator = torch.Generator().manual_seed(int(self.rng.randint(1_000_000_000)))
            for f in plan.factors:
                f.q.copy_(torch.randn(*f.q.shape, device="cpu", generator=generator))
                orthogonalize_(f.q, epsilon)
        if self.config.warm_start:
            work.q_start = plan.q_flat.clone()
            work.keep.append(work.q_start)
        for f in plan.factors:
            torch.bmm(self._matrix(work, f), f.q, out=f.p)
        plan.p_flat[:1].add_(work.poison)  # NaN in P is NaN in every Q and so in every decoded matrix

    # -- step 4 ----------------------------------------------------------------------------------------------
    def exchange(self, plan: PowerSGDPlan, work: PowerSGDWork, collectives: Collectives) -> list[Pending]:
        if not work.compressing:
            work.plain = collectives.all_reduce(
                work.flat, "all-reduce of the gradient (before PowerSGD starts)"
            )
            return [work.plain]
        if plan.uncompressed_index is not None:
            values = work.flat.index_select(0, plan.uncompressed_index)
            values[:1].add_(work.poison)
            work.uncompressed = collectives.all_reduce(values, "all-reduce of the uncompressed tensors")
        if not plan.factors:
            return [p for p in (work.uncompressed,) if p is not None]
        # P must be summed before it is orthogonalised and Q computed from it: the hook waits for it
        # (on CUDA only the stream waits), so that every collective starts from the hook's thread.
        collectives.all_reduce(plan.p_flat, "all-reduce of PowerSGD's P").wait()
        for f in plan.factors:
            orthogonalize_(f.p, self.config.orthogonalization_epsilon)
            torch.bmm(self._matrix(work, f).transpose(1, 2), f.p, out=f.q)
        work.q = collectives.all_reduce(plan.q_flat, "all-reduce of PowerSGD's Q")
        return [p for p in (work.uncompressed, work.q) if p is not None]

    # -- step 5 ----------------------------------------------------------------------------------------------
    def decode(self, plan: PowerSGDPlan, work: PowerSGDWork) -> Tensor:
        world, memory, result = self.state.world_size, self.state.memory, work.flat
        if work.plain is not None:
            return result.div_(world)
        self._average(plan, work)
        if work.uncompressed is not None:
            result.index_copy_(0, plan.uncompressed_index, work.uncompressed.output)
        if work.q is not None:
            q_at = 0
            for f in plan.factors:
                torch.bmm(f.p, f.q.transpose(1, 2), out=self._matrix(work, f))
                if self.config.warm_start:
                    # A column of Q that came out all zeros (a zero or rank-deficient gradient) would start
                    # every later step at zero and never leave it (torch's hook: NaN, or stuck with an
                    # epsilon): the next step starts from this step's column instead. Identical on all ranks.
                    q, start = f.q.view(f.m, f.r), work.q_start[q_at : q_at + f.m * f.r].view(f.m, f.r)
                    name = f.spec.name
                    zero = torch.linalg.vector_norm(q, dim=0, keepdim=True) == 0
                    torch.where(zero, start, q, out=memory.scratch("q", name))
                    memory.stage("q", name)
                q_at += f.m * f.r
        if work.input_copy is not None:  # error feedback: what the approximation missed, per tensor
            for spec in plan.layout:
                part = slice(spec.offset, spec.offset + spec.numel)
                torch.sub(work.input_copy[part], result[part], out=memory.scratch("error", spec.name))
                memory.stage("error", spec.name)
        return result

    # -- the cost ----------------------------------------------------------------------------------------------
    @classmethod
    def wire_cost(
        cls, config: PowerSGDConfig, layout: list[TensorSpec], world_size: int, dense_bytes: int
    ) -> WireCost:
        numel = sum(s.numel for s in layout)
        uncompressed = sum(s.numel for s in layout if not compressed_rank(s, config))
        p = sum(matrix_shape(s)[0] * compressed_rank(s, config) for s in layout)
        q = sum(matrix_shape(s)[1] * compressed_rank(s, config) for s in layout)
        messages = []
        if uncompressed:
            messages.append(Message("all_reduce", uncompressed * VALUE_BYTES, "dense"))
        if p:
            messages.append(Message("all_reduce", p * VALUE_BYTES, "payload", blocking=True))
            messages.append(Message("all_reduce", q * VALUE_BYTES, "payload"))
        return WireCost(tuple(messages), dense_bytes, numel, 0, uncompressed + p + q)

    def cost(self, plan: PowerSGDPlan) -> WireCost:
        if self.compressing():
            return super().cost(plan)
        return WireCost((Message("all_reduce", plan.dense_bytes, "dense"),), plan.dense_bytes,
                        sum(s.numel for s in plan.layout), 0, sum(s.numel for s in plan.layout))  # fmt: skip

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def memory_shape(self, kind: str, name: str, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        spec = layout_of([name], [shape])[0]
        if kind == "error" and self.config.use_error_feedback:
            return (spec.numel,)
        if kind == "q" and self.config.warm_start and compressed_rank(spec, self.config):
            return (matrix_shape(spec)[1], compressed_rank(spec, self.config))
        return None

    def extra_state(self) -> dict[str, Any]:
        kind, keys, position, has_gauss, cached = self.rng.get_state()
        return {
            "rng": {
                "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                "position": int(position),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            }  # fmt: skip
        }

    def load_extra_state(self, state: dict[str, Any]) -> None:
        rng = state.get("rng")
        if rng is not None:
            keys = rng["keys"].numpy().astype(np.uint32)
            self.rng.set_state(("MT19937", keys, rng["position"], rng["has_gauss"], rng["cached_gaussian"]))
