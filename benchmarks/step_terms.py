"""The terms of a training step on the emulated links, each measured on its own, for the performance model.

The slow-link benchmarks (:mod:`benchmarks.two_level_links`, :mod:`benchmarks.slow_links`) time whole steps of every
strategy; beside them, in the same processes and with the same neighbours on the cores, they measure what the
model (:func:`lightning_dgc.perfmodel.step_time`) adds up, one term at a time:

* **compute** (:func:`no_exchange_strategy`): the step of the same ``Trainer`` under DDP whose buckets are handed
  back untouched (a communication hook that returns at once): forward, backward, DDP's bucket copies and buffer
  broadcast, the optimizer and Lightning's loop, without any exchange, on each link;
* **the hook's host work** (:func:`hook_host_s`): each strategy's exchange (compensate, select, pack, decode, the
  memory's commit; two levels: the shards too) on the model's real gradients and DDP's buckets, its collectives
  answered at once by :class:`LoopbackCollectives`, so that no network and no peer is in it;
* **a collective's latency** (:func:`collective_s`): the median time of an all-reduce and of an all-gather of 4
  bytes on a process group, every rank at once: what each collective costs besides its bytes;
* **the collectives of a step** (:class:`CollectiveCount`): every collective a step issues, counted by the
  profiler's record of the process group's operations (``gloo:all_reduce``, ``gloo:all_gather``, ...),
  DDP's own included.

The link's rate and round trip are measured by :class:`benchmarks.netns.SlowLink`.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

from lightning_dgc.comm import Collectives, Pending, Topology


# -- the hook's host work --------------------------------------------------------------------------------------
def _done(what: str, output: Tensor) -> Pending:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(output)
    return Pending(what, future, output)


class LoopbackCollectives(Collectives):
    """``world_size`` ranks whose collectives are answered at once, with no peer: an all-reduce leaves the tensor
    as it is, an all-gather fills every rank's row with this rank's tensor (what the decode then reads)."""

    def __init__(self, world_size: int, rank: int = 0) -> None:
        self.world_size, self.rank = world_size, rank

    def all_reduce(self, tensor: Tensor, what: str) -> Pending:
        return _done(what, tensor)

    def all_gather(self, tensor: Tensor, out: Tensor, what: str) -> Pending:
        out.view(self.world_size, -1).copy_(tensor.reshape(1, -1).expand(self.world_size, -1))
        return _done(what, out)


def hook_host_s(
    module: nn.Module, loss: Callable[[nn.Module], Tensor], config: Any, param_settings: dict[str, Any],
    world_size: int, per_node: int = 1, steps: int = 8, warmup: int = 2, local_rank: int = 0,
) -> float:  # fmt: skip
    """Median seconds per step of the exchange's own work on this host for ``module``'s gradient of ``loss``.

    The exchange runs as a strategy runs it (``config``, and the per-parameter settings its optimizer take-over
    gave, ``param_settings``), on DDP's bucket layout of ``module``, over ``world_size`` ranks, in two levels of
    ``per_node`` ranks per node when ``per_node > 1``, with every collective answered at once
    (:class:`LoopbackCollectives`): every bucket's hook, the futures, the memory's commit and the deferred decode
    (``finish_step``). The gradients are the model's own, computed once.
    """
    from lightning_dgc.exchange import hook
    from lightning_dgc.exchange.state import ExchangeState
    from lightning_dgc.front.profiler import bucket_layout

    module = copy.deepcopy(module)
    module.zero_grad()
    loss(module).backward()
    layout = bucket_layout(module)
    grads = [[p.grad.detach().clone() for _, p in bucket] for bucket in layout]
    topology = None
    if per_node > 1:
        nodes = world_size // per_node
        topology = Topology(nodes, per_node, 0, local_rank, LoopbackCollectives(per_node, local_rank),
                            LoopbackCollectives(nodes, 0))  # fmt: skip
        state = ExchangeState(copy.deepcopy(config), topology=topology)
    else:
        state = ExchangeState(copy.deepcopy(config), collectives=LoopbackCollectives(world_size))
    state.register_parameters(list(module.named_parameters()))
    state.param_settings.update(param_settings)
    state.finish_writes_grads = True
    buffers = [torch.cat([g.reshape(-1) for g in bucket]) for bucket in grads]
    times = []
    for _ in range(warmup + steps):
        for bucket, buffer, g in zip(layout, buffers, grads, strict=True):  # DDP's copy into its buckets: not timed
            torch.cat([x.reshape(-1) for x in g], out=buffer)
            for (_, p), x in zip(bucket, g, strict=True):
                p.grad.copy_(x)
        start = time.perf_counter()
        futures = [hook.exchange(state, [p for _, p in bucket], buffer)
                   for bucket, buffer in zip(layout, buffers, strict=True)]  # fmt: skip
        for future in futures:
            future.wait()
        state.finish_step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:])


# -- the compute ---------------------------------------------------------------------------------------------------
def _no_exchange_hook(state: Any, bucket: Any) -> torch.futures.Future[Tensor]:
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


# DDP checks a hook's annotations literally (this module postpones them)
_no_exchange_hook.__annotations__ = {"state": object, "bucket": torch.distributed.GradBucket,
                                     "return": torch.futures.Future[torch.Tensor]}  # fmt: skip


class _NoExchange(L.Callback):
    """Registers :func:`_no_exchange_hook` on the DDP wrapper before the first step."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        trainer.strategy.model.register_comm_hook(None, _no_exchange_hook)


def no_exchange_strategy(**kwargs: Any) -> tuple[Any, L.Callback]:
    """``(strategy, callback)``: DDP whose buckets are handed back as they are: the step of the ``Trainer`` with
    everything but the exchange (DDP's broadcast of the buffers before each forward pass included, which every
    strategy built on DDP runs); pass the callback to the ``Trainer``."""
    from lightning.pytorch.strategies import DDPStrategy

    return DDPStrategy(gradient_as_bucket_view=True, **kwargs), _NoExchange()


# -- collectives -----------------------------------------------------------------------------------------------
def collective_s(group: Any = None, repeats: int = 9, nbytes: int = 256) -> dict[str, float]:
    """Median seconds of an all-reduce and of an all-gather of ``nbytes`` on ``group``, every rank at once (each
    after a barrier): what a collective costs besides its bytes. The default, 64 values, gives every rank of a ring
    a segment (gloo skips the steps of empty segments, so that a collective of fewer values than ranks takes fewer
    steps than any gradient's)."""
    import torch.distributed as dist

    from lightning_dgc.comm import TorchCollectives

    ops = TorchCollectives(group)  # the all-gather by the name the installed torch has
    x = torch.zeros(max(1, nbytes // 4))
    out = torch.zeros(ops.world_size * x.numel())
    result = {}
    for kind, run in (("all_reduce", lambda: ops.all_reduce(x, "latency").wait()),
                      ("all_gather", lambda: ops.all_gather(x, out, "latency").wait())):  # fmt: skip
        times = []
        for _ in range(repeats + 1):
            dist.barrier(group=group)
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        result[kind] = statistics.median(times[1:])
    return result


class CollectiveCount(L.Callback):
    """The collectives of ``span`` optimizer steps from step ``at`` on, counted by name from the profiler's record of
    the process group's operations (``gloo:all_reduce``, ``gloo:all_gather``, ``gloo:broadcast``, ...): every
    collective the step issues, DDP's own included. ``per_step`` holds the counts divided by ``span``."""

    def __init__(self, at: int, span: int = 1) -> None:
        self.at, self.span = at, span
        self.per_step: dict[str, float] = {}
        self._profiler: Any = None

    def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
        if trainer.global_step == self.at and self._profiler is None:
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CPU])
            self._profiler.start()

    def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
        if self._profiler is not None and trainer.global_step == self.at + self.span:
            self._profiler.stop()
            counts = Counter(e.name for e in self._profiler.events() if e.name.startswith("gloo:"))
            self.per_step = {name: n / self.span for name, n in sorted(counts.items())}
            self._profiler = None


def total(counts: dict[str, float], kinds: Sequence[str] | None = None) -> float:
    """The collectives of ``counts`` (of the names in ``kinds``, default all)."""
    return sum(n for name, n in counts.items() if kinds is None or name in kinds)
