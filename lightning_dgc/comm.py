"""Collectives: the only module that calls ``torch.distributed``.

An algorithm's exchange talks to a :class:`Collectives` object, never to ``torch.distributed``:

* :class:`TorchCollectives` runs the collectives on a process group (gloo, NCCL);
* :class:`LocalCollectives` simulates ``N`` ranks in one process (one thread per rank, see
  :func:`simulate`), so that an exchange can be unit-tested on the CPU without a process group.

Every collective is started from the hook's thread, in bucket order, so that every rank issues the
same collectives in the same order (gloo matches collectives by the order in which a process starts
them; a collective started from a future's callback, which runs in a backend thread, could be
interleaved differently on different ranks). :meth:`Pending.wait` lets an exchange wait for one
step's result before it starts the next (with NCCL that orders the stream without a host
synchronisation; with gloo, and on the CPU, the host waits); :func:`when_all` runs the decode once
the last ones are done.

Beside the step's collectives: blocking helpers for setup and checkpoints (gathering objects and
tensors), the bucket layout DDP builds, and ending the process group cleanly.
"""

from __future__ import annotations

import atexit
import gc
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
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
        work = dist.all_gather_into_tensor(out, tensor, group=self.group, async_op=True)
        return Pending(what, work.get_future(), out, self.global_rank)


    def reduce_scatter(self, tensor: Tensor, what: str) -> Pending:
        block = tensor.numel() // self.world_size
        if self.world_size == 1:
            return _done(what, tensor[:block], self.global_rank)
        out = torch.empty(block, dtype=tensor.dtype, device=tensor.device)
        work = dist.reduce_scatter_tensor(out, tensor, group=self.group, async_op=True)
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
            " Install a torch release lightning-dgc supports (`pip install 'torch>=2.11,<2.14'`)."
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


# -- N ranks in one process ------------------------------------------------------------------------------
@dataclass
class _Meeting:
    """One collective, as the simulated ranks reach it."""

    kind: str
    what: str
    inputs: dict[int, Tensor] = field(default_factory=dict)
    outputs: dict[int, Tensor] = field(default_factory=dict)
    futures: dict[int, torch.futures.Future] = field(default_factory=dict)


class LocalGroup:
    """``world_size`` simulated ranks: the i-th collective of every rank meets the i-th of the others.

    The last rank to reach a collective computes it for everyone (sum or gather, in rank order, so
    every rank gets bit-identical results) and completes every rank's future. Ranks that reach
    different collectives (another kind, size or name) fail with a :class:`CollectiveError` naming
    both, where a real process group would hang or mix up data. ``fail_at`` makes the n-th collective
    fail on every rank, as a dead peer would.
    """

    def __init__(self, world_size: int, fail_at: int | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.fail_at = fail_at
        self._lock = threading.Lock()
        self._count = [0] * world_size
        self._meetings: dict[int, _Meeting] = {}
        self.log: list[str] = []  # (what) of every completed collective, in order

    def meet(self, rank: int, kind: str, what: str, tensor: Tensor, out: Tensor) -> Pending:
        future: torch.futures.Future = torch.futures.Future()
        with self._lock:
            index = self._count[rank]
            self._count[rank] += 1
            meeting = self._meetings.setdefault(index, _Meeting(kind, what))
            meeting.inputs[rank], meeting.outputs[rank], meeting.futures[rank] = tensor, out, future
            ready = len(meeting.inputs) == self.world_size
            if ready:
                del self._meetings[index]
        if ready:
            self._complete(index, meeting)
        return Pending(what, future, out, rank)

    def _complete(self, index: int, meeting: _Meeting) -> None:
        first = meeting.inputs[0]
        problem = None
        if self.fail_at is not None and index == self.fail_at:
            problem = "simulated failure: a peer died"
        for rank, tensor in meeting.inputs.items():
            if tensor.shape != first.shape or tensor.dtype != first.dtype:
                problem = f"rank {rank} sent {tuple(tensor.shape)} {tensor.dtype}, rank 0 {tuple(first.shape)} {first.dtype}"
        if problem is None:
            if meeting.kind == "all_reduce":
                total = torch.stack([meeting.inputs[r] for r in range(self.world_size)]).sum(0)
                for out in meeting.outputs.values():
                    out.copy_(total)
            else:
                gathered = torch.cat([meeting.inputs[r].reshape(-1) for r in range(self.world_size)])
                for out in meeting.outputs.values():
                    out.copy_(gathered.reshape(out.shape))
            self.log.append(meeting.what)
        for rank in range(self.world_size):
            future = meeting.futures[rank]
            if problem is None:
                future.set_result(meeting.outputs[rank])
            else:
                future.set_exception(RuntimeError(f"collective #{index} ({meeting.what}): {problem}"))


class LocalCollectives(Collectives):
    """One simulated rank of a :class:`LocalGroup` (see :func:`simulate`)."""

    def __init__(self, group: LocalGroup, rank: int, global_rank: int | None = None) -> None:
        self.group = group
        self.world_size, self.rank = group.world_size, rank
        self._global_rank = rank if global_rank is None else global_rank

    @property
    def global_rank(self) -> int:
        return self._global_rank

    def all_reduce(self, tensor: Tensor, what: str) -> Pending:
        return replace(self.group.meet(self.rank, "all_reduce", what, tensor.clone(), tensor), rank=self.global_rank)

    def all_gather(self, tensor: Tensor, out: Tensor, what: str) -> Pending:
        return replace(self.group.meet(self.rank, "all_gather", what, tensor.clone(), out), rank=self.global_rank)


def simulate(world_size: int, fn: Callable[[Collectives], Any], fail_at: int | None = None) -> list[Any]:
    """``[fn(collectives of rank r) for r in range(world_size)]``, the ranks run in parallel threads.

    Every rank's exceptions are re-raised (the first one) after all threads have finished.
    """
    group = LocalGroup(world_size, fail_at)
    return _run_ranks(world_size, lambda rank: fn(LocalCollectives(group, rank)))


def _run_ranks(world_size: int, fn: Callable[[int], Any]) -> list[Any]:
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as error:  # noqa: BLE001  (re-raised below, in the caller's thread)
            errors[rank] = error

    threads = [threading.Thread(target=run, args=(r,), name=f"rank{r}") for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for error in errors:
        if error is not None:
            raise error
    return results


# -- two levels: the ranks of a node, and the ranks across nodes ------------------------------------------
@dataclass(frozen=True)
class Topology:
    """A two-level exchange's view from one rank: ``nodes`` nodes of ``per_node`` ranks each.

    ``node``: the collectives of the ``per_node`` ranks of this rank's node (the fast local bus);
    ``across``: those of the ``nodes`` ranks that share this rank's local rank, one per node (the
    slow links). Global rank ``r`` is local rank ``r % per_node`` of node ``r // per_node``.
    """

    nodes: int
    per_node: int
    node_rank: int
    local_rank: int
    node: Collectives
    across: Collectives

    @property
    def signature(self) -> dict[str, Any]:
        """What a checkpoint records of the topology (see :func:`topology_signature`)."""
        return topology_signature(self.nodes * self.per_node, self.nodes, self.per_node, True)


def topology_signature(world_size: int, nodes: int, per_node: int, hierarchical: bool) -> dict[str, Any]:
    """``{"hierarchical": bool, "nodes": ..., "per_node": ...}``: what decides where each memory buffer
    lives (a flat run's memory is per rank whatever the nodes: it is recorded as ``world_size`` nodes of 1)."""
    if not hierarchical:
        return {"hierarchical": False, "nodes": world_size, "per_node": 1}
    return {"hierarchical": True, "nodes": nodes, "per_node": per_node}


def check_hierarchical(option: Any) -> Any:
    """``option`` if it is a value of ``hierarchical`` (``"auto"``, ``True``, ``False``), else a ``ValueError``."""
    if option not in ("auto", True, False) or (option in (0, 1) and not isinstance(option, bool)):
        raise ValueError(f"hierarchical must be 'auto', True or False, got {option!r}.")
    return option


def resolve_hierarchical(option: Any, num_nodes: int, world_size: int) -> bool:
    """Whether to run the two-level exchange for ``hierarchical=option`` (``"auto"``, ``True``, ``False``).

    ``"auto"``: when there is more than one node and more than one rank per node. Raises a
    ``ValueError`` for another value, for ``True`` on one node and for ranks that do not divide evenly
    into the nodes.
    """
    check_hierarchical(option)
    if option is False:
        return False
    if num_nodes < 1 or world_size % num_nodes:
        raise ValueError(
            f"hierarchical={option!r}: {world_size} processes do not divide evenly into {num_nodes} nodes; the"
            " two-level exchange needs the same number of devices on every node. Start every node with the same"
            " `devices` (torchrun --nproc-per-node, SLURM --ntasks-per-node), or pass hierarchical=False."
        )
    per_node = world_size // num_nodes
    if option is True and num_nodes < 2:
        raise ValueError(
            f"hierarchical=True needs more than one node, but this run has num_nodes={num_nodes}: inside one node"
            " there are no slow links to save. Set Trainer(num_nodes=...) to the number of nodes, or pass"
            " hierarchical='auto' (or False)."
        )
    return option is True or (num_nodes > 1 and per_node > 1)


def check_node_layout(ranks: Sequence[tuple[int, int, int]], nodes: int) -> int:
    """``per_node`` for every rank's ``(global_rank, node_rank, local_rank)``, or a ``ValueError`` when the
    ranks are not ``nodes`` nodes of equally many ranks numbered node by node (rank = node * per_node + local)."""
    world = len(ranks)
    counts: dict[int, int] = {}
    for _, node, _ in ranks:
        counts[node] = counts.get(node, 0) + 1
    if len(counts) != nodes or len(set(counts.values())) != 1:
        raise ValueError(
            f"hierarchical: the two-level exchange needs the same number of devices on every node, but the"
            f" {world} processes report these nodes (node_rank: processes): {dict(sorted(counts.items()))},"
            f" with num_nodes={nodes}. Start every node with the same number of processes, or pass"
            " hierarchical=False."
        )
    per_node = world // nodes
    wrong = [r for r in ranks if r[0] != r[1] * per_node + r[2]]
    if wrong:
        raise ValueError(
            f"hierarchical: global ranks must be numbered node by node (rank = node_rank * {per_node} +"
            f" local_rank), but (rank, node_rank, local_rank) = {wrong[0]}. Use the launcher's default rank"
            " assignment, or pass hierarchical=False."
        )
    return per_node


def two_level_topology(nodes: int, per_node: int, rank: int) -> Topology:
    """The process groups of a two-level exchange (blocking; every rank must call it, in the same order)."""
    node_rank, local_rank = divmod(rank, per_node)
    node_group = across_group = None
    for n in range(nodes):  # every rank creates every group (torch.distributed requires it)
        group = dist.new_group([n * per_node + i for i in range(per_node)])
        if n == node_rank:
            node_group = group
    for i in range(per_node):
        group = dist.new_group([n * per_node + i for n in range(nodes)])
        if i == local_rank:
            across_group = group
    return Topology(
        nodes, per_node, node_rank, local_rank, TorchCollectives(node_group), TorchCollectives(across_group)
    )


def simulate_nodes(
    nodes: int, per_node: int, fn: Callable[[Topology], Any],
    fail_at_node: int | None = None, fail_at_across: int | None = None,
) -> list[Any]:  # fmt: skip
    """:func:`simulate` for a two-level topology: ``[fn(topology of rank r)]`` for ``nodes * per_node``
    ranks in threads. ``fail_at_node`` / ``fail_at_across``: the n-th collective of every group of that
    level fails on every rank of the group, as a dead peer would."""
    node_groups = [LocalGroup(per_node, fail_at_node) for _ in range(nodes)]
    across_groups = [LocalGroup(nodes, fail_at_across) for _ in range(per_node)]

    def topology(rank: int) -> Topology:
        n, i = divmod(rank, per_node)
        return Topology(nodes, per_node, n, i, LocalCollectives(node_groups[n], i, rank),
                        LocalCollectives(across_groups[i], n, rank))  # fmt: skip

    return _run_ranks(nodes * per_node, lambda rank: fn(topology(rank)))


# -- setup, checkpoints and exit (blocking; never on the hot path) ----------------------------------------
def world_size_and_rank(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(world_size, rank)`` of ``group``, or ``(1, 0)`` when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def all_gather_object(obj: object, group: dist.ProcessGroup | None = None) -> list[object]:
    """Every rank's ``obj`` (blocking; for setup-time consistency checks, never per step)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def host_group() -> dist.ProcessGroup | None:
    """A process group of every rank whose collectives run on CPU tensors (blocking; every rank calls it):
    the default group under gloo, a gloo group beside NCCL's otherwise. ``None`` also when not distributed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() == dist.Backend.GLOO:
        return None
    return dist.new_group(backend="gloo")


def all_gather_host(tensor: Tensor, group: dist.ProcessGroup | None = None) -> list[Tensor]:
    """Every rank's copy of a small CPU ``tensor`` over a :func:`host_group` (blocking; no device synchronisation)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor, group=group)
    return out


def gather_object(obj: object, dst: int = 0, group: dist.ProcessGroup | None = None) -> list[object] | None:
    """Every rank's ``obj`` on rank ``dst`` (``None`` elsewhere); blocking, for checkpoints only."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[object] | None = [None] * dist.get_world_size(group) if dist.get_rank(group) == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def gather_tensors(
    tensors: Sequence[Tensor], dst: int = 0, group: dist.ProcessGroup | None = None, copy_own: bool = True
) -> list[list[Tensor]] | None:
    """Every rank's copy of each tensor, as CPU tensors on rank ``dst`` (``None`` elsewhere); blocking.

    For checkpoints, with as little memory as possible: tensor by tensor, point to point, so that a rank
    other than ``dst`` sends its tensors as they are (a device tensor straight from the device with NCCL;
    with gloo, brought to the CPU one at a time), and ``dst`` holds only what it received plus its own
    tensors: copies, or with ``copy_own=False`` on the CPU the tensors themselves (for a caller that is
    done with them before they change, e.g. one that writes them to a file synchronously).
    Every rank must pass tensors of the same shapes and dtypes in the same order.
    """
    world, rank = world_size_and_rank(group)
    if world == 1:
        return [[t.detach().cpu().clone()] for t in tensors]
    on_cpu = dist.get_backend(group) == dist.Backend.GLOO
    peer = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    out: list[list[Tensor]] = []
    for tensor in tensors:
        source = tensor.detach()
        source = (source.cpu() if on_cpu else source).contiguous()
        if rank != dst:
            dist.send(source, peer(dst), group=group)
            continue
        copies = []
        for r in range(world):
            if r == dst:
                own = source.cpu()
                copies.append(own.clone() if copy_own and own.data_ptr() == tensor.data_ptr() else own)
            else:
                received = torch.empty_like(source)
                dist.recv(received, peer(r), group=group)
                copies.append(received.cpu())
        out.append(copies)
    return out if rank == dst else None


def average(tensor: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """``tensor`` replaced, in place, by its mean over ranks (blocking; not for the hot path)."""
    world, _ = world_size_and_rank(group)
    if world > 1:
        dist.all_reduce(tensor, group=group)
        tensor.div_(world)
    return tensor


def bucket_assignment(tensors: Sequence[Tensor], caps: Sequence[int]) -> list[list[int]]:
    """The buckets DDP builds for ``tensors`` (in the order given) with these byte caps: indices per bucket."""
    groups, _ = dist._compute_bucket_assignment_by_size(list(tensors), list(caps), [False] * len(tensors))
    return [list(group) for group in groups]


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
        # Free unreachable DDP wrappers (their reducers, comm hook states and futures) while the
        # interpreter and the group are still whole: a launcher that built several (one Fabric per
        # phase, say) leaves them in reference cycles, to be torn down during finalization otherwise.
        gc.collect()
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
