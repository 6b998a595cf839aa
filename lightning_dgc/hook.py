"""One DDP communication hook for every compression algorithm.

``exchange_hook(state, bucket)`` replaces DDP's dense all-reduce of one gradient bucket by the state's
algorithm (:mod:`lightning_dgc.algorithms`: DGC, DEFT, PowerSGD, ...), in numbered steps:

0. **plan**: what the algorithm decides once per bucket layout (and density, ...).
1. **local gradient**: the bucket in fp32, the loss scale divided out, and its *poison*: 0, or NaN
   when this rank's gradient is not finite, which the algorithm adds to what it sends (every rank
   still takes part in every collective), so that every rank decodes a non-finite bucket and skips
   the step alike. No host synchronisation.
2. **compensate**: error feedback / momentum correction: what to select from (a temporary, or scratch
   memory for small buffers), the memory itself updated only when the step commits (step 6).
3. **select**: what to send (timed: ``compression_stats()["selection_ms"]``).
4. **exchange**: the collectives, through ``state.collectives``, in the same order on every rank.
5. **decode**: once they are done, in their future's callback (ordered on CUDA with events,
   :func:`lightning_dgc.comm.when_all`; every tensor the decode reads that this stream made is in
   ``work.keep`` or is a collective's output, so that its memory is not reused too early): the
   averaged update, its finiteness, the loss scale multiplied back, the bucket's dtype.
6. **memory**: what steps 2-5 staged (or noted to replay in place) is committed by ``state.finish_step()``
   (or discarded if any rank saw inf/NaN) once the whole backward pass is done.

With ``state.finish_writes_grads`` (the strategies ask for it; a flat exchange only), an algorithm that can tell
finiteness before decoding (:meth:`~lightning_dgc.algorithms.Algorithm.decoded_finite`: DGC, DEFT,
PowerSGD with error feedback) decodes in step 6 instead: the future hands DDP the bucket as it is (the
local gradient, which DDP copies into ``.grad``), ``finish_step()`` commits the memory from that local
gradient and then writes the averaged update into the bucket and every parameter's ``.grad``. The local
gradient then needs no copy of its own until the commit (one model size less). Until ``finish_step()``
returns, ``.grad`` holds this rank's gradient (error feedback: its compensated gradient).

Across nodes of several devices (``state.topology``, the strategies' ``hierarchical`` option),
:func:`exchange_two_level` wraps the same steps: a dense reduce-scatter inside the node, the algorithm
on this rank's shard across the nodes, an all-gather inside the node. Every algorithm gets it unchanged.

DDP checks the hook's annotations literally, so this module does not use postponed annotations.
"""

import math
import time
from typing import Any

import torch
from torch import Tensor

from lightning_dgc import comm
from lightning_dgc.comm import GradBucket
from lightning_dgc.memory import write_bucket_order_
from lightning_dgc.state import ExchangeState


def exchange_hook(state: ExchangeState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Compress, exchange and decode one DDP bucket with ``state.algorithm`` (see the module docstring)."""
    return exchange(state, bucket.parameters(), bucket.buffer())


def exchange(
    state: ExchangeState, params: list[Tensor], buffer: Tensor
) -> torch.futures.Future[torch.Tensor]:
    """The hook's steps for a bucket of ``params`` whose gradients ``buffer`` holds (flat, in their order).

    What :func:`exchange_hook` runs for a DDP bucket; callable without DDP, e.g. on simulated ranks
    (:func:`lightning_dgc.comm.simulate`). Returns the future of the averaged gradients.
    """
    if state.topology is not None:
        return exchange_two_level(state, params, buffer)
    algorithm = state.algorithm

    # Step 0: the plan of this bucket layout.
    plan = state.plan(params, buffer)

    # Step 1: the local gradient, fp32 (an fp32 bucket is used in place: DDP hands it over).
    flat = buffer if buffer.dtype == torch.float32 else buffer.float()  # a copy is kept alive below
    # inf/NaN anywhere makes the sum non-finite (finite gradients summing past 3e38 do not occur)
    poison = torch.where(torch.isfinite(flat.sum()), 0.0, math.nan)
    if state.grad_scale != 1.0:
        flat.mul_(1.0 / state.grad_scale)
    grads = list(flat.split([spec.numel for spec in plan.layout]))

    # Step 2: compensate.
    work = algorithm.compensate(plan, grads, flat)
    work.poison = poison
    if flat is not buffer:  # made on this stream, read and written by the decode on another (CUDA)
        work.keep.append(flat)

    # Step 3: select.
    start = time.perf_counter()
    algorithm.select(plan, work)
    selected_s = time.perf_counter() - start

    # Step 4: exchange.
    pending = algorithm.exchange(plan, work, state.collectives)
    selection_s = work.selection_s if work.selection_s is not None else selected_s
    state.record(algorithm.cost(plan), work, selection_s)

    # Step 5: decode, once the collectives are done; or, when the state writes the gradients itself, only
    # check finiteness and hand DDP the bucket as it is (the decode waits for step 6).
    scale = state.grad_scale
    deferred = state.finish_writes_grads
    held: list[bool] = []  # [True] once step 5 handed the bucket over undecoded

    def decode() -> Tensor:
        if deferred:
            finite = algorithm.decoded_finite(plan, work)
            if finite is not None:
                state.memory.note_finite(finite)
                held.append(True)
                return buffer
        update = algorithm.decode(plan, work)
        state.memory.note_finite(torch.isfinite(update.sum()))
        if scale != 1.0:
            update.mul_(scale)
        return update if buffer.dtype == torch.float32 else update.to(buffer.dtype)

    future = comm.when_all(pending, decode, buffer.device, keep=work.keep)

    # Step 6: the memory staged or replayed in steps 2-5 commits with the step (state.finish_step()); a
    # deferred decode then writes the averaged update into the gradients.
    state.memory.note_bucket(future)
    if deferred:

        def deliver(finite: bool) -> None:
            if not held:
                return  # decoded in step 5 already (the algorithm could not tell finiteness before)
            update = algorithm.decode(plan, work)
            if scale != 1.0:
                update.mul_(scale)
            if update is not buffer:
                buffer.copy_(update)
            for param, spec in zip(params, plan.layout, strict=True):
                if param.grad is not None:
                    write_bucket_order_(param.grad, buffer[spec.offset : spec.offset + spec.numel])

        state.memory.note_delivery(deliver)
    return future


def exchange_two_level(
    state: ExchangeState, params: list[Tensor], buffer: Tensor
) -> torch.futures.Future[torch.Tensor]:
    """The hook's steps in two levels (``state.topology``): the same steps, on this rank's shard.

    0. **plan**: the bucket cut into the node's shards (:mod:`lightning_dgc.shards`) and the algorithm's
       plan of this rank's shard, whose pieces are tensors of their own.
    1. **local gradient**, into the node layout; a dense **reduce-scatter inside the node** sums it, and
       this rank's shard divided by the ranks per node is the node's mean gradient, whose poison the
       algorithm carries.
    2-4. **compensate, select, exchange**: the algorithm's own steps on the shard, across the nodes
       (``state.collectives``: the ranks sharing this local rank); the memory is this shard's.
    5. **decode** the shard once the exchange across nodes is done (the hook waits for it: on CUDA
       without a host synchronisation, on the CPU blocking), then an **all-gather inside the node** of
       the decoded shards, put back in bucket order once it is done.
    6. **memory**: as in :func:`exchange`.

    A failed collective at either level completes the bucket's future with the
    :class:`~lightning_dgc.comm.CollectiveError`, which DDP raises from ``backward()``.
    """
    algorithm, topology = state.algorithm, state.topology
    assert topology is not None

    # Step 0: the plan of this bucket layout.
    two = state.plan(params, buffer)
    shard, plan = two.shard, two.inner
    try:
        # Step 1: the local gradient, fp32, in the node layout, the loss scale divided out.
        two.node.index_copy_(0, shard.dest, buffer if buffer.dtype == torch.float32 else buffer.float())
        if state.grad_scale != 1.0:
            two.node.mul_(1.0 / state.grad_scale)
        summed = topology.node.reduce_scatter(two.node, "reduce-scatter inside the node").wait()
        if plan is None:  # this rank owns no piece of the bucket: nothing to exchange across the nodes
            gathered = topology.node.all_gather(two.decoded, two.gathered, "all-gather inside the node")
            return _finish_two_level(state, two, buffer, gathered, [])
        flat = summed[: shard.numel].div_(topology.per_node)
        poison = torch.where(torch.isfinite(flat.sum()), 0.0, math.nan)
        grads = list(flat.split([spec.numel for spec in plan.layout]))

        # Step 2: compensate.
        work = algorithm.compensate(plan, grads, flat)
        work.poison = poison

        # Step 3: select.
        start = time.perf_counter()
        algorithm.select(plan, work)
        selected_s = time.perf_counter() - start

        # Step 4: exchange, across the nodes.
        pending = algorithm.exchange(plan, work, state.collectives)
        selection_s = work.selection_s if work.selection_s is not None else selected_s
        state.record(algorithm.cost(plan), work, selection_s, two.node_link_bytes())

        # Step 5: decode the shard, then the all-gather of the node's decoded shards.
        for collective in pending:
            collective.wait()
        two.decoded[: shard.numel].copy_(algorithm.decode(plan, work))
        gathered = topology.node.all_gather(two.decoded, two.gathered, "all-gather inside the node")
    except comm.CollectiveError as error:
        failed: torch.futures.Future = torch.futures.Future()
        failed.set_exception(error)
        state.memory.note_bucket(failed)
        return failed
    return _finish_two_level(state, two, buffer, gathered, work.keep)


def _finish_two_level(
    state: ExchangeState, two: Any, buffer: Tensor, gathered: comm.Pending, keep: list[Tensor]
) -> torch.futures.Future[torch.Tensor]:
    """Step 5's end and step 6 of :func:`exchange_two_level`: the bucket in its order once the all-gather is done."""

    def finish() -> Tensor:
        update = two.gathered.index_select(0, two.shard.dest)
        state.memory.note_finite(torch.isfinite(update.sum()))
        if state.grad_scale != 1.0:
            update.mul_(state.grad_scale)
        return update if buffer.dtype == torch.float32 else update.to(buffer.dtype)

    future = comm.when_all([gathered], finish, buffer.device, keep=[*keep, two.node])

    # Step 6: the memory staged in steps 2-5 commits with the step (state.finish_step()).
    state.memory.note_bucket(future)
    return future
