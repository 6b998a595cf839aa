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

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
from torch import Tensor

from lightning_dgc.algorithms.base import (
    AlgorithmConfig,
    Message,
    TensorSpec,
    WireCost,
    register,
)
from lightning_dgc.algorithms.checks import check_density, flag, real_number, whole_number
from lightning_dgc.algorithms.sparse import Entry, SparsePlan, SparseTopK, SparseWork, split_layout
from lightning_dgc.algorithms.sparse_decode import average, dense_sum, exchange_dense, release
from lightning_dgc.tensor_ops import codec
from lightning_dgc.tensor_ops.codec import VALUE_DTYPES
from lightning_dgc.tensor_ops.heap import trim_before
from lightning_dgc.tensor_ops.momentum import compensated_velocity_each
from lightning_dgc.tensor_ops.selection.batched import batched_topk, segment_layout, to_device
from lightning_dgc.tensor_ops.selection.sampled import DIRECT_NUMEL, sampled_topk_of
from lightning_dgc.tensor_ops.selection.static import StaticSelection

if TYPE_CHECKING:
    from lightning_dgc.comm import Collectives, Pending

Selection = Literal["sampled", "exact"]
SelectionBackend = Literal["auto", "torch", "numpy"]
ValueDType = Literal["fp32", "fp16", "int8"]


@dataclass
class DGCConfig(AlgorithmConfig):
    """Hyper-parameters of DGC, identical on every rank (checked at setup).

    Selection:
        density: fraction of each compressed tensor's values sent per step, in (0, 1], or ``"auto"``: picked
            from the link the run measures (:mod:`lightning_dgc.schedules.auto_density`), never below ``min_density``.
        min_density: with ``density="auto"``, the lowest density it may pick, in (0, 1].
        auto_every: with ``density="auto"``, measure the link again (a few dense steps) every this many
            optimizer steps; 0: once, at the start of each ``fit``.
        sample_ratio: fraction of a tensor sampled to estimate the top-k threshold, in (0, 1].
        selection: ``"sampled"`` (DGC's threshold sampling, exact k guaranteed) or ``"exact"``.
        selection_backend: how the sampled selection runs. ``"torch"``: the bucket's compressed tensors
            together, a fixed number of kernels and one host synchronisation per bucket
            (:mod:`lightning_dgc.tensor_ops.selection.batched`), with sample positions drawn on the tensors'
            device, seeded identically on every rank; ``"numpy"``: tensor by tensor on zero-copy numpy
            views (CPU only); ``"auto"`` (default): numpy for CPU float32 buckets, torch elsewhere.
        compile_selection: whether the batched selection runs as one compiled program per bucket
            (``torch.compile`` of its shape-static form, :mod:`lightning_dgc.tensor_ops.selection.static`: no
            host synchronisation), from a bucket layout's second step on (the first runs eagerly: DDP rebuilds
            its buckets after it). ``"auto"`` (default): on CUDA buckets only; ``True``: everywhere (on the CPU
            it also makes the selection batched, ``selection_backend="auto"`` or ``"torch"``); ``False``: never.
            The first compiled step of each bucket layout pays the compilation (seconds to a minute).
        min_compress_numel: tensors with fewer values, and every 1-D tensor (biases, norms) unless
            ``compress_vectors``, are averaged dense: compressing them saves little on a large model.
        compress_vectors: compress the 1-D tensors too (biases, norm scales and shifts), each with its own
            residual, as every other tensor; with ``min_compress_numel=1`` nothing is averaged dense. On a small
            model (ResNet-20: 2.5 k of its 270 k values) those tensors are most of what a step at density 0.001
            sends.
        small_density: compress the tensors that ``min_compress_numel`` and ``compress_vectors`` leave dense
            (1-D, small) at this density instead, each with its own residual, never below ``density``.
            ``None`` (default): they are averaged dense. At ``density`` itself (``compress_vectors``,
            ``min_compress_numel=1``) a 16-value norm scale or a 640-weight classifier sends one value a step
            (k is at least 1); at 1/8 each sends an eighth of its values a step, for a fraction of the bytes of
            averaging them dense (what it costs and keeps: docs/algorithms/dgc.md). DGC only.
    Momentum correction:
        momentum_correction: ``True`` (the paper's): SGD's momentum, Nesterov and weight decay are taken
            over and applied to the local gradient before selection (``u <- m u + g``, ``v <- v + u``).
            ``False``: plain error feedback in the exchange (``v <- v + g``), the optimizer's own momentum
            and weight decay applied to the averaged sparse update, every step and dense (the "top-k with
            error feedback" of the literature; any optimizer works). ``momentum`` needs ``True``.
        momentum, nesterov: the local momentum ``m`` for parameters whose optimizer has none to take over;
            0 gives plain error feedback.
        momentum_masking: clear sent coordinates from the momentum too (the paper's default; tensors
            sent whole are never masked, see the module docstring).
        weight_decay: added to the local gradient before momentum correction.
    Clipping:
        local_clip_norm: the paper's local gradient clipping; each tensor's gradient is clipped to
            ``local_clip_norm / sqrt(world_size)`` before accumulation. ``None`` disables it.
    Wire:
        value_dtype: ``"fp32"`` or ``"fp16"``: the dtype of every value on the wire, the payload's and the
            tensors averaged dense alike (those in fp16 are pre-divided by the world size, as in
            torch's ``fp16_compress_hook``). ``"int8"``: the payload's values as int8, each 32 with one
            fp32 scale, the rounding error kept in the error feedback (3.125 bytes a value with its
            index, not 6); the tensors averaged dense travel in fp16. DGC only.
        seed: seeds the per-rank sampling generator.
    """

    density: float | Literal["auto"] = 0.001
    sample_ratio: float = 0.01
    selection: Selection = "sampled"
    selection_backend: SelectionBackend = "auto"
    compile_selection: bool | Literal["auto"] = "auto"
    min_compress_numel: int = 1024
    compress_vectors: bool = False
    small_density: float | None = None
    momentum_correction: bool = True
    momentum: float = 0.0
    nesterov: bool = False
    momentum_masking: bool = True
    weight_decay: float = 0.0
    local_clip_norm: float | None = None
    value_dtype: ValueDType = "fp32"
    seed: int = 0
    min_density: float = 0.001
    auto_every: int = 1000

    def validate(self) -> None:
        """Raise a ``ValueError`` that says how to fix the first invalid setting.

        Numbers of any real type are accepted (``numpy.float32(0.1)``, ``fractions.Fraction``) and
        stored as plain ``float``/``int``, so that the config stays JSON- and checkpoint-friendly.
        """
        if isinstance(self.density, str):
            if self.density != "auto":
                raise ValueError(
                    f"`density` must be a number in (0, 1] or 'auto' (picked from the measured link), got"
                    f" {self.density!r}."
                )
        else:
            self.density = check_density(self.density)
        self.min_density = check_density(self.min_density, "min_density")
        self.auto_every = whole_number(self.auto_every, "auto_every")
        if self.auto_every < 0:
            raise ValueError(
                f"`auto_every` must be >= 0 (optimizer steps between two measurements of the link; 0: once),"
                f" got {self.auto_every!r}."
            )
        self.sample_ratio = real_number(self.sample_ratio, "sample_ratio")
        if not 0.0 < self.sample_ratio <= 1.0:
            raise ValueError(
                f"`sample_ratio` is the fraction of each tensor sampled to find the top-k threshold and must lie"
                f" in (0, 1], got {self.sample_ratio!r}. The paper samples 0.1% to 1% (0.001 to 0.01)."
            )
        if self.selection not in ("sampled", "exact"):
            raise ValueError(f"`selection` must be 'sampled' or 'exact', got {self.selection!r}.")
        if self.selection_backend not in ("auto", "torch", "numpy"):
            raise ValueError(
                f"`selection_backend` must be 'auto', 'torch' or 'numpy', got {self.selection_backend!r}."
            )
        if isinstance(self.compile_selection, str) and self.compile_selection != "auto":
            raise ValueError(
                f"`compile_selection` must be 'auto' (compiled on CUDA), True or False, got {self.compile_selection!r}."
            )
        if self.compile_selection != "auto":
            self.compile_selection = flag(self.compile_selection, "compile_selection")
        if self.compile_selection is True and (self.selection != "sampled" or self.selection_backend == "numpy"):
            raise ValueError(
                "`compile_selection=True` compiles the batched sampled selection; it needs `selection='sampled'` and"
                f" `selection_backend='auto'` or 'torch' (got {self.selection!r}, {self.selection_backend!r}), or"
                " pass `compile_selection='auto'` (compiled on CUDA only) or False."
            )
        if self.value_dtype not in VALUE_DTYPES:
            raise ValueError(
                f"`value_dtype` must be one of {sorted(VALUE_DTYPES)}, got {self.value_dtype!r}."
            )
        self.momentum = real_number(self.momentum, "momentum")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"`momentum` must lie in [0, 1), got {self.momentum!r}.")
        self.nesterov = flag(self.nesterov, "nesterov")
        self.momentum_correction = flag(self.momentum_correction, "momentum_correction")
        self.momentum_masking = flag(self.momentum_masking, "momentum_masking")
        if self.nesterov and self.momentum == 0.0:
            raise ValueError("`nesterov=True` needs a momentum > 0.")
        self.weight_decay = real_number(self.weight_decay, "weight_decay")
        if not self.weight_decay >= 0.0:
            raise ValueError(f"`weight_decay` must be >= 0, got {self.weight_decay!r}.")
        if self.momentum and not self.momentum_correction:
            raise ValueError(
                f"`momentum={self.momentum!r}` is applied in the exchange only with `momentum_correction=True`;"
                " leave momentum to the optimizer (SGD(momentum=...)), or pass `momentum_correction=True`."
            )
        if self.local_clip_norm is not None:
            self.local_clip_norm = real_number(self.local_clip_norm, "local_clip_norm")
            if not self.local_clip_norm > 0.0:
                raise ValueError(
                    f"`local_clip_norm` must be > 0 or None (off), got {self.local_clip_norm!r}."
                )
        self.compress_vectors = flag(self.compress_vectors, "compress_vectors")
        self.min_compress_numel = whole_number(self.min_compress_numel, "min_compress_numel")
        if self.min_compress_numel < 1:
            raise ValueError(f"`min_compress_numel` must be >= 1, got {self.min_compress_numel!r}.")
        if self.small_density is not None:
            self.small_density = check_density(self.small_density, "small_density")
            if self.compress_vectors and self.min_compress_numel == 1:
                raise ValueError(
                    f"`small_density={self.small_density!r}` sets the density of the tensors `min_compress_numel`"
                    " and `compress_vectors` leave dense, and with `compress_vectors=True` and"
                    " `min_compress_numel=1` there are none: leave those two at their defaults (1-D tensors and"
                    " those under 1,024 values are the small ones), or drop `small_density`."
                )
        self.seed = whole_number(self.seed, "seed")

    def small(self, numel: int, ndim: int) -> bool:
        """Whether a tensor of this size and rank is one of the small ones (1-D unless ``compress_vectors``, or
        under ``min_compress_numel`` values): averaged dense, or compressed at ``small_density``."""
        return (ndim <= 1 and not self.compress_vectors) or numel < self.min_compress_numel

    def averaged_dense(self, numel: int, ndim: int) -> bool:
        """Whether a tensor of this size and rank is always averaged dense rather than compressed."""
        return self.small_density is None and self.small(numel, ndim)

    def tensor_density(self, numel: int, ndim: int, density: float) -> float:
        """The density a compressed tensor of this size and rank is selected at when the step's is ``density``."""
        if self.small_density is not None and self.small(numel, ndim):
            return max(density, self.small_density)
        return density

    @property
    def value_dtype_torch(self) -> torch.dtype:
        return VALUE_DTYPES[self.value_dtype]

    @property
    def dense_dtype_torch(self) -> torch.dtype:
        """The dtype the tensors averaged dense travel in (an all-reduce cannot sum int8 levels)."""
        return torch.float16 if self.value_dtype == "int8" else self.value_dtype_torch


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
        return average(self, plan, work.flat, dense, indices, values)

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
        value_bytes = config.value_dtype_torch.itemsize
        numel = sum(s.numel for s in layout)
        _, k_total, dense_numel = split_layout(config, layout, cls.selected_density(config, world_size))
        payload, padding = codec.payload_size(k_total, value_bytes, numel)
        messages = []
        if payload:
            messages.append(Message("all_gather", payload, "payload"))
        if dense_numel:
            messages.append(Message("all_reduce", dense_numel * config.dense_dtype_torch.itemsize, "dense"))
        return WireCost(tuple(messages), dense_bytes, numel, k_total, k_total + dense_numel, padding)
