"""What a top-k bucket exchanges dense and how its average is decoded (:mod:`lightning_dgc.algorithms.sparse`'s
step 5): the all-reduce of the tensors sent whole, the averaged update built from the exchanged parts, and SGD
momentum on the tensors averaged dense."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lightning_dgc.algorithms.sparse import Entry, SparsePlan, SparseTopK, SparseWork
    from lightning_dgc.comm import Collectives, Pending


def release(work: SparseWork) -> None:
    """Drop the step's bucket-sized temporaries once the collectives have their inputs (the memory is
    updated at commit from the local gradient, not from them)."""
    work.velocity = None
    work.sparse = []
    work.dense_parts = []


def exchange_dense(
    parts: list[Tensor], value_dtype: torch.dtype, collectives: Collectives, poison: Tensor | None = None
) -> Pending | None:
    """Start the all-reduce of the tensors exchanged dense (see :func:`dense_sum` for its result).

    With fp16 values they travel in fp16 too, pre-divided by the world size like torch's
    ``fp16_compress_hook`` (so the sum cannot overflow where the average would not); a value that
    still overflows makes the step non-finite, and it is skipped on every rank.
    """
    if not parts:
        return None
    dense = torch.cat(parts)
    if poison is not None:
        dense[:1].add_(poison)
    if value_dtype != torch.float32:
        dense = dense.div_(collectives.world_size).to(value_dtype)
    return collectives.all_reduce(dense, "all-reduce of the dense tensors")


def dense_sum(world_size: int, pending: Pending | None) -> Tensor | None:
    """The fp32 sum over ranks of the tensors exchanged dense (in a decode callback, once done)."""
    if pending is None:
        return None
    if pending.output.dtype == torch.float32:
        return pending.output
    return pending.output.float().mul_(world_size)


def average(
    algorithm: SparseTopK[Any, Any, Any],
    plan: SparsePlan,
    flat: Tensor,
    dense: Tensor | None,
    indices: Tensor | None,
    values: Tensor | None,
    held: bool = False,
) -> Tensor:
    """The averaged update of the bucket from the exchanged parts (fp32); SGD momentum of dense tensors. ``held``:
    the periodic tensors were held back (``small_every``), their update is zero."""
    world = algorithm.state.world_size
    dense_index = plan.held_index if held else plan.dense_index
    if indices is None and dense is not None and dense_index is None:
        result = dense  # every tensor went dense, in bucket order: the all-reduced buffer is the result
    else:
        # The local gradient is no longer needed (the dense parts were copied for the wire, the
        # compressed ones live on in the memory): its buffer becomes the result.
        result = flat.zero_()
        if indices is not None and values is not None:
            result.index_add_(0, indices, values.float())
        if dense is not None:
            result.index_copy_(0, dense_index, dense)
    result.div_(world)
    if plan.dense_momentum_groups:  # momentum of dense tensors works on the average
        averages = result.split([e.numel for e in plan.entries])
        for (momentum, nesterov), members in plan.dense_momentum_groups:
            dense_momentum(
                algorithm,
                [plan.entries[i] for i in members],
                [averages[i] for i in members],
                momentum,
                nesterov,
            )
    return result


def dense_momentum(
    algorithm: SparseTopK[Any, Any, Any],
    entries: list[Entry],
    avg: list[Tensor],
    momentum: float,
    nesterov: bool,
) -> None:
    """SGD momentum on densely averaged tensors, in place: ``b' = m b + g``; ``d = b'`` (Nesterov ``g + m b'``).

    The inputs are identical on every rank, so the buffers stay identical too. The new buffers are
    staged like any other memory update, so a skipped step leaves them untouched. A tensor that continues
    an optimizer step an earlier backward pass exchanged (:meth:`~lightning_dgc.algorithms.context.ExchangeContext.continues`) gets ``b' = b + g``
    and ``d = g`` (Nesterov ``(1 + m) g``): added to the earlier passes' ``d``, one momentum per step.
    """
    memory = algorithm.state.memory
    continuing = [i for i, e in enumerate(entries) if algorithm.state.continues(e.name)]
    if continuing:
        if len(continuing) < len(entries):
            fresh = [i for i in range(len(entries)) if i not in continuing]
            dense_momentum(
                algorithm, [entries[i] for i in fresh], [avg[i] for i in fresh], momentum, nesterov
            )
        entries, avg = [entries[i] for i in continuing], [avg[i] for i in continuing]
    nxt = [memory.scratch("momentum", e.name) for e in entries]
    torch._foreach_copy_(nxt, avg)
    committed = [memory.committed["momentum"][e.name] for e in entries]
    torch._foreach_add_(nxt, committed, alpha=1.0 if continuing else momentum)
    if continuing:
        if nesterov:
            torch._foreach_mul_(avg, 1.0 + momentum)
    elif nesterov:
        torch._foreach_add_(avg, nxt, alpha=momentum)
    else:
        torch._foreach_copy_(avg, nxt)
    for e in entries:
        memory.stage("momentum", e.name)
