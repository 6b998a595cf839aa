"""The exchange of a sharded model (FSDP2 inside the node, the algorithm across nodes): one FSDP parameter group's
gradient shard at a time.

FSDP2 (``torch.distributed.fsdp.fully_shard``) on the ranks of one node reduce-scatters each parameter group's
gradients inside the node and hands this rank's flat shard of the node's mean gradient to the group's
all-reduce hook (``FSDPModule.set_all_reduce_hook``). :func:`exchange_shard` runs there, in place of HSDP's dense
all-reduce across nodes, the hook's steps on that shard:

0. **plan**: the algorithm's plan of the group's tensors as this rank holds them (:class:`GroupShard`: each
   parameter's local row block, FSDP2 shards on dim 0), once per layout and density.
1. **local gradient**: the node's mean gradient of this rank's shard, fp32, the loss scale divided out (FSDP pads
   each parameter's rows to a multiple of the node's ranks: the padding is left out).
2-4. **compensate, select, exchange** (:func:`~lightning_dgc.exchange.hook.compensate_select_exchange`) across the
   nodes: ``state.collectives`` are those of the ranks that hold the same shard, one per node; the memory is this
   shard's, so a rank keeps ``1/G`` of a flat run's (``G`` ranks per node).
5. **decode** once the collectives are done (the hook waits for them: FSDP reads the shard right after the hook
   returns), written back into FSDP's shard in its dtype, the loss scale multiplied back; FSDP then makes it the
   sharded parameters' ``.grad``.
6. **memory**: what steps 2-5 staged commits with the step (``state.finish_step()``, after the backward pass), or
   is discarded on every rank if any rank's gradient was not finite.

Pure of FSDP: the layout is given (:mod:`lightning_dgc.front.sharding` reads it off the FSDP modules).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from lightning_dgc.algorithms import TensorSpec
from lightning_dgc.exchange.hook import _in_bucket_units, compensate_select_exchange
from lightning_dgc.exchange.state import ExchangeState

__all__ = ["GroupShard", "exchange_shard"]


@dataclass(frozen=True)
class GroupShard:
    """This rank's shard of one FSDP parameter group, as FSDP lays it out in the reduce-scatter's output.

    ``names``: the group's parameters that take gradients, in FSDP's order; ``shapes``: each one's local shard
    (its row block: ``ceil(rows / G)`` rows, fewer or none on the last ranks); ``slots``: the values each takes in
    the flat shard (``ceil(rows / G)`` rows of the padded parameter), one after the other.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    slots: tuple[int, ...]

    @cached_property
    def numels(self) -> tuple[int, ...]:
        out = []
        for shape in self.shapes:
            numel = 1
            for size in shape:
                numel *= size
            out.append(numel)
        return tuple(out)

    @property
    def numel(self) -> int:
        """Values of the flat shard, padding included (what FSDP hands the hook)."""
        return sum(self.slots)

    @cached_property
    def padded(self) -> bool:
        """Whether the flat shard holds padding (some parameter's rows do not divide among the node's ranks)."""
        return self.numels != self.slots

    @cached_property
    def layout(self) -> list[TensorSpec]:
        """The tensors the algorithm exchanges: the local shards that hold values, one after the other."""
        specs, offset = [], 0
        for name, shape, numel in zip(self.names, self.shapes, self.numels, strict=True):
            if numel:
                specs.append(TensorSpec(name, shape, offset, numel))
                offset += numel
        return specs

    @cached_property
    def pieces(self) -> list[tuple[int, int]]:
        """``(start, numel)`` in the flat shard of each tensor of :attr:`layout`."""
        out, start = [], 0
        for numel, slot in zip(self.numels, self.slots, strict=True):
            if numel:
                out.append((start, numel))
            start += slot
        return out

    def compact(self, shard: Tensor) -> Tensor:
        """The values of ``shard`` (the flat shard FSDP hands the hook) without padding, fp32 (``shard`` itself
        when it is fp32 and holds no padding)."""
        if not self.padded:
            return shard if shard.dtype == torch.float32 else shard.float()
        return torch.cat([shard[start : start + numel] for start, numel in self.pieces]).float()

    def write(self, update: Tensor, shard: Tensor) -> None:
        """The compact ``update`` back into ``shard``, in its dtype (its padding left as it is)."""
        if update is shard:
            return
        if not self.padded:
            shard.copy_(update)
            return
        offset = 0
        for start, numel in self.pieces:
            shard[start : start + numel].copy_(update[offset : offset + numel])
            offset += numel


def exchange_shard(state: ExchangeState, group: GroupShard, shard: Tensor, aliased: bool = False) -> None:
    """Replace ``shard`` (this rank's flat shard of a group's node-mean gradient, FSDP's reduce-scatter output) in
    place by the average across the nodes that ``state``'s algorithm gives (see the module docstring).

    ``aliased``: the sharded parameters' ``.grad`` will be views of ``shard`` (no gradient was there before, and
    FSDP keeps the reduce dtype). An fp32 shard without padding then waits for ``state.finish_step()`` to be decoded,
    as a DDP bucket does (:class:`~lightning_dgc.exchange.hook.DeferredDecode`): until then ``.grad`` holds this
    rank's (compensated) gradient, which the memory's commit reads where it is, with no copy of its own (one shard
    less at the peak). Otherwise the decode runs here and the commit keeps a copy of the local gradient.

    Raises a ``RuntimeError`` that says why when ``shard`` is not laid out as ``group`` (a parameter of the group
    got no gradient in this backward pass); a failed collective raises its
    :class:`~lightning_dgc.comm.CollectiveError`, which FSDP raises from ``backward()``.
    """
    if shard.numel() != group.numel:
        raise RuntimeError(
            f"the sharded exchange expected {group.numel} gradient values for the FSDP group of"
            f" {', '.join(group.names[:4])}{' ...' if len(group.names) > 4 else ''}, FSDP handed it {shard.numel()}:"
            " some of the group's parameters got no gradient in this backward pass. The sharded strategies need a"
            " gradient for every trainable parameter of a group in every step (FSDP2 across nodes needs the same"
            " on every rank): freeze parameters the loss does not use (`requires_grad_(False)`) before"
            " `fully_shard`, or put them in an FSDP group of their own that every step uses."
        )
    algorithm, scale = state.algorithm, state.grad_scale
    # Step 0: the plan of this group's shard.
    plan = state.plan_layout((("fsdp", group), algorithm.plan_key()), group.layout, shard)

    # Step 1: the local gradient, fp32, without padding and without the loss scale.
    flat = group.compact(shard)
    if scale != 1.0:
        flat = flat.mul_(1.0 / scale) if flat is not shard else flat.mul(1.0 / scale)
    state.finish_writes_grads = aliased and flat is shard  # the decode may wait (read by the algorithm)

    # Steps 2-4: compensate, select, exchange across the nodes.
    work, pending, selection_s = compensate_select_exchange(state, plan, flat)

    # Step 5: decode once the collectives are done, into FSDP's shard; or, if the algorithm can tell finiteness
    # first, leave the local gradient there and decode after the memory's commit (step 6).
    for collective in pending:
        collective.wait()
    finite = algorithm.decoded_finite(plan, work) if state.finish_writes_grads else None
    deliver = None
    if finite is not None:
        state.memory.note_finite(finite)

        def deliver(_: bool) -> None:
            update = algorithm.decode(plan, work)
            if update is not shard:
                shard.copy_(update)
    else:
        update = algorithm.decode(plan, work)
        state.memory.note_finite(torch.isfinite(update.sum()))
        group.write(_in_bucket_units(update, shard, scale), shard)

    # Step 6: the statistics; the memory staged in steps 2-5 commits with the step (state.finish_step()), then a
    # deferred decode writes the averaged update into the shard (the parameters' .grad).
    state.record(algorithm.cost(plan), work, selection_s, [], lambda: shard, shard.device, keep=work.keep,
                 deliver=deliver)  # fmt: skip
