"""``N`` ranks in one process, one thread each (:func:`simulate`, :func:`simulate_nodes`): an exchange tested on
the CPU without a process group."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from lightning_dgc.comm.collectives import Collectives, Pending
from lightning_dgc.comm.topology import Topology


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


