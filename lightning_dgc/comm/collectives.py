"""The step's collectives: :class:`Collectives`, run on a process group (:class:`TorchCollectives`), and
:func:`when_all`, the decode once they are done.

Every collective is started from the hook's thread, in bucket order, so that every rank issues the
same collectives in the same order (gloo matches collectives by the order in which a process starts
them; a collective started from a future's callback, which runs in a backend thread, could be
interleaved differently on different ranks). :meth:`Pending.wait` lets an exchange wait for one
step's result before it starts the next (with NCCL that orders the stream without a host
synchronisation; with gloo, and on the CPU, the host waits); :func:`when_all` runs the decode once
the last ones are done.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

#: What DDP hands a communication hook (re-exported: DDP checks the hook's annotations literally).
GradBucket = dist.GradBucket


class CollectiveError(RuntimeError):
    """A collective of the exchange failed or timed out: a peer died or hung, or the network broke.

    Raised on every surviving rank (from DDP's ``backward``), never swallowed: a rank must not train
    on alone with a stale or partial exchange.
    """


def world_size_and_rank(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(world_size, rank)`` of ``group``, or ``(1, 0)`` when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _failed(what: str, rank: int, error: BaseException) -> CollectiveError:
    """The error of a failed collective; ``rank``: this process's rank in the whole job (global rank)."""
    return CollectiveError(
        f"lightning_dgc: the {what} failed on rank {rank}: {error}. A peer process died or stopped"
        " answering (or the network broke) within the process group's timeout, and training cannot go on"
        " with a partial exchange. Resume from the last checkpoint once every rank is back."
    )


@dataclass(frozen=True)
class Pending:
    """A started collective: what it is (named in errors), its future, the tensor it fills, and the global rank
    of the process that started it (named in errors: a sub-group's rank would name another process)."""

    what: str
    future: torch.futures.Future
    output: Tensor
    rank: int = 0

    def wait(self) -> Tensor:
        """``output`` once the collective is done; a failure raises :class:`CollectiveError` naming it.

        With NCCL the current stream waits for the collective (no host synchronisation); with gloo
        (CUDA tensors too) and on the CPU the call blocks the host until it is done.
        """
        try:
            self.future.wait()
        except Exception as error:
            raise _failed(self.what, self.rank, error) from error
        return self.output


def _collective(name: str, before: str) -> Callable[..., Any]:
    """``torch.distributed``'s collective ``name``, or ``before`` on a torch that does not have it yet.

    torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single`` and ``reduce_scatter_tensor`` to
    ``reduce_scatter_single`` (same arguments); 2.13 and 2.14 warn on the old names, 2.11 and 2.12 have only
    those. Taking the new name where it exists keeps every supported torch free of the warning.
    """
    return getattr(dist, name, None) or getattr(dist, before)


#: Every rank's tensor into one output tensor (``dist.all_gather_single``, ``all_gather_into_tensor`` before 2.13).
_all_gather_single = _collective("all_gather_single", "all_gather_into_tensor")
#: A sum over the ranks, scattered in blocks (``dist.reduce_scatter_single``, ``reduce_scatter_tensor`` before 2.13).
_reduce_scatter_single = _collective("reduce_scatter_single", "reduce_scatter_tensor")


def _devices(device: torch.device) -> list[torch.device]:
    return [device] if device.type == "cuda" else []


class Collectives(ABC):
    """The collectives an exchange may use; every rank must call them in the same order with the
    same sizes. ``all_reduce`` sums in place; ``all_gather`` writes every rank's ``tensor`` into the
    rows of ``out`` (``world_size * tensor.numel()`` values, rank 0's first)."""

    world_size: int
    rank: int

    @property
    def global_rank(self) -> int:
        """This process's rank in the whole job, which errors name; ``rank`` is its rank among these
        collectives' ranks (a sub-group's, e.g. one level of a two-level exchange). The same by default."""
        return self.rank

    @property
    def unwrapped(self) -> Collectives:
        """The collectives that do the work: these, or what a wrapper that only observes them wraps (the
        timing of ``density="auto"``), for a collective that must not be counted."""
        return self

    @abstractmethod
    def all_reduce(self, tensor: Tensor, what: str) -> Pending: ...

    @abstractmethod
    def all_gather(self, tensor: Tensor, out: Tensor, what: str) -> Pending: ...

    def reduce_scatter(self, tensor: Tensor, what: str) -> Pending:
        """Sum ``tensor`` (``world_size`` equal blocks) over the ranks; the output is this rank's block.

        This default is an all-reduce of the whole tensor, in place (``world_size`` times the bytes of a
        real reduce-scatter): what a simulation needs. ``tensor`` may be overwritten.
        """
        pending = self.all_reduce(tensor, what)
        block = tensor.numel() // self.world_size
        output = tensor[self.rank * block : (self.rank + 1) * block]
        return Pending(what, pending.future, output, self.global_rank)


class TorchCollectives(Collectives):
    """Collectives on a ``torch.distributed`` process group (``None``: the default group)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world_size, self.rank = world_size_and_rank(group)
        self._global_rank = world_size_and_rank()[1] if group is not None else self.rank

    @property
    def global_rank(self) -> int:
        return self._global_rank

    def all_reduce(self, tensor: Tensor, what: str) -> Pending:
        if self.world_size == 1:
            return _done(what, tensor, self.global_rank)
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        return Pending(what, work.get_future(), tensor, self.global_rank)

    def all_gather(self, tensor: Tensor, out: Tensor, what: str) -> Pending:
        if self.world_size == 1:
            out.copy_(tensor.reshape(-1))
            return _done(what, out, self.global_rank)
        work = _all_gather_single(out, tensor, group=self.group, async_op=True)
        return Pending(what, work.get_future(), out, self.global_rank)

    def reduce_scatter(self, tensor: Tensor, what: str) -> Pending:
        block = tensor.numel() // self.world_size
        if self.world_size == 1:
            return _done(what, tensor[:block], self.global_rank)
        out = torch.empty(block, dtype=tensor.dtype, device=tensor.device)
        work = _reduce_scatter_single(out, tensor, group=self.group, async_op=True)
        try:
            return Pending(what, work.get_future(), out, self.global_rank)
        except RuntimeError:  # gloo's reduce-scatter has no future: wait here (the hook waits for it next)
            try:
                work.wait()
            except Exception as error:
                raise _failed(what, self.global_rank, error) from error
            return _done(what, out, self.global_rank)


def _done(what: str, output: Tensor, rank: int) -> Pending:
    future: torch.futures.Future = torch.futures.Future(devices=_devices(output.device))
    future.set_result(output)
    return Pending(what, future, output, rank)


#: The first torch whose gloo futures carry their CUDA device (see :func:`when_all`).
DEVICE_FUTURES_TORCH = (2, 11)
#: The torch releases lightning-dgc supports, as ``pyproject.toml`` requires them (named in the error below).
SUPPORTED_TORCH = "torch>=2.11,<2.16"
_DEVICE_FUTURES_CHECKED = False  # this process's torch passed the check


def _check_device_futures(version: str | None = None) -> None:
    """Raise a clear error on a torch whose collective futures may not order CUDA streams."""
    global _DEVICE_FUTURES_CHECKED
    release = (version or torch.__version__).split("+")[0].split(".")
    if tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in release[:2]) < DEVICE_FUTURES_TORCH:
        raise RuntimeError(
            f"lightning_dgc needs torch >= {'.'.join(map(str, DEVICE_FUTURES_TORCH))} for compressed exchanges of"
            f" CUDA gradients (this is torch {version or torch.__version__}): on older releases a collective's"
            " future does not order the CUDA stream that decodes it, and ranks could decode different updates."
            f" Install a torch release lightning-dgc supports (`pip install '{SUPPORTED_TORCH}'`)."
        )
    if version is None:
        _DEVICE_FUTURES_CHECKED = True


def when_all(
    pending: Sequence[Pending], fn: Callable[[], Tensor], device: torch.device,
    keep: Sequence[Tensor] = (),
) -> torch.futures.Future:  # fmt: skip
    """A future of ``fn()``, run once every collective in ``pending`` is done; safe on CUDA streams.

    Call it after the last collective of the bucket was started; ``fn`` reads their outputs and
    must not start collectives. It runs in whatever thread completes the last one (gloo's worker;
    inline for NCCL, whose futures complete at launch with CUDA events).

    Why not ``torch.futures.collect_all(...).then(fn)``: the combined future is created without
    devices, so on CUDA its ``then`` callback runs on whichever stream the completing thread left
    current, and completing the child future records no event for its result. DDP's ``wait()`` on
    it is then a no-op for streams, and the reducer reads the result (and the strategy the
    finiteness flag and the memory) while the callback's kernels may still run: ranks decode
    different updates. Here instead ``fn`` is the ``then`` callback of a *gate* future created with
    the device. Per torch's documented semantics the callback runs with a stream from torch's pool
    current and must not switch streams; its result is then ordered for every ``wait()`` by an
    event recorded on that stream once all its work is queued. On that stream the callback first
    waits for everything the hook queued on its own stream (an event recorded now) and for each
    collective, and records every tensor of ``keep`` (made on the hook's stream, read by ``fn``,
    freed after it) on it, so that the caching allocator does not hand that memory back to the
    hook's stream while the callback still reads it; the collectives' outputs are recorded alike.
    ``when_all`` adds no host synchronisation of its own (with gloo, waiting for a collective blocks
    the thread that runs the callback, not the hook's).

    The callback's stream is ordered after the collectives by their futures: with NCCL, and with gloo
    on CUDA tensors from torch 2.11 (gloo's futures carry the device; before, waiting on one ordered
    no stream), which is why ``when_all`` raises an error on CUDA with an older torch.

    A failed collective completes the returned future with a :class:`CollectiveError` naming it,
    which DDP raises from ``backward()`` on every surviving rank.
    """
    gate: torch.futures.Future = torch.futures.Future(devices=_devices(device))
    cuda = device.type == "cuda"
    if cuda:
        if not _DEVICE_FUTURES_CHECKED:
            _check_device_futures()
        keep = [*keep, *(p.output for p in pending)]
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


class TimedCollectives(Collectives):
    """``inner``'s collectives, each one noted as it is issued by ``recorder`` (``recorder.issued(kind, nbytes,
    pending)``: ``density="auto"``'s :class:`~lightning_dgc.schedules.auto_density.ExchangeRecorder` times them)."""

    def __init__(self, inner: Collectives, recorder: Any) -> None:
        self.inner, self.recorder = inner, recorder
        self.world_size, self.rank = inner.world_size, inner.rank

    @property
    def global_rank(self) -> int:
        return self.inner.global_rank

    def all_reduce(self, tensor: Tensor, what: str) -> Pending:
        pending = self.inner.all_reduce(tensor, what)
        self.recorder.issued("all_reduce", tensor.numel() * tensor.element_size(), pending)
        return pending

    def all_gather(self, tensor: Tensor, out: Tensor, what: str) -> Pending:
        pending = self.inner.all_gather(tensor, out, what)
        self.recorder.issued("all_gather", tensor.numel() * tensor.element_size(), pending)
        return pending

    @property
    def unwrapped(self) -> Collectives:
        return self.inner.unwrapped
