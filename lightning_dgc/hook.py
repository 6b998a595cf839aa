"""One DDP communication hook for every compression algorithm.

``exchange_hook(state, bucket)`` replaces DDP's dense all-reduce of one gradient bucket by the state's
algorithm (:mod:`lightning_dgc.algorithms`: DGC, DEFT, PowerSGD, ...), in numbered steps:

0. **plan**: what the algorithm decides once per bucket layout (and density, ...).
1. **local gradient**: the bucket in fp32, the loss scale divided out, and its *poison*: 0, or NaN
   when this rank's gradient is not finite, which the algorithm adds to what it sends (every rank
   still takes part in every collective), so that every rank decodes a non-finite bucket and skips
   the step alike. No host synchronisation.
2. **compensate**: error feedback / momentum correction into scratch memory.
3. **select**: what to send (timed: ``compression_stats()["selection_ms"]``).
4. **exchange**: the collectives, through ``state.collectives``, in the same order on every rank.
5. **decode**: once they are done, in their future's callback (ordered on CUDA with events,
   :func:`lightning_dgc.comm.when_all`; every tensor the decode reads that this stream made is in
   ``work.keep`` or is a collective's output, so that its memory is not reused too early): the
   averaged update, its finiteness, the loss scale multiplied back, the bucket's dtype.
6. **memory**: what steps 2-5 staged is committed by ``state.finish_step()`` (or discarded if any
   rank saw inf/NaN) once the whole backward pass is done.

DDP checks the hook's annotations literally, so this module does not use postponed annotations.
"""

import math
import time

import torch
from torch import Tensor

from lightning_dgc import comm
from lightning_dgc.comm import GradBucket
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

    # Step 5: decode, once the collectives are done.
    def decode() -> Tensor:
        update = algorithm.decode(plan, work)
        state.memory.note_finite(torch.isfinite(update.sum()))
        if state.grad_scale != 1.0:
            update.mul_(state.grad_scale)
        return update if buffer.dtype == torch.float32 else update.to(buffer.dtype)

    future = comm.when_all(pending, decode, buffer.device, keep=work.keep)

    # Step 6: the memory staged in steps 2-5 commits with the step (state.finish_step()).
    state.memory.note_bucket(future)
    return future
