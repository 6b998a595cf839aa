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

At density 1, once no rank holds a residual, the front doors put the state in DDP's own step
(:mod:`lightning_dgc.exchange.passthrough`), which replaces steps 0-6 by DDP's all-reduce and SGD's momentum.

DDP checks the hook's annotations literally, so this module does not use postponed annotations.
"""

import math
import time

import torch
from torch import Tensor

from lightning_dgc import comm
from lightning_dgc.algorithms import BucketPlan, BucketWork
from lightning_dgc.comm import GradBucket
from lightning_dgc.exchange.passthrough import exchange_passthrough
from lightning_dgc.exchange.state import ExchangeState
from lightning_dgc.exchange.two_level import TwoLevelPlan
from lightning_dgc.tensor_ops.memory import write_bucket_order_


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
    # Step 0: the plan of this bucket layout, with the state's decisions: two levels, DDP's own step, deferral.
    plan = state.plan(params, buffer)
    deferred_decode = state.finish_writes_grads
    if isinstance(plan, TwoLevelPlan):
        return exchange_two_level(state, plan, buffer)
    if state.passthrough:
        return exchange_passthrough(state, plan, params, buffer)
    algorithm = state.algorithm

    # Step 1: the local gradient, fp32 (an fp32 bucket is used in place: DDP hands it over).
    flat = buffer if buffer.dtype == torch.float32 else buffer.float()  # a copy is kept alive below
    if state.grad_scale != 1.0:
        flat.mul_(1.0 / state.grad_scale)

    # Steps 2-4: compensate, select, exchange.
    work, pending, selection_s = compensate_select_exchange(state, plan, flat)
    if flat is not buffer:  # made on this stream, read and written by the decode on another (CUDA)
        work.keep.append(flat)

    # Step 5: decode, once the collectives are done; or, when the state writes the gradients itself, only
    # check finiteness and hand DDP the bucket as it is (the decode waits for step 6).
    scale = state.grad_scale
    deferred = DeferredDecode(state, plan, work, params, buffer) if deferred_decode else None

    def decode() -> Tensor:
        if deferred is not None and deferred.hold():
            return buffer
        update = algorithm.decode(plan, work)
        state.memory.note_finite(torch.isfinite(update.sum()))
        return _in_bucket_units(update, buffer, scale)

    # Step 6: the statistics, and the future; the memory staged or replayed in steps 2-5 commits with the step
    # (state.finish_step()), and a deferred decode then writes the averaged update into the gradients.
    return state.record(algorithm.cost(plan), work, selection_s, pending, decode, buffer.device, keep=work.keep,
                        deliver=deferred.deliver if deferred is not None else None)  # fmt: skip


def compensate_select_exchange(
    state: ExchangeState, plan: BucketPlan, flat: Tensor
) -> tuple[BucketWork, list[comm.Pending], float]:
    """Steps 2-4 on ``flat``, the local gradient of ``plan``'s tensors in fp32 without the loss scale (a flat
    bucket, or this rank's shard of the node's mean gradient): the algorithm's work, its collectives and the
    selection's time (what the step's statistics record).

    The *poison* (0, or NaN when this rank's gradient is not finite) goes with what the algorithm sends.
    """
    algorithm = state.algorithm
    # inf/NaN anywhere makes the sum non-finite (finite gradients summing past 3e38 do not occur)
    poison = torch.where(torch.isfinite(flat.sum()), 0.0, math.nan)
    grads = list(flat.split([spec.numel for spec in plan.layout]))

    # Step 2: compensate.
    work = algorithm.compensate(plan, grads, flat)
    work.poison = poison

    # Step 3: select.
    start = time.perf_counter()
    algorithm.select(plan, work)
    selected_s = time.perf_counter() - start

    # Step 4: exchange.
    pending = algorithm.exchange(plan, work, state.collectives)
    return work, pending, work.selection_s if work.selection_s is not None else selected_s


class DeferredDecode:
    """Step 5 of a flat exchange deferred to step 6 (``state.finish_writes_grads``, see the module docstring).

    In the collectives' callback, :meth:`hold` tells finiteness from what was received
    (:meth:`~lightning_dgc.algorithms.Algorithm.decoded_finite`) and hands DDP the bucket as it is, the local
    gradient, which the memory's commit then reads; ``finish_step()`` runs :meth:`deliver` after the commit's
    replays, which decodes the averaged update into the bucket and every parameter's ``.grad``. An algorithm
    that cannot tell finiteness before decoding is decoded in the callback as usual.
    """

    def __init__(
        self, state: ExchangeState, plan: BucketPlan, work: BucketWork, params: list[Tensor], buffer: Tensor
    ) -> None:
        self.state, self.plan, self.work, self.params, self.buffer = state, plan, work, params, buffer
        self.scale = state.grad_scale
        self.held = False  # whether the callback handed the bucket over undecoded

    def hold(self) -> bool:
        """In the callback: note finiteness and hold the decode back, if the algorithm can tell it before."""
        finite = self.state.algorithm.decoded_finite(self.plan, self.work)
        if finite is None:
            return False
        self.state.memory.note_finite(finite)
        self.held = True
        return True

    def deliver(self, finite: bool) -> None:
        """In ``finish_step()``: the averaged update into the bucket and the gradients (a held bucket only)."""
        if not self.held:
            return  # decoded in the callback already
        buffer = _into_bucket(self.state.algorithm.decode(self.plan, self.work), self.buffer, self.scale)
        for param, spec in zip(self.params, self.plan.layout, strict=True):
            if param.grad is not None:
                write_bucket_order_(param.grad, buffer[spec.offset : spec.offset + spec.numel])


def _in_bucket_units(update: Tensor, buffer: Tensor, scale: float) -> Tensor:
    """The decoded fp32 update with the loss scale multiplied back, in the bucket's dtype."""
    if scale != 1.0:
        update.mul_(scale)
    return update if buffer.dtype == torch.float32 else update.to(buffer.dtype)


def _into_bucket(update: Tensor, buffer: Tensor, scale: float) -> Tensor:
    """The decoded fp32 update with the loss scale multiplied back, written into the bucket itself (returned)."""
    if scale != 1.0:
        update.mul_(scale)
    if update is not buffer:
        buffer.copy_(update)
    return buffer


def exchange_two_level(state: ExchangeState, two: TwoLevelPlan, buffer: Tensor) -> torch.futures.Future[torch.Tensor]:
    """The hook's steps in two levels (``state.topology``; ``two``: the bucket's plan): the same steps, on this
    rank's shard.

    0. **plan**: the bucket cut into the node's shards (:mod:`lightning_dgc.exchange.shards`) and the algorithm's
       plan of this rank's shard, whose pieces are tensors of their own
       (:class:`~lightning_dgc.exchange.two_level.TwoLevelPlan`).
    1. **local gradient**, into the node layout (a copy made for the step); a dense **reduce-scatter inside the
       node** sums it, and this rank's shard divided by the ranks per node is the node's mean gradient, whose
       poison the algorithm carries.
    2-4. **compensate, select, exchange**: :func:`compensate_select_exchange` on the shard, across the nodes
       (``state.collectives``: the ranks sharing this local rank); the memory is this shard's.
    5. **decode** the shard once the exchange across nodes is done (the hook waits for it: on CUDA
       without a host synchronisation, on the CPU blocking), then an **all-gather inside the node** of
       the decoded shards, written back into the bucket in bucket order once it is done (the future's result
       is the bucket itself, of which DDP keeps no copy). The plan holds no buffer of the bucket's size: each
       exchange's scratch is freed with it.
    6. **memory**: as in :func:`exchange`.

    A failed collective at either level completes the bucket's future with the
    :class:`~lightning_dgc.comm.CollectiveError`, which DDP raises from ``backward()``.
    """
    algorithm, topology, scale = state.algorithm, state.topology, state.grad_scale
    assert topology is not None
    shard, plan = two.shard, two.inner
    keep: list[Tensor] = []
    cost, work, selection_s = None, None, 0.0  # a rank that owns no piece of the bucket exchanges nothing across
    try:
        # Step 1: the local gradient, fp32, in the node layout, the loss scale divided out; summed inside the node.
        node = two.node_gradient(buffer, scale)
        summed = topology.node.reduce_scatter(node, "reduce-scatter inside the node").wait()
        del node  # a process group's reduce-scatter writes a tensor of its own: only this rank's shard lives on
        # this rank's decoded shard, zero-padded, which the all-gather sends: the sum's own padding is 0, and so is
        # the shard of a rank that owns no piece of the bucket
        decoded = summed
        if plan is not None:  # else this rank owns no piece of the bucket: nothing to exchange across the nodes
            # Steps 2-4: on the node's mean gradient of this rank's shard, across the nodes.
            flat = summed[: shard.numel].div_(topology.per_node)
            work, pending, selection_s = compensate_select_exchange(state, plan, flat)
            cost = algorithm.cost(plan)
            keep += work.keep

            # Step 5: decode the shard.
            for collective in pending:
                collective.wait()
            update = algorithm.decode(plan, work)
            if update.data_ptr() != flat.data_ptr():  # decoded elsewhere: the commit may still read the shard
                decoded = summed.new_zeros(shard.shard_numel)
                decoded[: shard.numel].copy_(update)
        # ... then the all-gather of the node's decoded shards.
        gathered = topology.node.all_gather(decoded, decoded.new_empty(shard.parts * shard.shard_numel),
                                            "all-gather inside the node")  # fmt: skip
    except comm.CollectiveError as error:
        failed: torch.futures.Future = torch.futures.Future()
        failed.set_exception(error)
        state.memory.note_bucket(failed)
        return failed

    def finish() -> Tensor:
        # the update in bucket order, written into the bucket itself (DDP then keeps no copy of it): the local
        # gradient there was copied out in step 1
        update = shard.to_bucket(gathered.output, buffer if buffer.dtype == torch.float32 else None)
        state.memory.note_finite(torch.isfinite(update.sum()))
        return _into_bucket(update, buffer, scale)

    # Step 6: the statistics, and the future; the memory staged in steps 2-5 commits with the step.
    return state.record(cost, work, selection_s, [gathered], finish, buffer.device, keep=keep,
                        node_link_bytes=two.node_link_bytes)  # fmt: skip
