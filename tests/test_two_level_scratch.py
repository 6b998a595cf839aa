"""What a two-level exchange of one bucket allocates and keeps beside the memory, counted tensor by tensor.

One rank runs alone: its collectives answer at once as if every other rank had sent the same tensors
(:class:`Echo`), and a dispatch mode (:class:`NewStorages`) notes every storage an operation makes. What is
still alive once the bucket's future is done, less the memory's own buffers, is the exchange's scratch.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_dgc import comm
from lightning_dgc.algorithms.dgc import DGCConfig
from lightning_dgc.exchange import hook
from lightning_dgc.exchange.state import ExchangeState


class Echo(comm.Collectives):
    """``world_size`` ranks, every one of which sends what this one sends; each collective is done at once. The
    reduce-scatter writes a new tensor, as a process group's does."""

    def __init__(self, world_size: int, rank: int) -> None:
        self.world_size, self.rank = world_size, rank

    def _done(self, what: str, output: Tensor) -> comm.Pending:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(output)
        return comm.Pending(what, future, output)

    def all_reduce(self, tensor: Tensor, what: str) -> comm.Pending:
        return self._done(what, tensor.mul_(self.world_size))

    def all_gather(self, tensor: Tensor, out: Tensor, what: str) -> comm.Pending:
        out.view(self.world_size, -1).copy_(tensor.reshape(1, -1))
        return self._done(what, out)

    def reduce_scatter(self, tensor: Tensor, what: str) -> comm.Pending:
        return self._done(what, tensor.view(self.world_size, -1)[self.rank] * self.world_size)


class NewStorages(TorchDispatchMode):
    """Notes every storage an operation makes (one its inputs do not share), weakly: :meth:`alive_bytes` is what
    of them is still alive, ``peak_bytes`` the most that was alive at once."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[StorageWeakRef, int, int]] = []  # (reference, data pointer, bytes)
        self.peak_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        made = False
        for tensor in tree_leaves(out):
            if isinstance(tensor, Tensor) and tensor.untyped_storage().data_ptr() not in given:
                storage = tensor.untyped_storage()
                self.made.append((StorageWeakRef(storage), storage.data_ptr(), storage.nbytes()))
                made = True
        if made:
            self.peak_bytes = max(self.peak_bytes, self._alive())
        return out

    def _alive(self) -> int:
        return sum(dict((ptr, n) for ref, ptr, n in self.made if not ref.expired()).values())

    def alive_bytes(self) -> int:
        gc.collect()
        return self._alive()


def test_a_two_level_bucket_holds_shards_while_its_step_is_open_and_its_plan_nothing_of_the_bucket_size() -> None:
    """2 nodes x 2, one bucket: while the step is open, its exchange holds this rank's half of the node's sum and
    the copy the memory's commit replays from (one bucket of fp32 in all), the update going back into the bucket,
    which DDP owns; at most the all-gather's output (the bucket in fp32) is alive beside them; once the step is
    finished, nothing of the bucket's size is left beside the memory (the plan keeps the payload alone)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
    params = list(model.parameters())
    bucket_bytes = 4 * sum(p.numel() for p in params)
    topology = comm.Topology(2, 2, 0, 0, Echo(2, 0), Echo(2, 0))
    state = ExchangeState(DGCConfig(density=0.01, value_dtype="int8"), topology=topology)
    state.register_parameters(model.named_parameters())
    for p in params:  # (the unused-parameter check reads them)
        p.grad = torch.zeros_like(p)
    buffers = [torch.randn(bucket_bytes // 4, generator=torch.Generator().manual_seed(step)) for step in range(3)]
    with NewStorages() as made:  # the plan is made in the first step, and reused after
        for step, buffer in enumerate(buffers):
            future = hook.exchange(state, params, buffer)
            assert future.wait().data_ptr() == buffer.data_ptr()  # the update goes back into the bucket
            held = (made.alive_bytes() - state.memory.nbytes()) / bucket_bytes
            assert held <= 1.05, f"step {step}: {held:.2f} buckets held while the step is open"
            del future
            state.finish_step()
            held = (made.alive_bytes() - state.memory.nbytes()) / bucket_bytes
            assert held <= 0.05, f"step {step}: {held:.2f} buckets held once the step is finished"
    peak = (made.peak_bytes - state.memory.nbytes()) / bucket_bytes
    assert peak <= 2.05, f"{peak:.2f} buckets alive at once"
