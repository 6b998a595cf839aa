"""The DDP communication hook of DGC.

``dgc_hook(state, bucket)`` replaces DDP's dense all-reduce of one gradient bucket. Steps:

1. **prepare**: view the bucket per parameter; divide out the loss scale; local clipping; weight decay.
2. **compensate**: momentum correction into scratch buffers (``u' = m u + g``, ``v' = v + u'``).
3. **select**: exactly k indices per compressed tensor from ``v'`` (sampled threshold or exact top-k),
   written with their values straight into the bucket's preallocated payload.
4. **exchange**: one all-gather of the payloads; one all-reduce of the tensors averaged dense.
5. **decompress**: scatter-add every rank's values, divide by the world size; dense momentum.
6. **update memory**: stage the scratch buffers and the sent indices; the strategy commits them
   (or discards them if any rank saw inf/NaN) once the whole backward pass is done.

A tensor is handled in one of three ways, decided once per bucket layout and density (the *plan*):
``sparse`` (compressed), ``full`` (density so high that sending everything dense is cheaper: the
velocity is all-reduced and cleared, which is what selecting every index means) and ``dense``
(too small to compress: plain averaging, then the optimizer's momentum in the hook).

DDP checks the hook's annotations literally, so this module does not use postponed annotations.
"""

import math
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dgc import comm
from lightning_dgc.compression import sampled_topk, topk_indices
from lightning_dgc.memory import clip_by_norm_, momentum_correction
from lightning_dgc.state import DGCState, ParamSettings

Kind = Literal["sparse", "full", "dense"]


@dataclass
class _Entry:
    name: str
    param: Tensor
    offset: int  # into the bucket's flat buffer
    numel: int
    kind: Kind
    k: int  # values sent per step (sparse) or numel (full/dense)
    settings: ParamSettings


@dataclass
class _Plan:
    entries: list[_Entry]
    k_total: int
    dense_numel: int
    payload: Tensor  # this rank's payload (uint8), reused every step
    gathered: Tensor  # every rank's payload, concatenated (gloo wants a flat output), reused
    dense_bytes: int  # what DDP would send for this bucket


def tensor_kind(numel: int, ndim: int, k: int, state: DGCState) -> Kind:
    """How one tensor is exchanged (see the module docstring)."""
    if ndim <= 1 or numel < state.config.min_compress_numel:
        return "dense"
    value_bytes = state.value_dtype.itemsize
    if k * (comm.INDEX_BYTES + value_bytes) >= numel * 4:
        return "full"
    return "sparse"


def values_per_step(numel: int, density: float) -> int:
    """k for a tensor of ``numel`` values: ``ceil(density * numel)``, at least 1."""
    return min(numel, max(1, math.ceil(density * numel)))


def _plan(state: DGCState, bucket: dist.GradBucket) -> _Plan:
    params = bucket.parameters()
    key = (tuple(id(p) for p in params), state.config.density, state.config.value_dtype)
    plan = state._plans.get(key)
    if plan is not None:
        return plan
    entries, offset, k_total, dense_numel = [], 0, 0, 0
    for p in params:
        name = state.name_of(p)
        n = p.numel()
        k = values_per_step(n, state.config.density)
        kind = tensor_kind(n, p.dim(), k, state)
        if kind == "sparse":
            k_total += k
        else:
            k = n
            dense_numel += n
        entries.append(_Entry(name, p, offset, n, kind, k, state.settings_for(name)))
        offset += n
    buffer = bucket.buffer()
    if offset != buffer.numel():
        raise RuntimeError(f"DDP bucket holds {buffer.numel()} values but its parameters {offset}.")
    nbytes = comm.payload_nbytes(k_total, state.value_dtype)
    payload = torch.zeros(nbytes, dtype=torch.uint8, device=buffer.device)
    gathered = torch.empty(state.world_size * nbytes, dtype=torch.uint8, device=buffer.device)
    plan = _Plan(entries, k_total, dense_numel, payload, gathered, buffer.numel() * buffer.element_size())
    state._plans[key] = plan
    return plan


def dgc_hook(state: DGCState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Compress, exchange and decompress one DDP bucket (see the module docstring for the steps)."""
    plan = _plan(state, bucket)
    buffer = bucket.buffer()
    device = buffer.device
    world = state.world_size
    cfg = state.config
    grads = buffer if buffer.dtype == torch.float32 else buffer.float()

    # Step 1: prepare. A non-finite local gradient is not let into the memory: this rank sends NaN
    # instead, so that every rank sees a non-finite result and skips the step consistently.
    locally_finite = bool(torch.isfinite(grads.sum()))
    if locally_finite and state.grad_scale != 1.0:
        grads.mul_(1.0 / state.grad_scale)
    clip = cfg.local_clip_norm / math.sqrt(world) if cfg.local_clip_norm is not None else None

    dense_parts: list[Tensor] = []
    sparse_indices: list[Tensor] = []
    sparse_values: list[Tensor] = []
    selection_s = 0.0
    for e in plan.entries:
        g = grads[e.offset : e.offset + e.numel]
        if locally_finite:
            if clip is not None:
                clip_by_norm_(g, clip)
            if e.settings.weight_decay:
                g.add_(e.param.detach().reshape(-1).float(), alpha=e.settings.weight_decay)
        if e.kind == "dense":
            dense_parts.append(g)
            continue
        buf = state.memory.get(e.name, e.numel, device)
        if not locally_finite:
            if e.kind == "full":
                dense_parts.append(torch.full_like(g, float("nan")))
            continue
        # Step 2: compensate (into scratch buffers; the committed state stays untouched).
        momentum_correction(
            g, buf.momentum, buf.velocity, e.settings.momentum, e.settings.nesterov,
            buf.momentum_next, buf.velocity_next,
        )  # fmt: skip
        if e.kind == "full":
            dense_parts.append(buf.velocity_next)
            state.memory.stage(e.name, None, cfg.momentum_masking)
            continue
        # Step 3: select exactly k.
        t0 = time.perf_counter()
        if cfg.selection == "exact":
            idx = topk_indices(buf.velocity_next, e.k)
        else:
            idx = sampled_topk(buf.velocity_next, e.k, cfg.sample_ratio, state.generator)
        selection_s += time.perf_counter() - t0
        sparse_indices.append(idx + e.offset)
        sparse_values.append(buf.velocity_next.index_select(0, idx))
        state.memory.stage(e.name, idx, cfg.momentum_masking)

    if plan.k_total:
        if locally_finite:
            comm.pack_into(
                plan.payload, torch.cat(sparse_indices), torch.cat(sparse_values), state.value_dtype
            )
        else:
            plan.payload.zero_()
            comm.payload_values(plan.payload, plan.k_total, state.value_dtype).fill_(float("nan"))
    dense = torch.cat(dense_parts) if dense_parts else None
    if dense is not None and not locally_finite:
        dense = torch.full_like(dense, float("nan"))

    # Step 4: exchange (same collectives, same sizes, same order on every rank).
    futures = []
    if plan.k_total:
        futures.append(comm.all_gather_payload(plan.payload, plan.gathered, state.process_group))
    if dense is not None:
        futures.append(comm.all_reduce_sum(dense, state.process_group))

    stats = state._current
    stats.payload_bytes += plan.payload.numel()
    stats.padding_bytes += plan.payload.numel() - plan.k_total * (
        comm.INDEX_BYTES + state.value_dtype.itemsize
    )
    stats.dense_exchange_bytes += dense.numel() * dense.element_size() if dense is not None else 0
    stats.dense_bytes += plan.dense_bytes
    stats.values_sent += plan.k_total + plan.dense_numel
    stats.numel += buffer.numel()
    stats.selection_ms += selection_s * 1e3
    stats.buckets += 1
    stats.density = cfg.density

    def decompress(_: object) -> Tensor:
        # Step 5: decompress.
        result = torch.zeros(buffer.numel(), dtype=torch.float32, device=device)
        finite = torch.ones((), dtype=torch.bool, device=device)
        if plan.k_total:
            indices, values = comm.unpack(plan.gathered.view(world, -1), plan.k_total, state.value_dtype)
            values = values.float()
            finite &= torch.isfinite(values).all()
            result.index_add_(0, indices, values)
        if dense is not None:
            finite &= torch.isfinite(dense).all()
            pos = 0
            for e in plan.entries:
                if e.kind == "sparse":
                    continue
                part = dense[pos : pos + e.numel]
                pos += e.numel
                out = result[e.offset : e.offset + e.numel]
                out.copy_(part)
        result.div_(world)
        for e in plan.entries:  # dense momentum works on the average, so it runs after the division
            if e.kind == "dense" and e.settings.momentum:
                _apply_dense_momentum(state, e, result[e.offset : e.offset + e.numel])
        # Step 6: the memory update was staged above; finite decides commit or discard.
        state.note_finite(finite)
        if state.grad_scale != 1.0:
            result.mul_(state.grad_scale)
        return result if buffer.dtype == torch.float32 else result.to(buffer.dtype)

    if not futures:
        return comm.completed(decompress(None))
    if len(futures) == 1:
        return futures[0].then(lambda f: decompress(f.value()))
    return torch.futures.collect_all(futures).then(decompress)


def _apply_dense_momentum(state: DGCState, e: _Entry, avg: Tensor) -> None:
    """SGD momentum on a densely averaged tensor, in place: ``buf' = m buf + g``; ``d = buf'`` or Nesterov ``g + m buf'``.

    The inputs are identical on every rank, so the buffers stay identical too. The new buffer is
    staged like any other memory update, so a skipped step leaves it untouched.
    """
    buf = state.memory.get(e.name, e.numel, avg.device)
    m = e.settings.momentum
    torch.mul(buf.momentum, m, out=buf.momentum_next)
    buf.momentum_next.add_(avg)
    if e.settings.nesterov:
        avg.add_(buf.momentum_next, alpha=m)
    else:
        avg.copy_(buf.momentum_next)
    buf.velocity_next.zero_()
    state.memory.stage(e.name, None, False)
