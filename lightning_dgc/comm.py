"""The exchange: the only module that calls ``torch.distributed``.

Wire format of one bucket's sparse part (the *payload*, one flat uint8 tensor per rank, the same
size on every rank because every rank selects exactly ``K`` values and the code array has a fixed
length; gloo has no all-gather of uneven sizes)::

    [ K values (fp32 or fp16) | K + F uint16 delta codes | 0-2 bytes of padding (zeros) ]

    F = span // FILLER_SPAN   (FILLER_SPAN = 65535; span = the bucket's numel; F = 0 below 65535)
    nbytes = K * value_bytes + 2 * (K + F), rounded up to a multiple of 4   (0 when K = 0)

Values come first so that the fp32 view is 4-byte aligned (the codes then start at an even
offset); the padding keeps every row of the gathered ``(world, nbytes)`` tensor a multiple of 4
bytes. The ``K`` selected bucket-flat indices ``p_1 < p_2 < ... < p_K`` (in ``[0, span)``) travel as
gaps ``d_i = p_i - p_{i-1}`` with ``p_0 = -1``, so every ``d_i >= 1``:

* a code ``c`` in ``1..65535`` means "advance ``c`` positions; an entry is here" (the i-th entry
  code goes with the i-th value);
* code ``0`` is a *filler*: "advance 65535 positions, no entry";
* a gap ``d`` is written as ``f = (d - 1) // 65535`` fillers followed by the code ``d - 65535 f``;
* after the last entry the rest of the ``K + F`` codes are 0 (trailing fillers, ignored).

Decoding a row: ``advance = where(code == 0, 65535, code)``, ``position = cumsum(advance) - 1``,
and the entries are the slots with ``code != 0``, exactly ``K`` of them, in order.

Why ``K + F`` codes always suffice: the gaps sum to ``p_K + 1 <= span``, so the fillers number
``sum_i (d_i - 1) // 65535 <= sum_i (d_i - 1) / 65535 <= (span - K) / 65535``; being an integer, the
count is at most ``(span - K) // 65535 <= span // 65535 = F``. (The worst case puts ``span - K``
unselected positions in one gap; spreading them over several gaps only loses fillers to rounding.)

Compared with int32 indices a value costs ``2 + value_bytes`` bytes instead of ``4 + value_bytes``
(plus ``2 F`` bytes per bucket: 778 bytes for a bucket of 25.6 M values). One
``all_gather_into_tensor`` moves every rank's payload; tensors too small to compress travel in one
dense ``all_reduce``.
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

VALUE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16}
#: Bytes of one int32 index (DEFT still all-reduces its union indices as int32).
INDEX_BYTES = 4
#: Bytes of one delta code of DGC's payload (uint16).
CODE_BYTES = 2
#: Positions a filler code (0) advances; also the largest gap a single entry code covers.
FILLER_SPAN = 65535


def _fillers(span: int) -> int:
    """``F``: the filler slots a payload reserves for a bucket of ``span`` values."""
    return span // FILLER_SPAN


def payload_size(k_total: int, value_bytes: int, span: int) -> tuple[int, int]:
    """``(bytes, padding)`` of one rank's payload for ``k_total`` values of ``value_bytes`` bytes each,
    out of a bucket of ``span`` values (plain integers: the performance model uses it too).

    ``k_total * value_bytes + CODE_BYTES * (k_total + span // FILLER_SPAN)``, rounded up to a multiple
    of 4 bytes; the padding is that rounding (0 or 2; filler codes count as index bytes). ``(0, 0)``
    when ``k_total`` is 0 (nothing is exchanged, no codes are needed).
    """
    if k_total < 0 or k_total > span:
        raise ValueError(f"cannot select {k_total} values out of a bucket of {span} values (0 <= k <= span).")
    if k_total == 0:
        return 0, 0
    raw = k_total * value_bytes + CODE_BYTES * (k_total + _fillers(span))
    return raw + (-raw) % 4, (-raw) % 4


def payload_nbytes(k_total: int, value_dtype: torch.dtype, span: int) -> int:
    """Bytes of one rank's payload (:func:`payload_size`) with values of ``value_dtype``."""
    return payload_size(k_total, value_dtype.itemsize, span)[0]


def payload_padding(k_total: int, value_dtype: torch.dtype, span: int) -> int:
    """The alignment bytes of :func:`payload_nbytes` (0 or 2)."""
    return payload_size(k_total, value_dtype.itemsize, span)[1]


def _as_int16(codes: Tensor) -> Tensor:
    """Codes in ``0..65535`` (any int dtype) as int16 with the same 16 bits (two's complement)."""
    return (codes - ((codes >> 15) << 16)).to(torch.int16)


def pack_into(payload: Tensor, indices: Tensor, values: Tensor, value_dtype: torch.dtype, span: int) -> None:
    """Write the selected ``indices`` and their ``values`` into ``payload`` (see the module docstring).

    Args:
        payload: a uint8 tensor of exactly ``payload_nbytes(K, value_dtype, span)`` bytes.
        indices: the ``K`` selected bucket-flat offsets, any int dtype, **sorted ascending, distinct
            and in** ``[0, span)``; ``values[i]`` goes with ``indices[i]``.
        values: ``K`` values, cast to ``value_dtype``.
        value_dtype: the wire dtype of the values.
        span: the bucket's numel (the same on every rank).

    The index contract is checked (``ValueError``) only for CPU tensors, where it costs no device
    synchronisation; on CUDA an index set that breaks it gives a wrong payload (or an out-of-bounds
    device error), so the caller must sort. Vectorised: no host synchronisation, no Python loop.
    """
    k = indices.numel()
    nbytes = payload_nbytes(k, value_dtype, span)
    if payload.dtype != torch.uint8 or payload.numel() != nbytes:
        raise ValueError(
            f"the payload must be {nbytes} uint8 bytes for {k} values out of {span} ({value_dtype}),"
            f" got {payload.numel()} {payload.dtype}; allocate it with payload_nbytes(k, value_dtype, span)."
        )
    if values.numel() != k:
        raise ValueError(f"pack_into got {k} indices but {values.numel()} values.")
    if k == 0:
        return
    idx = indices.reshape(-1).to(torch.int64)
    gaps = torch.diff(idx, prepend=idx.new_full((1,), -1))  # d_i >= 1 for a valid index set
    if idx.device.type == "cpu":
        if int(gaps.min()) < 1:
            raise ValueError("pack_into needs indices sorted ascending, distinct and >= 0 (sort them first).")
        if int(idx[-1]) >= span:
            raise ValueError(f"pack_into got index {int(idx[-1])} outside the bucket of {span} values.")
    vbytes = k * value_dtype.itemsize
    payload_values(payload, k, value_dtype).copy_(values.reshape(-1))
    slots = k + _fillers(span)
    codes = payload[vbytes : vbytes + CODE_BYTES * slots].view(torch.int16)
    if slots == k:  # span < 65535: every gap fits one code, no filler
        codes.copy_(_as_int16(gaps))
    else:
        fill = torch.div(gaps - 1, FILLER_SPAN, rounding_mode="floor")  # fillers before each entry
        where = torch.cumsum(fill + 1, 0).sub_(1)  # the slot of each entry's code
        codes.zero_()
        codes.index_put_((where,), _as_int16(gaps - FILLER_SPAN * fill))
    payload[vbytes + CODE_BYTES * slots :].zero_()


def payload_values(payload: Tensor, k: int, value_dtype: torch.dtype) -> Tensor:
    """The value part of a payload (a view of its first ``k`` values), for writing values in place."""
    return payload[: k * value_dtype.itemsize].view(value_dtype)


def unpack(gathered: Tensor, k: int, value_dtype: torch.dtype, span: int) -> tuple[Tensor, Tensor]:
    """Decode a gathered ``(world, nbytes)`` uint8 tensor into flat indices (int64) and values.

    Returns ``(indices, values)`` of shape ``(world * k,)``, rank 0's ``k`` entries first, each rank's
    in the order it packed them. Vectorised over all rows (no Python loop, no host synchronisation).
    A row written by :func:`pack_into` decodes exactly. Any other row still decodes to ``k`` indices
    in ``[0, span)``, so a corrupt row can never index out of the bucket; in particular an all-zero
    code array (a rank that zeroes its payload and sends NaN values) decodes to ``k`` entries at 0.
    """
    world = gathered.shape[0]
    nbytes = payload_nbytes(k, value_dtype, span)
    if gathered.dtype != torch.uint8 or gathered.dim() != 2 or gathered.shape[1] != nbytes:
        raise ValueError(
            f"unpack expects a (world, {nbytes}) uint8 tensor for {k} values out of {span} ({value_dtype}),"
            f" got {tuple(gathered.shape)} {gathered.dtype}."
        )
    device = gathered.device
    if k == 0:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, torch.empty(0, dtype=value_dtype, device=device)
    gathered = gathered.contiguous()
    vbytes = k * value_dtype.itemsize
    slots = k + _fillers(span)
    values = gathered[:, :vbytes].view(value_dtype).reshape(-1)  # rows are 4-byte multiples: views work
    codes = gathered[:, vbytes : vbytes + CODE_BYTES * slots].view(torch.int16).to(torch.int32)
    codes.bitwise_and_(0xFFFF)  # uint16 semantics
    if slots == k:  # no filler slot: every code is an entry
        indices = codes.cumsum(1, dtype=torch.int64).sub_(1).reshape(-1)
        return indices.clamp_(0, span - 1), values
    filler = codes == 0
    positions = codes.masked_fill_(filler, FILLER_SPAN).cumsum(1, dtype=torch.int64).sub_(1)
    # Where each slot's position goes in the output: an entry to ``row * k + (its rank in the row) - 1``,
    # a filler to the discard slot ``world * k``. (A row with more than k entries, which pack_into
    # never writes, piles the extra ones onto its own last slot.)
    target = (~filler).cumsum(1).clamp_(max=k)
    target.add_(torch.arange(-1, world * k - 1, k, device=device).unsqueeze(1))
    target.masked_fill_(filler, world * k)
    out = torch.zeros(world * k + 1, dtype=torch.int64, device=device)  # missing entries stay at 0
    out.scatter_(0, target.reshape(-1), positions.reshape(-1))
    return out[: world * k].clamp_(0, span - 1), values


class CollectiveError(RuntimeError):
    """A collective of the exchange failed or timed out: a peer died or hung, or the network broke.

    Raised on every surviving rank (from DDP's ``backward``), never swallowed: a rank must not train
    on alone with a stale or partial exchange.
    """


def _failed(what: str, error: BaseException) -> CollectiveError:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return CollectiveError(
        f"lightning_dgc: the {what} failed on rank {rank}: {error}. A peer process died or stopped"
        " answering (or the network broke) within the process group's timeout, and training cannot go on"
        " with a partial exchange. Resume from the last checkpoint once every rank is back."
    )


@dataclass(frozen=True)
class Pending:
    """A launched collective: what it is (named in errors), its future, and the tensor it fills."""

    what: str
    future: torch.futures.Future
    output: Tensor

    def wait(self) -> Tensor:
        """``output`` once the collective is done (on CUDA: the current stream waits for it, no host
        sync); a failure raises :class:`CollectiveError` naming the collective."""
        try:
            self.future.wait()
        except Exception as error:
            raise _failed(self.what, error) from error
        return self.output


def all_gather_payload(
    payload: Tensor,
    out: Tensor,
    group: dist.ProcessGroup | None,
    what: str = "all-gather of the sparse payload",
) -> Pending:
    """Start gathering every rank's ``payload`` into the rows of ``out``."""
    work = dist.all_gather_into_tensor(out, payload, group=group, async_op=True)
    return Pending(what, work.get_future(), out)


def all_reduce_sum(
    tensor: Tensor, group: dist.ProcessGroup | None, what: str = "all-reduce of the dense tensors"
) -> Pending:
    """Start summing ``tensor`` over ranks in place."""
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return Pending(what, work.get_future(), tensor)


def all_reduce_sum_now(tensor: Tensor, group: dist.ProcessGroup | None, what: str) -> Tensor:
    """Sum ``tensor`` over ranks in place and wait; a failure raises :class:`CollectiveError` naming ``what``."""
    try:
        dist.all_reduce(tensor, group=group)
    except Exception as error:
        raise _failed(what, error) from error
    return tensor


def _devices(device: torch.device) -> list[torch.device]:
    return [device] if device.type == "cuda" else []


def when_all(
    pending: Sequence[Pending],
    fn: Callable[[], Tensor],
    device: torch.device,
    keep: Sequence[Tensor] = (),
) -> torch.futures.Future:
    """A future of ``fn()``, run once every collective in ``pending`` is done; safe on CUDA streams.

    Call it after the last collective of the bucket was launched; ``fn`` reads their outputs. It runs
    in whatever thread completes the last collective (gloo's worker; inline for NCCL, whose futures
    complete at launch with CUDA events).

    Why not ``torch.futures.collect_all(...).then(fn)``: the combined future is created without
    devices, so on CUDA its ``then`` callback runs on whichever stream the completing thread left
    current, and completing the child future records no event for its result. DDP's ``wait()`` on it
    is then a no-op for streams, and the reducer reads the result (and the strategy the finiteness
    flag and the memory) while the callback's kernels may still run: ranks decode different updates.
    Here instead the callback is the ``then`` of a *gate* future created with the device. Per torch's
    documented semantics, the callback runs with a stream from torch's pool current and must not
    switch streams; its result is then ordered for every ``wait()`` by an event recorded on that
    stream once all its work is queued. On that stream the callback first waits for
    everything the hook queued on its own stream (an event recorded now) and for each collective
    (``Pending.wait``), and records every tensor of ``keep`` (made on the hook's stream, read by
    ``fn``, freed after it) on it, so that the caching allocator does not hand that memory back to the
    hook's stream while the callback still reads it. No host synchronisation is added.

    A failed collective completes the returned future with a :class:`CollectiveError` naming it,
    which DDP raises from ``backward()`` on every surviving rank.
    """
    gate: torch.futures.Future = torch.futures.Future(devices=_devices(device))
    cuda = device.type == "cuda"
    if cuda:
        queued = torch.cuda.Event()
        queued.record(torch.cuda.current_stream(device))

    def run(_: torch.futures.Future) -> Tensor:
        if cuda:
            stream = torch.cuda.current_stream(device)  # a pool stream, set by then(): never switched
            stream.wait_event(queued)
        for collective in sorted(pending, key=lambda p: not p.future.done()):  # a failed one first
            collective.wait()
        if cuda:
            for tensor in keep:
                tensor.record_stream(stream)
        return fn()

    result = gate.then(run)
    if pending:
        torch.futures.collect_all([p.future for p in pending]).add_done_callback(
            lambda _: gate.set_result(None)
        )
    else:
        gate.set_result(None)
    return result


def all_gather_object(obj: object, group: dist.ProcessGroup | None = None) -> list[object]:
    """Every rank's ``obj`` (blocking; for setup-time consistency checks, never per step)."""
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_object(obj: object, dst: int = 0, group: dist.ProcessGroup | None = None) -> list[object] | None:
    """Every rank's ``obj`` on rank ``dst`` (``None`` elsewhere); blocking, for checkpoints only."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[object] | None = [None] * dist.get_world_size(group) if dist.get_rank(group) == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def gather_tensors(
    tensors: Sequence[Tensor], dst: int = 0, group: dist.ProcessGroup | None = None
) -> list[list[Tensor]] | None:
    """Every rank's copy of each tensor, as CPU tensors on rank ``dst`` (``None`` elsewhere); blocking.

    For checkpoints: one gather per tensor, so that a rank other than ``dst`` sends its (contiguous CPU)
    tensors as they are, without a copy, and ``dst`` holds only the result. Every rank must pass tensors
    of the same shapes and dtypes in the same order. Gloo gathers CPU tensors only: device tensors are
    brought to the CPU one at a time there.
    """
    world, rank = world_size_and_rank(group)
    if world == 1:
        return [[t.detach().cpu().clone()] for t in tensors]
    on_cpu = dist.get_backend(group) == dist.Backend.GLOO
    out: list[list[Tensor]] = []
    for tensor in tensors:
        source = tensor.detach()
        source = (source.cpu() if on_cpu else source).contiguous()
        if rank != dst:
            dist.gather(source, None, dst=dst, group=group)
            continue
        received = [torch.empty_like(source) for _ in range(world)]
        dist.gather(source, received, dst=dst, group=group)
        out.append([t.cpu() for t in received])
    return out if rank == dst else None


def average(tensor: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """``tensor`` replaced, in place, by its mean over ranks (blocking; not for the hot path)."""
    world, _ = world_size_and_rank(group)
    if world > 1:
        dist.all_reduce(tensor, group=group)
        tensor.div_(world)
    return tensor


def destroy_process_group() -> None:
    """End the default process group cleanly (a no-op when none is initialised).

    A process that exits with a gloo process group still alive can abort at interpreter exit
    (``terminate called without an active exception``): gloo's worker threads still hold finished
    work, and its tensors, while the interpreter is torn down. Ending the group first avoids that.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _destroy_at_exit() -> None:
    # After an uncaught exception (a peer died, say) collectives may still be pending on a dead peer,
    # and ending the group would wait for them: exit at once instead, as the exception demands.
    if getattr(sys, "last_value", None) is None:
        destroy_process_group()


_destroy_registered = False


def destroy_process_group_at_exit() -> None:
    """Register, once per process, :func:`destroy_process_group` to run at interpreter exit.

    At exit rather than in the strategy's teardown: a Trainer keeps its process group between
    ``fit`` and a later ``validate`` or ``test`` (Lightning initialises it only once).
    """
    global _destroy_registered
    if not _destroy_registered:
        atexit.register(_destroy_at_exit)
        _destroy_registered = True


def world_size_and_rank(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(world_size, rank)`` of ``group``, or ``(1, 0)`` when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)
