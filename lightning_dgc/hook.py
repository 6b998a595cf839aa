"""The DDP communication hooks of DGC and DEFT.

``dgc_hook(state, bucket)`` replaces DDP's dense all-reduce of one gradient bucket. Steps:

1. **prepare**: view the bucket per parameter; divide out the loss scale; local clipping; weight decay.
2. **compensate**: momentum correction into scratch buffers (``u' = m u + g``, ``v' = v + u'``).
3. **select**: exactly k indices per compressed tensor from ``v'`` (sampled threshold or exact top-k),
   written with their values straight into the bucket's preallocated payload.
4. **exchange**: one all-gather of the payloads; one all-reduce of the tensors averaged dense.
5. **decompress**: scatter-add every rank's values, divide by the world size; dense momentum. This
   runs once every collective is done, ordered on CUDA with events (:func:`lightning_dgc.comm.when_all`).
6. **update memory**: stage the scratch buffers and the sent indices; the strategy commits them
   (or discards them if any rank saw inf/NaN) once the whole backward pass is done.

``deft_hook(state, bucket)`` shares steps 1, 2, 5 and 6 and replaces 3-4 with DEFT's partitioned
selection (see its docstring).

A tensor is handled in one of three ways, decided once per bucket layout and density (the *plan*):
``sparse`` (compressed), ``full`` (density so high that sending everything dense is cheaper: the
velocity is all-reduced and cleared, which is what selecting every index means; the momentum is
not masked, so this is DDP + SGD momentum) and ``dense``
(too small to compress: plain averaging, then the optimizer's momentum in the hook).

DDP checks the hooks' annotations literally, so this module does not use postponed annotations.
"""

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dgc import comm
from lightning_dgc.compression import sampled_topk, topk_indices
from lightning_dgc.compression.deft import deft_select, fragment_norms
from lightning_dgc.memory import _Buffers, bucket_order_flat, clip_each_by_norm_, momentum_correction_each
from lightning_dgc.partition import Fragment, allocate_k, fragment_layers, lpt_assign, selection_cost
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
    dense_bytes: int  # what DDP would send for this bucket
    payload: Tensor  # DGC: this rank's payload (uint8), reused every step
    gathered: Tensor  # DGC: every rank's payload, concatenated (gloo wants a flat output), reused
    # Bucket positions of the tensors exchanged dense, in entry order (None: every tensor is, in
    # bucket order), so that decompression places them with one index_copy_.
    dense_index: Tensor | None = None
    # Entries (positions in ``entries``) grouped by the setting that decides their update, so that
    # each group runs as a few ``torch._foreach_*`` calls instead of a Python loop per tensor.
    decay_groups: list[tuple[float, list[int]]] = field(default_factory=list)  # weight decay
    memory_groups: list[tuple[tuple[float, bool], list[int]]] = field(default_factory=list)  # full/sparse
    dense_momentum_groups: list[tuple[tuple[float, bool], list[int]]] = field(default_factory=list)
    # DEFT only, computed once per layout: the fragments of the sparse tensors (offsets into their
    # concatenation) and, grouped by layer, each layer's entry with its fragments rebased to the layer.
    fragments: list[Fragment] = field(default_factory=list)
    layers: list[tuple[_Entry, list[tuple[int, Fragment]]]] = field(
        default_factory=list
    )  # fragments by layer


def tensor_kind(numel: int, ndim: int, k: int, state: DGCState) -> Kind:
    """How one tensor is exchanged (see the module docstring)."""
    if state.config.averaged_dense(numel, ndim):
        return "dense"
    value_bytes = state.value_dtype.itemsize
    if k * (comm.INDEX_BYTES + value_bytes) >= numel * 4:
        return "full"
    return "sparse"


def sparse_gradient_message(names: list[str]) -> str:
    """The error for parameters whose gradients are sparse tensors (``nn.Embedding(sparse=True)``)."""
    return (
        f"Parameter(s) {names} get sparse gradients (e.g. nn.Embedding(sparse=True) or nn.EmbeddingBag(sparse=True)),"
        " which the compressed exchange cannot take: it selects from dense gradient buckets. Create the module"
        " with sparse=False (the exchange already sends only the largest values), or train with"
        " strategy='ddp'."
    )


def values_per_step(numel: int, density: float) -> int:
    """k for a tensor of ``numel`` values: ``ceil(density * numel)``, at least 1."""
    return min(numel, max(1, math.ceil(density * numel)))


def _plan(state: DGCState, bucket: dist.GradBucket, partitioned: bool) -> _Plan:
    params = bucket.parameters()
    key = (partitioned, tuple(id(p) for p in params), state.config.density, state.config.value_dtype)
    plan = state._plans.get(key)
    if plan is not None:
        return plan
    buffer = bucket.buffer()
    if buffer.is_sparse:
        raise ValueError(sparse_gradient_message([state.name_of(p) for p in params]))
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
    if offset != buffer.numel():
        raise RuntimeError(f"DDP bucket holds {buffer.numel()} values but its parameters {offset}.")
    nbytes = 0 if partitioned else comm.payload_nbytes(k_total, state.value_dtype, offset)
    plan = _Plan(
        entries,
        k_total,
        dense_numel,
        buffer.numel() * buffer.element_size(),
        payload=torch.zeros(nbytes, dtype=torch.uint8, device=buffer.device),
        gathered=torch.empty(state.world_size * nbytes, dtype=torch.uint8, device=buffer.device),
    )
    if partitioned:
        sparse = [e for e in entries if e.kind == "sparse"]
        plan.fragments = fragment_layers(
            [e.name for e in sparse], [e.numel for e in sparse], state.world_size
        )
        by_name = {e.name: e for e in sparse}
        for i, f in enumerate(plan.fragments):
            if not plan.layers or plan.layers[-1][0].name != f.name:
                plan.layers.append((by_name[f.name], []))
            plan.layers[-1][1].append((i, _rebased(f)))
    if plan.dense_numel and plan.dense_numel != buffer.numel():
        plan.dense_index = torch.cat(
            [
                torch.arange(e.offset, e.offset + e.numel, device=buffer.device)
                for e in entries
                if e.kind != "sparse"
            ]
        )
    plan.decay_groups = _grouped(entries, lambda e: e.settings.weight_decay or None)
    plan.memory_groups = _grouped(entries, lambda e: _momentum_key(e) if e.kind != "dense" else None)
    plan.dense_momentum_groups = _grouped(
        entries, lambda e: _momentum_key(e) if e.kind == "dense" and e.settings.momentum else None
    )
    state._plans[key] = plan
    return plan


def _momentum_key(e: _Entry) -> tuple[float, bool]:
    return (e.settings.momentum, e.settings.nesterov)


def _grouped(entries: list[_Entry], key: Callable[[_Entry], object]) -> list[tuple[object, list[int]]]:
    """Positions of ``entries`` grouped by ``key`` (``None``: left out), groups in first-seen order."""
    groups: dict[object, list[int]] = {}
    for i, e in enumerate(entries):
        k = key(e)
        if k is not None:
            groups.setdefault(k, []).append(i)
    return list(groups.items())


@dataclass
class _Prepared:
    """Result of steps 1-2 for one bucket."""

    locally_finite: bool
    dense_parts: list[Tensor]  # in entry order: gradients of dense tensors, velocities of full ones
    sparse: list[tuple[_Entry, _Buffers]]  # compressed tensors with their compensated scratch buffers


def _prepare(state: DGCState, plan: _Plan, buffer: Tensor) -> _Prepared:
    """Steps 1-2: unscale, clip, weight decay, momentum correction into scratch buffers."""
    cfg = state.config
    grads = buffer if buffer.dtype == torch.float32 else buffer.float()
    # A non-finite local gradient is not let into the memory: this rank sends NaN instead, so that
    # every rank sees a non-finite result and skips the step consistently.
    if not bool(torch.isfinite(grads.sum())):
        nan = torch.full((plan.dense_numel,), math.nan, device=buffer.device)
        return _Prepared(False, [nan] if plan.dense_numel else [], [])
    if state.grad_scale != 1.0:
        grads.mul_(1.0 / state.grad_scale)
    g = grads.split([e.numel for e in plan.entries])
    if cfg.local_clip_norm is not None:
        clip_each_by_norm_(g, cfg.local_clip_norm / math.sqrt(state.world_size))
    for decay, members in plan.decay_groups:
        params = [bucket_order_flat(plan.entries[i].param.detach()) for i in members]
        if params[0].dtype != torch.float32:
            params = [p.float() for p in params]
        torch._foreach_add_([g[i] for i in members], params, alpha=decay)
    buffers: dict[int, _Buffers] = {}
    for (momentum, nesterov), members in plan.memory_groups:
        bufs = [state.memory.get(plan.entries[i].name, plan.entries[i].numel, buffer.device) for i in members]
        momentum_correction_each([g[i] for i in members], bufs, momentum, nesterov)
        buffers.update(zip(members, bufs, strict=True))
    for _, members in plan.dense_momentum_groups:  # made here, on the hook's stream, not in the callback
        for i in members:
            state.memory.get(plan.entries[i].name, plan.entries[i].numel, buffer.device)
    prepared = _Prepared(True, [], [])
    for i, e in enumerate(plan.entries):
        if e.kind == "dense":
            prepared.dense_parts.append(g[i])
        elif e.kind == "full":
            # Everything is sent: momentum factor masking would clear the whole momentum every step and
            # train without momentum; the paper masks what a *sparse* update applied. Unmasked, this is
            # DDP + SGD momentum exactly (the DGC authors' code treats density 1 the same way).
            prepared.dense_parts.append(buffers[i].velocity_next)
            state.memory.stage(e.name, None, False)
        else:
            prepared.sparse.append((e, buffers[i]))
    return prepared


def _select(state: DGCState, values: Tensor, k: int) -> Tensor:
    if state.config.selection == "exact":
        return topk_indices(values, k)
    return sampled_topk(values, k, state.config.sample_ratio, state.generator)


def _decompress(
    state: DGCState,
    plan: _Plan,
    buffer: Tensor,
    dense: Tensor | None,
    sparse_indices: Tensor | None,
    sparse_values: Tensor | None,
) -> Tensor:
    """Step 5: the averaged update of the bucket, in the bucket's dtype; records finiteness."""
    world = state.world_size
    if sparse_indices is None and dense is not None and plan.dense_index is None:
        result = dense  # every tensor went dense, in bucket order: the all-reduced buffer is the result
    else:
        # The bucket's gradients are no longer needed (the dense ones were copied for the exchange,
        # the compressed ones live on in the velocity): an fp32 bucket is reused as the result.
        if buffer.dtype == torch.float32:
            result = buffer.zero_()
        else:
            result = torch.zeros(buffer.numel(), dtype=torch.float32, device=buffer.device)
        if sparse_indices is not None and sparse_values is not None:
            result.index_add_(0, sparse_indices, sparse_values.float())
        if dense is not None:
            result.index_copy_(0, plan.dense_index, dense)
    # One read-only pass: inf or NaN anywhere makes the sum non-finite (finite gradients summing past
    # 3e38 would too, which no trainable model produces), at a fraction of isfinite(...).all()'s cost.
    finite = torch.isfinite(result.sum())
    result.div_(world)
    if plan.dense_momentum_groups:  # momentum of dense tensors works on the average
        avg = result.split([e.numel for e in plan.entries])
        for (momentum, nesterov), members in plan.dense_momentum_groups:
            _apply_dense_momentum(state, [plan.entries[i] for i in members], [avg[i] for i in members],
                                  momentum, nesterov)  # fmt: skip
    state.note_finite(finite)  # Step 6: finiteness decides commit or discard of the staged memory
    if state.grad_scale != 1.0:
        result.mul_(state.grad_scale)
    return result if buffer.dtype == torch.float32 else result.to(buffer.dtype)


def _apply_dense_momentum(state: DGCState, entries: list[_Entry], avg: list[Tensor], momentum: float,
                          nesterov: bool) -> None:  # fmt: skip
    """SGD momentum on densely averaged tensors, in place: ``buf' = m buf + g``; ``d = buf'`` (Nesterov ``g + m buf'``).

    The inputs are identical on every rank, so the buffers stay identical too. The new buffers are
    staged like any other memory update, so a skipped step leaves them untouched.
    """
    bufs = [state.memory.get(e.name, e.numel, avg[0].device) for e in entries]
    nxt = [b.momentum_next for b in bufs]
    torch._foreach_copy_(nxt, avg)
    torch._foreach_add_(nxt, [b.momentum for b in bufs], alpha=momentum)
    if nesterov:
        torch._foreach_add_(avg, nxt, alpha=momentum)
    else:
        torch._foreach_copy_(avg, nxt)
    torch._foreach_zero_([b.velocity_next for b in bufs])
    for e in entries:
        state.memory.stage(e.name, None, False)


def _exchange_dense(state: DGCState, prepared: _Prepared) -> comm.Pending | None:
    """Start the all-reduce of the tensors exchanged dense (see :func:`_dense_sum` for its result).

    With fp16 values they travel in fp16 too, pre-divided by the world size like torch's
    ``fp16_compress_hook`` (so the sum cannot overflow where the average would not); a value that
    still overflows makes the step non-finite, and it is skipped on every rank.
    """
    if not prepared.dense_parts:
        return None
    dense = torch.cat(prepared.dense_parts)
    if state.value_dtype != torch.float32:
        dense = dense.div_(state.world_size).to(state.value_dtype)
    return comm.all_reduce_sum(dense, state.process_group)


def _dense_sum(state: DGCState, pending: comm.Pending | None) -> Tensor | None:
    """The fp32 sum over ranks of the tensors exchanged dense (in a decode callback, once done)."""
    if pending is None:
        return None
    if pending.output.dtype == torch.float32:
        return pending.output
    return pending.output.float().mul_(state.world_size)


def _record(state: DGCState, plan: _Plan, buffer: Tensor, payload_bytes: int, padding: int,
            dense: comm.Pending | None, selection_s: float, control_bytes: int = 0) -> None:  # fmt: skip
    stats = state._current
    stats.payload_bytes += payload_bytes + control_bytes
    stats.control_bytes += control_bytes
    stats.padding_bytes += padding
    stats.dense_exchange_bytes += (
        dense.output.numel() * dense.output.element_size() if dense is not None else 0
    )
    stats.dense_bytes += plan.dense_bytes
    stats.values_sent += plan.k_total + plan.dense_numel
    stats.k_target += plan.k_total
    stats.numel += buffer.numel()
    stats.selection_ms += selection_s * 1e3
    stats.buckets += 1
    stats.density = state.config.density


def dgc_hook(state: DGCState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Compress, exchange and decompress one DDP bucket with DGC (see the module docstring)."""
    plan = _plan(state, bucket, partitioned=False)
    buffer = bucket.buffer()
    prepared = _prepare(state, plan, buffer)  # Steps 1-2

    # Step 3: select exactly k per compressed tensor; what is sent is staged for clearing.
    selection_s = 0.0
    indices: list[Tensor] = []
    values: list[Tensor] = []
    for e, buf in prepared.sparse:
        t0 = time.perf_counter()
        idx = _select(state, buf.velocity_next, e.k)
        selection_s += time.perf_counter() - t0
        indices.append(idx + e.offset)
        values.append(buf.velocity_next.index_select(0, idx))
        state.memory.stage(e.name, idx, state.config.momentum_masking)
    if plan.k_total:
        if prepared.locally_finite:
            flat, order = torch.cat(indices).sort()  # the wire format wants ascending indices
            comm.pack_into(plan.payload, flat, torch.cat(values)[order], state.value_dtype, buffer.numel())
        else:
            plan.payload.zero_()
            comm.payload_values(plan.payload, plan.k_total, state.value_dtype).fill_(math.nan)

    # Step 4: exchange (same collectives, same sizes, same order on every rank).
    gathered = (
        comm.all_gather_payload(plan.payload, plan.gathered, state.process_group) if plan.k_total else None
    )
    dense = _exchange_dense(state, prepared)
    state._current.rank_selected += plan.k_total if prepared.locally_finite else 0
    padding = comm.payload_padding(plan.k_total, state.value_dtype, buffer.numel())
    _record(state, plan, buffer, plan.payload.numel(), padding, dense, selection_s)

    def decompress() -> Tensor:  # Steps 5-6
        if gathered is None:
            return _decompress(state, plan, buffer, _dense_sum(state, dense), None, None)
        idx, vals = comm.unpack(
            gathered.output.view(state.world_size, -1), plan.k_total, state.value_dtype, buffer.numel()
        )
        state.add_union_values(int(torch.unique(idx).numel()))  # gradient build-up
        return _decompress(state, plan, buffer, _dense_sum(state, dense), idx, vals)

    pending = [p for p in (gathered, dense) if p is not None]
    return state.note_bucket(comm.when_all(pending, decompress, buffer.device))


def deft_hook(state: DGCState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DEFT (Yoon and Oh, ICPP 2023): partitioned selection with no gradient build-up.

    Steps 1-2 as DGC (error feedback, or DGC's momentum correction when enabled). Then:

    3a. **norms**: L2 norm of every fragment of the compensated gradient; their squares are
        all-reduced (with every rank's previous selection time in the same small vector), so every
        rank holds identical norms: ranks derive the same plan without a leader or a broadcast.
    3b. **plan**: k shared among fragments in proportion to their norms (total = what DGC sends),
        fragments packed onto ranks by LPT on their selection cost (``partition.selection_cost``: the
        values, a fixed cost per fragment, a little per selected value), rotated by the step counter.
    3c. **select**: each rank selects top-k only inside its own fragments.
    4.  **exchange**: each fragment owns a fixed slot range of the union (known to all ranks from the
        plan); ranks write their indices into their slots and one int32 all-reduce (sum) gives the
        union, with no duplicates. Every rank then all-reduces its own velocity at the union. The
        volume is about k whatever the number of ranks.
    5-6. decompress as DGC; every rank clears the union from its memory (its values there were sent).
    """
    plan = _plan(state, bucket, partitioned=True)
    buffer = bucket.buffer()
    device = buffer.device
    prepared = _prepare(state, plan, buffer)  # Steps 1-2
    world, rank = state.world_size, state.rank
    k_total, frags = plan.k_total, plan.fragments

    # Step 3a: norms of the fragments (+ selection times), summed over ranks.
    exchange = torch.zeros(len(frags) + world, dtype=torch.float64, device=device)
    velocity = {e.name: buf.velocity_next for e, buf in prepared.sparse}
    if prepared.locally_finite and frags:
        norms = torch.cat([fragment_norms(velocity[e.name], [f for _, f in fs]) for e, fs in plan.layers])
        exchange[: len(frags)] = norms.double().square()
    elif frags:
        exchange[: len(frags)] = math.nan
    exchange[len(frags) + rank] = state.last_selection_ms
    if world > 1:
        comm.all_reduce_sum_now(exchange, state.process_group, "all-reduce of DEFT's fragment norms")
    state._current.rank_selection_ms = exchange[len(frags) :].tolist()

    # Step 3b: the identical plan on every rank.
    selection_s = 0.0
    union = torch.zeros(k_total, dtype=torch.int32, device=device)
    values = torch.zeros(k_total, dtype=state.value_dtype, device=device)
    if k_total:
        norms = exchange[: len(frags)].sqrt().cpu()
        sizes = [f.numel for f in frags]
        ks = allocate_k(norms, sizes, k_total).tolist()
        owners = lpt_assign(selection_cost(sizes, ks), world, rotation=state.step)
        state._current.plans.append((ks, owners))
        slot_starts = [0]
        for k in ks:
            slot_starts.append(slot_starts[-1] + k)

        # Step 3c: select only in this rank's fragments; write bucket offsets into their slots. A rank
        # with a non-finite gradient still fills its slots with valid (arbitrary) indices.
        t0 = time.perf_counter()
        selected = 0
        for entry, fs in plan.layers:
            mine = [(i, f) for i, f in fs if owners[i] == rank]
            if not mine:
                continue
            if prepared.locally_finite:
                idx, _ = deft_select(
                    velocity[entry.name], [f for _, f in mine], [rank] * len(mine), [ks[i] for i, _ in mine], rank,
                    selector=lambda v, k: _select(state, v, k),
                )  # fmt: skip
            else:
                idx = torch.cat([torch.arange(ks[i], device=device) + f.offset for i, f in mine])
            pos = 0
            for i, _ in mine:
                union[slot_starts[i] : slot_starts[i + 1]] = idx[pos : pos + ks[i]] + entry.offset
                pos += ks[i]
            selected += pos
        selection_s = time.perf_counter() - t0
        state._current.rank_selected += selected

        # Step 4: the union of indices (disjoint slots: the sum is a merge), then values at the union.
        if world > 1:
            comm.all_reduce_sum_now(union, state.process_group, "all-reduce of DEFT's selected indices")
        for entry, fs in plan.layers:
            lo, hi = slot_starts[fs[0][0]], slot_starts[fs[-1][0] + 1]
            local_idx = union[lo:hi].long() - entry.offset
            if prepared.locally_finite:
                buf = state.memory.get(entry.name, entry.numel, device)
                values[lo:hi] = buf.velocity_next.index_select(0, local_idx)
                state.memory.stage(entry.name, local_idx, state.config.momentum_masking)
            else:
                values[lo:hi] = math.nan

    summed = (
        comm.all_reduce_sum(values, state.process_group, "all-reduce of DEFT's values") if k_total else None
    )
    dense = _exchange_dense(state, prepared)
    state._current.union_values += int(torch.unique(union).numel()) if k_total else 0  # k: no build-up
    _record(state, plan, buffer, k_total * (comm.INDEX_BYTES + state.value_dtype.itemsize), 0, dense,
            selection_s, control_bytes=exchange.numel() * exchange.element_size())  # fmt: skip

    def decompress() -> Tensor:  # Steps 5-6
        if summed is None:
            return _decompress(state, plan, buffer, _dense_sum(state, dense), None, None)
        return _decompress(state, plan, buffer, _dense_sum(state, dense), union, summed.output)

    pending = [p for p in (summed, dense) if p is not None]
    return state.note_bucket(comm.when_all(pending, decompress, device, keep=[union]))


def _rebased(f: Fragment) -> Fragment:
    """The fragment with its offset inside its own layer (selection runs on the layer's buffer)."""
    return Fragment(f.name, f.layer_offset, f.numel, f.layer_offset)
