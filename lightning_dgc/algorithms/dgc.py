"""DGC: Deep Gradient Compression (Lin, Han et al., ICLR 2018), one DDP bucket at a time.

Steps 2, 5 and 6 (momentum correction, the average, the commit) and the plan's three kinds of tensor
(``sparse``, ``full``, ``dense``) are the top-k base's (:mod:`lightning_dgc.algorithms.sparse`); DGC's own:

3. **select** exactly ``k = ceil(density * numel)`` values of every compressed tensor from ``v'``
   (sampled threshold or exact top-k) and pack them into the bucket's fixed-size payload
   (:mod:`lightning_dgc.tensor_ops.codec`); what is sent is cleared from ``v`` (and, with momentum factor masking,
   from ``u``) at commit;
4. **exchange**: one all-gather of the payloads; one all-reduce of the tensors averaged dense;
5. **decode**: scatter-add every rank's values, divide by the world size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import Tensor

from lightning_dgc.algorithms.base import (
    Message,
    TensorSpec,
    WireCost,
    register,
)
from lightning_dgc.algorithms.dgc_config import DGCConfig
from lightning_dgc.algorithms.sparse import Entry, SparsePlan, SparseTopK, SparseWork
from lightning_dgc.algorithms.sparse_decode import average, dense_sum, exchange_dense, release
from lightning_dgc.algorithms.topk_plan import holds_back, periodic, small_every, split_layout
from lightning_dgc.tensor_ops import codec
from lightning_dgc.tensor_ops.heap import trim_before
from lightning_dgc.tensor_ops.momentum import compensated_velocity_each
from lightning_dgc.tensor_ops.selection.batched import batched_topk, segment_layout, to_device
from lightning_dgc.tensor_ops.selection.sampled import DIRECT_NUMEL, sampled_topk_of
from lightning_dgc.tensor_ops.selection.static import StaticSelection

if TYPE_CHECKING:
    from lightning_dgc.comm import Collectives, Pending

#: DGC's plan and work are the shared top-k base's.
DGCPlan = SparsePlan
DGCWork = SparseWork


@register
class DGC(SparseTopK[DGCConfig, DGCPlan, DGCWork]):
    """Deep Gradient Compression: every rank selects its own top-k, one all-gather (see the module doc)."""

    name = "dgc"
    config_class = DGCConfig
    work_class: type[DGCWork] = DGCWork
    velocity_per_tensor: ClassVar[bool] = True  # (see SparseTopK)

    # -- step 3 ----------------------------------------------------------------------------------------------
    def velocity_of(self, entries: list[Entry], work: DGCWork) -> Tensor:
        """The v' of consecutive compressed tensors (one, or a group of the batched selection), one new float32
        buffer, as ``compensate`` makes it for a whole bucket (the same elementwise operations: bit for bit)."""
        committed, numel = self.state.memory.committed, sum(e.numel for e in entries)
        if work.flat.is_cpu:
            trim_before(numel * 4)  # the heap's free pages go back first
        out = torch.empty(numel, dtype=torch.float32, device=work.flat.device)
        by_settings: dict[tuple[float, bool, bool], list[tuple[Entry, Tensor]]] = {}
        for e, view in zip(entries, out.split([e.numel for e in entries]), strict=True):
            settings = self.state.settings_for(e.name)
            key = (settings.momentum, settings.nesterov, self.state.continues(e.name))
            by_settings.setdefault(key, []).append((e, view))
        for (momentum, nesterov, continuing), items in by_settings.items():
            compensated_velocity_each(
                [work.flat[e.offset : e.offset + e.numel] for e, _ in items],
                [committed["velocity"][e.name] for e, _ in items],
                [view for _, view in items],
                momentum,
                nesterov,
                [committed["momentum"][e.name] for e, _ in items] if momentum else [],
                continuing,
            )
        return out

    def _selects_in_chunks(self, e: Entry, work: DGCWork) -> bool:
        """Whether the compressed tensor ``e``'s v' is selected from chunk by chunk, never made whole: DGC's
        sampled selection on the CPU (numpy) of a tensor above ``DIRECT_NUMEL`` values."""
        return (
            self.config.selection == "sampled"
            and self.config.selection_backend != "torch"
            and e.numel > DIRECT_NUMEL
            and work.flat.is_cpu
            and work.flat.dtype == torch.float32
        )

    def _select_in_chunks(self, e: Entry, work: DGCWork) -> tuple[Tensor, Tensor]:
        """The indices ``choose`` gives on :meth:`velocity_of` and the values there, bit for bit, without the
        tensor-sized v': each chunk of v' (and v' at the sample, candidate and selected positions) is made from
        ``g``, ``u`` and ``v`` with the same elementwise operations (:func:`sampled_topk_of`)."""
        settings, committed = self.state.settings_for(e.name), self.state.memory.committed
        grad = work.flat[e.offset : e.offset + e.numel]
        velocity = committed["velocity"][e.name]
        momentum = committed["momentum"][e.name] if settings.momentum else None
        continuing = self.state.continues(e.name)

        def fill(start: int, stop: int, out: Tensor) -> None:
            u = [momentum[start:stop]] if momentum is not None else []
            compensated_velocity_each(
                [grad[start:stop]],
                [velocity[start:stop]],
                [out],
                settings.momentum,
                settings.nesterov,
                u,
                continuing,
            )

        def take(positions: Tensor) -> Tensor:
            out = torch.empty(positions.numel(), dtype=grad.dtype)
            u = [momentum.index_select(0, positions)] if momentum is not None else []
            compensated_velocity_each(
                [grad.index_select(0, positions)], [velocity.index_select(0, positions)], [out],
                settings.momentum, settings.nesterov, u, continuing,
            )  # fmt: skip
            return out

        idx = sampled_topk_of(
            e.numel, grad.dtype, e.k, fill, take, self.config.sample_ratio, self.state.generator,
            whole=lambda: self.velocity_of([e], work),
        )  # fmt: skip
        return idx, take(idx)

    def compiles_selection(self, device: torch.device) -> bool:
        """Whether the batched selection runs compiled (``DGCConfig.compile_selection``: ``"auto"`` on CUDA)."""
        setting = self.config.compile_selection
        return self.config.selection == "sampled" and (setting is True or (setting == "auto" and device.type == "cuda"))

    def select(self, plan: DGCPlan, work: DGCWork) -> None:
        """Top-k per compressed tensor into the payload (what is sent is cleared from the memory at commit)."""
        if not plan.k_total:
            return
        if self.batched(work.flat.device):
            indices, values = self._select_batched(plan, work)
        else:
            indices, values = self._select_each(plan, work)
        flat, order = indices.sort()  # the wire format wants ascending indices
        values = values[order].add_(work.poison)  # NaN on every rank when this rank's gradient is not finite
        value_dtype = self.config.value_dtype_torch
        codec.pack_into(plan.payload, flat, values, value_dtype, work.flat.numel(),
                        check=not self.batched(work.flat.device))  # fmt: skip
        if value_dtype == torch.int8:  # what rounding took off each value stays in the velocity (at commit)
            work.unsent = torch.empty_like(values).index_copy_(
                0, order, values - codec.payload_values(plan.payload, plan.k_total, value_dtype)
            )
        work.stats["rank_selected"] = plan.k_total

    def _select_each(self, plan: DGCPlan, work: DGCWork) -> tuple[Tensor, Tensor]:
        """Tensor by tensor (the CPU's numpy path): bucket positions and values, cleared from memory."""
        indices, values, positions, start = [], [], [], 0
        for e, velocity in work.sparse:
            if velocity is None and self._selects_in_chunks(e, work):  # v' never made whole
                idx, selected = self._select_in_chunks(e, work)
            else:
                if velocity is None:  # made now, freed after this tensor (see ``compensate``)
                    velocity = self.velocity_of([e], work)
                idx = self.choose(velocity, e.k)
                selected = velocity.index_select(0, idx)
            indices.append(idx + e.offset)
            positions.append(idx + start)
            values.append(selected)
            start += e.numel
            velocity = idx = selected = None  # a v' made here is freed now, not after the concatenation
        work.selected = torch.cat(positions)  # cleared from the memory at commit
        return torch.cat(indices), torch.cat(values)

    def _select_batched(self, plan: DGCPlan, work: DGCWork) -> tuple[Tensor, Tensor]:
        """All compressed tensors at once (:func:`~lightning_dgc.tensor_ops.selection.batched.batched_topk`), or, for a
        bucket selected in groups, group by group with each group's v' made just before its selection."""
        device = work.flat.device
        if plan.segments is None:
            sparse = [e for e in plan.entries if e.kind == "sparse"]
            plan.segments = segment_layout(
                [e.numel for e in sparse], [e.k for e in sparse], self.config.sample_ratio, device
            )
            shifts, start = [], 0
            for e in sparse:
                shifts.append(e.offset - start)
                start += e.numel
            plan.out_shift = to_device(shifts, device)[plan.segments.out_segment]
        generator = self.state.draw_generator(device)
        static = None
        if plan.steps >= 2 and self.compiles_selection(device):  # (DDP rebuilds its buckets after step 1)
            if plan.static is None:
                plan.static = StaticSelection(plan.segments, self.config.sample_ratio, compiled=True)
            static = plan.static
        if work.velocity is not None:
            idx = static(work.velocity, generator) if static else batched_topk(work.velocity, plan.segments, generator)
            values = work.velocity[idx]
        else:  # ``compensate`` left v' to the selection: the draws and the result are the whole bucket's
            layout, parts, taken = plan.segments, [], []
            for j, (a, b, group) in enumerate(layout.groups or ((0, len(layout.sizes), layout),)):
                velocity = self.velocity_of([e for e, _ in work.sparse[a:b]], work)
                chosen = static.select_group(j, velocity, generator) if static else batched_topk(velocity, group, generator)
                taken.append(velocity[chosen])
                parts.append(chosen.add_(layout.starts[a]))
                velocity = chosen = None  # one group's v' at a time
            idx, values = torch.cat(parts), torch.cat(taken)
        work.selected = idx  # cleared from the memory at commit
        return idx + plan.out_shift, values

    # -- step 4 ----------------------------------------------------------------------------------------------
    def exchange(self, plan: DGCPlan, work: DGCWork, collectives: Collectives) -> list[Pending]:
        if plan.k_total:
            work.gathered = collectives.all_gather(
                plan.payload, plan.gathered, "all-gather of the sparse payload"
            )
        work.dense = exchange_dense(work.dense_parts, self.config.dense_dtype_torch, collectives, work.poison)
        release(work)
        return [p for p in (work.gathered, work.dense) if p is not None]

    # -- step 5 ----------------------------------------------------------------------------------------------
    def decode(self, plan: DGCPlan, work: DGCWork) -> Tensor:
        dense = dense_sum(self.state.world_size, work.dense)
        indices = values = None
        if work.gathered is not None:
            indices, values = self._unpacked(plan, work)
            if self.state.measures_buildup:  # a host sync: only when something asks for it
                self.state.add_union_values(int(torch.unique(indices).numel()))  # gradient build-up
        return average(self, plan, work.flat, dense, indices, values, held=work.held)

    def _unpacked(self, plan: DGCPlan, work: DGCWork) -> tuple[Tensor, Tensor]:
        """Every rank's indices and values (unpacked again where needed: the callback's tensors stay on its
        stream, so ``finish_step()`` reads only what the collectives wrote)."""
        assert work.gathered is not None
        gathered = work.gathered.output.view(self.state.world_size, -1)
        return codec.unpack(gathered, plan.k_total, self.config.value_dtype_torch, work.flat.numel())

    def decoded_finite(self, plan: DGCPlan, work: DGCWork) -> Tensor:
        """Whether what every rank sent is finite (0-d bool, the same on every rank), before decoding it."""
        sums = []
        dense = dense_sum(self.state.world_size, work.dense)
        if dense is not None:
            sums.append(dense.sum())
        if work.gathered is not None:
            gathered = work.gathered.output.view(self.state.world_size, -1)
            values = codec.gathered_values(
                gathered, plan.k_total, self.config.value_dtype_torch
            )  # no index decode
            sums.append(values.float().sum())
        return torch.isfinite(torch.stack(sums).sum()) if sums else torch.ones((), dtype=torch.bool)

    # -- the cost ----------------------------------------------------------------------------------------------
    @classmethod
    def selection_share(cls, world_size: int) -> float:
        return 1.0  # every rank selects over the whole gradient

    @classmethod
    def wire_cost(
        cls, config: DGCConfig, layout: list[TensorSpec], world_size: int, dense_bytes: int
    ) -> WireCost:
        """A step's messages; with ``small_every``, the mean step's: the small tensors sent whole every that many
        steps count for their values over it (rounded up) in the dense all-reduce."""
        numel = sum(s.numel for s in layout)
        _, k_total, dense_numel = split_layout(config, layout, cls.selected_density(config, world_size))
        flags = [periodic(s.numel, s.ndim, config) for s in layout]
        if holds_back(flags):
            whole = sum(s.numel for s, flag in zip(layout, flags, strict=True) if flag)
            dense_numel -= whole - -(-whole // small_every(config))
        return cls._messages(config, numel, k_total, dense_numel, dense_bytes)

    def cost(self, plan: DGCPlan) -> WireCost:
        """This step's messages for ``plan``: without the periodic tensors in a step that holds them back."""
        held = sum(e.numel for e in plan.entries if e.periodic) if self.holding(plan) else 0
        numel = sum(s.numel for s in plan.layout)
        return self._messages(self.config, numel, plan.k_total, plan.dense_numel - held, plan.dense_bytes)

    @staticmethod
    def _messages(config: DGCConfig, numel: int, k_total: int, dense_numel: int, dense_bytes: int) -> WireCost:
        """The all-gather of ``k_total`` values' payload and the all-reduce of ``dense_numel`` values."""
        value_bytes = config.value_dtype_torch.itemsize
        payload, padding = codec.payload_size(k_total, value_bytes, numel)
        messages = []
        if payload:
            messages.append(Message("all_gather", payload, "payload"))
        if dense_numel:
            messages.append(Message("all_reduce", dense_numel * config.dense_dtype_torch.itemsize, "dense"))
        return WireCost(tuple(messages), dense_bytes, numel, k_total, k_total + dense_numel, padding)
