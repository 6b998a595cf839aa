"""DEFT (Yoon and Oh, ICPP 2023): partitioned top-k selection, with no gradient build-up.

Steps 2 and 5 as DGC (:mod:`lightning_dgc.algorithms.sparse`, the top-k base they share): error feedback, or DGC's momentum
correction with ``momentum_correction=True``; then, per bucket:

3. **norms**: the L2 norm of every fragment of the compensated gradient (a layer larger than 1/N of
   the bucket is cut into N pieces, :func:`lightning_dgc.algorithms.deft_partition.fragment_layers`);
4. **exchange**:
   a. the norms' squares are all-reduced, with every rank's previous selection time in the same small
      vector, so every rank holds identical norms and derives the same plan without a leader or a
      broadcast: k shared among fragments in proportion to their norms (total = what DGC sends),
      fragments packed onto ranks by LPT on their selection cost (``partition.selection_cost``),
      rotated by the step counter;
   b. each rank selects top-k only inside its own fragments, and writes its indices into the slot
      range each fragment owns in the union; one int32 all-reduce (sum) merges the disjoint
      selections (``wire="compact"``: every rank's sorted indices travel as 2-byte delta codes, one
      all-gather of a row per rank, and every rank decodes the same union);
   c. every rank all-reduces its own velocity at the union (and clears the union from its memory: its
      values there were sent); ``wire="compact"``: in fp16, divided by the number of ranks first. The
      volume is about k whatever the number of ranks.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_dgc.algorithms.base import Message, TensorSpec, WireCost, register
from lightning_dgc.algorithms.deft_config import DEFTConfig
from lightning_dgc.algorithms.deft_partition import (
    Fragment,
    allocate_k_list,
    fragment_count,
    fragment_layers,
    lpt_assign,
    repeated,
    selection_cost,
    shares,
    union_size,
)
from lightning_dgc.algorithms.sparse import Entry, SparsePlan, SparseTopK, SparseWork
from lightning_dgc.algorithms.sparse_decode import average, dense_sum, exchange_dense, release
from lightning_dgc.algorithms.topk_plan import split_layout
from lightning_dgc.tensor_ops import codec
from lightning_dgc.tensor_ops.selection.batched import concatenated_ranges, to_device, topk_in_ranges
from lightning_dgc.tensor_ops.selection.partitioned import deft_select, fragment_norms

if TYPE_CHECKING:
    from lightning_dgc.comm import Collectives, Pending

__all__ = ["DEFT", "DEFTConfig", "DEFTPlan", "DEFTWork"]

#: DEFT's norms (and selection times) travel as float64.
NORM_BYTES = 8
#: The compact wire's values travel as fp16.
COMPACT_VALUE_DTYPE = torch.float16


@dataclass
class DEFTPlan(SparsePlan):
    # The fragments of the compressed tensors (offsets into their concatenation) and, grouped by layer,
    # each layer's entry with its fragments rebased to the layer.
    fragments: list[Fragment] = field(default_factory=list)
    layers: list[tuple[Entry, list[tuple[int, Fragment]]]] = field(default_factory=list)
    control: Tensor | None = None  # fragment norms (squared) and every rank's selection time, float64
    union: Tensor | None = None  # the k selected indices of all ranks, int32, one slot range per fragment
    values: Tensor | None = None  # this rank's velocity at the union, in the value dtype (compact wire: fp16)
    code_rows: int | None = None  # compact wire: the largest rank's count this step (its code row's entries)
    fragment_shift: Tensor | None = None  # per fragment: bucket offset - offset in the compressed buffer
    bucket_fragments: list[Fragment] = field(default_factory=list)  # the fragments at their bucket offsets


@dataclass
class DEFTWork(SparseWork):
    summed: Pending | None = None


def _rebased(f: Fragment) -> Fragment:
    """The fragment with its offset inside its own layer (selection runs on the layer's buffer)."""
    return Fragment(f.name, f.layer_offset, f.numel, f.layer_offset)


@register
class DEFT(SparseTopK[DEFTConfig, DEFTPlan, DEFTWork]):
    """DEFT's partitioned selection through DGC's compensation and decode (see the module docstring)."""

    name = "deft"
    config_class = DEFTConfig
    work_class = DEFTWork
    velocity_per_tensor = False
    config: DEFTConfig

    @classmethod
    def selected_density(cls, config: DEFTConfig, world_size: int) -> float:
        if config.budget == "dgc_link":  # see DEFTConfig.budget
            value_bytes = config.value_dtype_torch.itemsize
            if config.wire == "compact":  # codes all-gathered, fp16 values all-reduced
                per_value = codec.CODE_BYTES + 2 * COMPACT_VALUE_DTYPE.itemsize
            else:  # int32 indices and the values, both all-reduced
                per_value = 2 * (codec.INDEX_BYTES + value_bytes)
            scale = world_size * (codec.CODE_BYTES + value_bytes) / per_value
            return min(1.0, config.density * max(1.0, scale))
        return config.density

    def payload_nbytes(self, k_total: int, numel: int) -> int:
        return 0  # no packed payload: indices and values are all-reduced on their own

    def plan(self, layout: list[TensorSpec], buffer: Tensor) -> DEFTPlan:
        base = super().plan(layout, buffer)
        plan = DEFTPlan(**{f: getattr(base, f) for f in SparsePlan.__dataclass_fields__})
        sparse = [e for e in plan.entries if e.kind == "sparse"]
        plan.fragments = fragment_layers(
            [e.name for e in sparse],
            [e.numel for e in sparse],
            self.state.world_size if self.config.fragmenting else 1,
        )
        plan.k_total = union_size(plan.k_total, len(plan.fragments))
        by_name = {e.name: e for e in sparse}
        for i, f in enumerate(plan.fragments):
            if not plan.layers or plan.layers[-1][0].name != f.name:
                plan.layers.append((by_name[f.name], []))
            plan.layers[-1][1].append((i, _rebased(f)))
        device = buffer.device
        flat_start, start = {}, 0
        for e in sparse:
            flat_start[e.name] = start
            start += e.numel
        shifts = [by_name[f.name].offset - flat_start[f.name] for f in plan.fragments]
        plan.fragment_shift = to_device(shifts, device)
        plan.bucket_fragments = [
            Fragment(f.name, f.offset + shift, f.numel, f.layer_offset)
            for f, shift in zip(plan.fragments, shifts, strict=True)
        ]
        plan.control = torch.zeros(
            len(plan.fragments) + self.state.world_size, dtype=torch.float64, device=device
        )
        plan.union = torch.zeros(plan.k_total, dtype=torch.int32, device=device)
        value_dtype = COMPACT_VALUE_DTYPE if self.config.wire == "compact" else self.config.value_dtype_torch
        plan.values = torch.zeros(plan.k_total, dtype=value_dtype, device=device)
        return plan

    def select(self, plan: DEFTPlan, work: DEFTWork) -> None:
        """Step 3: this rank's fragment norms (and its previous selection time) into the control vector.

        One segmented reduction over the bucket's compressed buffer (on the CPU, one BLAS dot product
        per fragment)."""
        assert plan.control is not None
        if self.config.k_allocation == "size":
            return  # k by size needs no norms (and no round to share them)
        plan.control.zero_()
        count = len(plan.fragments)
        if count:
            source, fragments = self._source(plan, work)
            backend = "torch" if self.batched(work.flat.device) else "auto"
            plan.control[:count] = fragment_norms(source, fragments, backend=backend).double().square()
        plan.control[count + self.state.rank] = self.state.last_selection_ms

    def exchange(self, plan: DEFTPlan, work: DEFTWork, collectives: Collectives) -> list[Pending]:
        assert plan.control is not None and plan.union is not None and plan.values is not None
        assert plan.fragment_shift is not None
        world = self.state.world_size
        count = len(plan.fragments)
        sizes = [f.numel for f in plan.fragments]
        if self.config.k_allocation == "norm":
            # 4a. identical norms on every rank, hence the identical plan (one small copy to the host)
            collectives.all_reduce(plan.control, "all-reduce of DEFT's fragment norms").wait()
            control = plan.control.tolist()
            work.stats["rank_selection_ms"] = control[count:]
            weights = [math.sqrt(c) if c > 0 else c for c in control[:count]]
        else:  # k by size: the same plan on every rank without a blocking round
            weights = [float(n) for n in sizes]
        work.selection_s = 0.0
        if plan.k_total:
            ks = allocate_k_list(weights, sizes, plan.k_total)
            slot_starts = [0]
            for k in ks:
                slot_starts.append(slot_starts[-1] + k)
            rotation = self.state.step if self.config.rotation else 0
            if self.config.selectors == "owner":
                owners = lpt_assign(selection_cost(sizes, ks), world, rotation=rotation)
                tasks = [(i, ks[i], slot_starts[i]) for i, o in enumerate(owners) if o == self.state.rank]
            else:  # every rank its share of every fragment's slots
                owners = [-1] * count
                tasks = shares(ks, slot_starts, world, self.state.rank, rotation)
            work.stats["plan"] = (ks, owners)
            # 4b. select in this rank's fragments (or shares); write bucket offsets into their union slots
            start = time.perf_counter()
            plan.union.zero_()
            tasks = [t for t in tasks if t[1] > 0]
            if tasks and self.batched(work.flat.device):
                self._select_batched(plan, work, tasks)
            elif tasks:
                self._select_each(plan, work, tasks)
            work.selection_s = time.perf_counter() - start
            work.stats["rank_selected"] = sum(t[1] for t in tasks)
            if self.config.wire == "compact":  # every rank's sorted indices as codes, decoded into the union
                tasks_of = [
                    [(i, ks[i], slot_starts[i]) for i, o in enumerate(owners) if o == r]
                    if self.config.selectors == "owner" else shares(ks, slot_starts, world, r, rotation)
                    for r in range(world)
                ]  # fmt: skip
                self._merge_codes(plan, work, collectives, tasks_of)
            else:  # the union of indices (disjoint slots: the sum is a merge)
                collectives.all_reduce(plan.union, "all-reduce of DEFT's selected indices").wait()
            if self.state.measures_buildup:
                work.stats["union_values"] = int(torch.unique(plan.union).numel())  # k: no build-up
            # 4c. this rank's values at the union, which it no longer holds back
            ks_device = to_device(ks, work.flat.device)
            slot_shift = torch.repeat_interleave(plan.fragment_shift, ks_device, output_size=plan.k_total)
            flat_positions = plan.union.long() - slot_shift
            if work.velocity is not None:
                values = work.velocity[flat_positions]
            else:  # v' lies in the bucket, at the union's (bucket) positions
                values = work.flat[plan.union.long()]
            sent = None  # which union slots this rank sends (None: all of them)
            if self.config.union_values == "owner":  # (an ablation) the other ranks send 0 and keep theirs
                sent = torch.repeat_interleave(
                    to_device([int(o == self.state.rank) for o in owners], work.flat.device), ks_device,
                    output_size=plan.k_total,
                ).bool()  # fmt: skip
                values.masked_fill_(~sent, 0.0)
            if self.config.selectors == "all":  # an index two ranks chose is sent once (decode adds slots)
                values.masked_fill_(repeated(plan.union), 0.0)
            values.add_(work.poison)
            if self.config.wire == "compact":  # fp16: the average overflows only where the mean would
                values.div_(world)
            plan.values.copy_(values)
            work.selected, work.selected_mask = flat_positions, sent  # cleared from the memory at commit
            work.summed = collectives.all_reduce(plan.values, "all-reduce of DEFT's values")
        work.dense = exchange_dense(work.dense_parts, self.config.value_dtype_torch, collectives, work.poison)
        release(work)
        return [p for p in (work.summed, work.dense) if p is not None]

    def _merge_codes(
        self,
        plan: DEFTPlan,
        work: DEFTWork,
        collectives: Collectives,
        tasks_of: list[list[tuple[int, int, int]]],
    ) -> None:
        """``wire="compact"``: the union from every rank's selections, all-gathered as delta codes.

        Every rank's ``(fragment, k, first union slot)`` tasks are known to all (the plan is shared), so
        every rank knows every count: each rank sends its own indices sorted (its fragments lie in bucket
        order, so they are each fragment's in turn), in a row of codes sized for the largest count, and
        every rank decodes every row into that rank's slots, the same union on every rank (a fragment's
        slots then hold its indices in ascending order)."""
        assert plan.union is not None
        device, span, world, rank = (
            work.flat.device,
            work.flat.numel(),
            self.state.world_size,
            self.state.rank,
        )
        tasks_of = [[t for t in tasks if t[1] > 0] for tasks in tasks_of]
        counts = [sum(t[1] for t in tasks) for tasks in tasks_of]
        width = plan.code_rows = max(counts)
        # each rank's row of `width`: its slots, then (its padding) distinct slots past the union's end
        starts, lengths = [], []
        for r, tasks in enumerate(tasks_of):
            starts += [t[2] for t in tasks] + [plan.k_total + r * width]
            lengths += [t[1] for t in tasks] + [width - counts[r]]
        wire_slots = concatenated_ranges(starts, lengths, device)
        own = torch.sort(plan.union[wire_slots[rank * width : rank * width + counts[rank]]].long()).values
        slots = codec.code_slots(width, span)
        codes = torch.empty(slots, dtype=torch.int16, device=device)
        codec.pack_codes(codes, own)
        gathered = torch.empty(world * slots * codec.CODE_BYTES, dtype=torch.uint8, device=device)
        collectives.all_gather(codes.view(torch.uint8), gathered, "all-gather of DEFT's index codes").wait()
        rows = gathered.view(torch.int16).view(world, slots)
        indices = codec.unpack_codes(rows, to_device(counts, device), width, span)
        union = torch.zeros(plan.k_total + world * width, dtype=torch.int32, device=device)
        union.index_copy_(0, wire_slots, indices.to(torch.int32))
        plan.union.copy_(union[: plan.k_total])

    def _select_each(self, plan: DEFTPlan, work: DEFTWork, tasks: list[tuple[int, int, int]]) -> None:
        """This rank's selections ``(fragment, k, first union slot)``, layer by layer (the CPU's numpy path)."""
        assert plan.union is not None
        rank = self.state.rank
        velocity = {e.name: v for e, v in work.sparse}
        by_fragment = {i: (k, slot) for i, k, slot in tasks}
        for entry, fs in plan.layers:
            mine = [(i, f) for i, f in fs if i in by_fragment]
            if not mine:
                continue
            ks = [by_fragment[i][0] for i, _ in mine]
            idx, _ = deft_select(
                velocity[entry.name], [f for _, f in mine], [rank] * len(mine), ks, rank, selector=self.choose
            )
            pos = 0
            for (i, _), k in zip(mine, ks, strict=True):
                slot = by_fragment[i][1]
                plan.union[slot : slot + k] = idx[pos : pos + k] + entry.offset
                pos += k

    def _select_batched(self, plan: DEFTPlan, work: DEFTWork, tasks: list[tuple[int, int, int]]) -> None:
        """This rank's selections at once: its fragments gathered into one buffer (a 1/N share of the
        bucket when owners select), a batched selection (:func:`~lightning_dgc.tensor_ops.selection.batched.batched_topk`),
        one write into the union."""
        assert plan.union is not None and plan.fragment_shift is not None
        device = work.flat.device
        mine, mine_ks, slots = zip(*tasks, strict=True)
        source, fragments = self._source(plan, work)
        chosen, layout = topk_in_ranges(
            source, [fragments[i].offset for i in mine], [fragments[i].numel for i in mine],
            list(mine_ks), self.config.sample_ratio, self.state.draw_generator(device),
        )  # fmt: skip
        positions = concatenated_ranges(list(slots), list(mine_ks), device)
        if work.velocity is not None:  # positions in the compressed buffer: to the bucket's
            chosen = chosen + plan.fragment_shift[to_device(list(mine), device)][layout.out_segment]
        plan.union[positions] = chosen.to(torch.int32)

    def _source(self, plan: DEFTPlan, work: DEFTWork) -> tuple[Tensor, list[Fragment]]:
        """Where v' lies: the compressed tensors' buffer and the fragments in it, or (error feedback made in
        place) the bucket and the fragments at their bucket offsets."""
        if work.velocity is not None:
            return work.velocity, plan.fragments
        return work.flat, plan.bucket_fragments

    def decode(self, plan: DEFTPlan, work: DEFTWork) -> Tensor:
        dense = dense_sum(self.state.world_size, work.dense)
        if work.summed is None:
            return average(self, plan, work.flat, dense, None, None)
        assert plan.union is not None
        values = work.summed.output
        if self.config.wire == "compact":  # sums of values divided by the ranks (fp16): back to fp32 sums
            values = values.float().mul_(self.state.world_size)
        return average(self, plan, work.flat, dense, plan.union, values)

    def decoded_finite(self, plan: DEFTPlan, work: DEFTWork) -> Tensor:
        sums = []
        dense = dense_sum(self.state.world_size, work.dense)
        if dense is not None:
            sums.append(dense.sum())
        if work.summed is not None:
            sums.append(work.summed.output.float().sum())
        return torch.isfinite(torch.stack(sums).sum()) if sums else torch.ones((), dtype=torch.bool)

    @classmethod
    def selection_share(cls, world_size: int) -> float:
        return 1.0 / world_size  # the fragments are shared among the ranks (balanced by LPT)

    def cost(self, plan: DEFTPlan) -> WireCost:
        """This step's wire cost: with ``wire="compact"`` the code rows as wide as this step's largest count."""
        return self._wire_cost(
            self.config, plan.layout, self.state.world_size, plan.dense_bytes, plan.code_rows
        )

    @classmethod
    def wire_cost(
        cls, config: DEFTConfig, layout: list[TensorSpec], world_size: int, dense_bytes: int
    ) -> WireCost:
        """The bytes per step; with ``wire="compact"``, for ranks that select equal counts (``ceil(union / N)``
        each: ``selectors="all"`` within one value per fragment; owners as LPT balances them, which
        :meth:`cost` reports step by step)."""
        return cls._wire_cost(config, layout, world_size, dense_bytes)

    @classmethod
    def _wire_cost(
        cls, config: DEFTConfig, layout: list[TensorSpec], world_size: int, dense_bytes: int,
        code_rows: int | None = None,
    ) -> WireCost:  # fmt: skip
        value_bytes = config.value_dtype_torch.itemsize
        numel = sum(s.numel for s in layout)
        sparse_numels, k_total, dense_numel = split_layout(
            config, layout, cls.selected_density(config, world_size)
        )
        fragments = fragment_count(sparse_numels, world_size if config.fragmenting else 1)
        k_total = union_size(k_total, fragments)
        messages = []
        if config.k_allocation == "norm":  # (k by size needs no norms)
            messages.append(
                Message("all_reduce", NORM_BYTES * (fragments + world_size), "control", blocking=True)
            )
        if k_total and config.wire == "compact":
            rows = code_rows if code_rows is not None else -(-k_total // world_size)
            codes = codec.code_slots(rows, numel) * codec.CODE_BYTES
            messages.append(Message("all_gather", codes, "payload", blocking=True))
            messages.append(Message("all_reduce", k_total * COMPACT_VALUE_DTYPE.itemsize, "payload"))
        elif k_total:
            messages.append(Message("all_reduce", k_total * codec.INDEX_BYTES, "payload", blocking=True))
            messages.append(Message("all_reduce", k_total * value_bytes, "payload"))
        if dense_numel:
            messages.append(Message("all_reduce", dense_numel * value_bytes, "dense"))
        return WireCost(tuple(messages), dense_bytes, numel, k_total, k_total + dense_numel)
