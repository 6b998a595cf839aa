"""The shared base of top-k algorithms (DGC, DEFT, an outside top-k): what they do alike, per bucket and step.

2. **compensate**: local clipping (optional), weight decay, momentum correction into a temporary ``v'``
   (``u' = m u + g``, ``v' = v + u'``; Nesterov ``u' = m (u + g)``, ``v' = v + u' + g``), or plain error
   feedback (``m = 0``);
3. **select** and 4. **exchange**: each algorithm's own (DGC: every rank its top-k, one all-gather; DEFT:
   the partitioned selection);
5. **decode**: the average (:func:`~lightning_dgc.algorithms.sparse_decode.average`), with SGD momentum on the tensors averaged dense;
6. **commit** (``finish_step``, a finite step only): ``u``, ``v`` updated in place by the same operations
   (:meth:`SparseTopK.replay`), the sent values cleared.

Which kind each tensor is, and how many values it sends: :mod:`lightning_dgc.algorithms.topk_plan`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

import torch
from torch import Tensor

from lightning_dgc.algorithms.base import Algorithm, BucketWork, TensorSpec
from lightning_dgc.algorithms.topk_plan import (
    Kind,
    TopKSettings,
    holds_back,
    periodic,
    small_every,
    tensor_kind,
    tensor_values,
)
from lightning_dgc.tensor_ops import codec
from lightning_dgc.tensor_ops.memory import bucket_order_flat, clear_
from lightning_dgc.tensor_ops.momentum import (
    clip_each_by_norm_,
    compensated_velocity_each,
    momentum_correction_each_,
)
from lightning_dgc.tensor_ops.selection import sampled_topk, topk_indices
from lightning_dgc.tensor_ops.selection.batched import SegmentLayout, selected_in_groups
from lightning_dgc.tensor_ops.selection.static import StaticSelection

if TYPE_CHECKING:
    from lightning_dgc.comm import Pending

@dataclass
class Entry:
    """One tensor of a DGC bucket."""

    spec: TensorSpec
    kind: Kind
    k: int  # values sent per step (sparse) or numel (full/dense)
    periodic: bool = False  # a small tensor sent whole every ``small_every`` steps (full), held in between

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def offset(self) -> int:
        return self.spec.offset

    @property
    def numel(self) -> int:
        return self.spec.numel


@dataclass
class SparsePlan:
    layout: list[TensorSpec]
    entries: list[Entry]
    k_total: int
    dense_numel: int
    dense_bytes: int  # what DDP would send for this bucket
    payload: Tensor  # this rank's payload (uint8), reused every step
    gathered: Tensor  # every rank's payload, concatenated (gloo wants a flat output), reused
    # Bucket positions of the tensors exchanged dense, in entry order (None: every tensor is, in
    # bucket order), so that decompression places them with one index_copy_.
    dense_index: Tensor | None = None
    # Whether the bucket holds its periodic tensors back in some steps (it has others to send every step), and
    # the bucket positions then exchanged dense (``dense_index`` without the periodic tensors).
    holds: bool = False
    held_index: Tensor | None = None
    # Entries (positions in ``entries``) grouped by the setting that decides their update, so that
    # each group runs as a few ``torch._foreach_*`` calls instead of a Python loop per tensor.
    decay_groups: list[tuple[float, list[int]]] = field(default_factory=list)  # weight decay
    memory_groups: list[tuple[tuple[float, bool], list[int]]] = field(default_factory=list)  # full/sparse
    dense_momentum_groups: list[tuple[tuple[float, bool], list[int]]] = field(default_factory=list)
    sparse_names: list[str] = field(default_factory=list)  # the compressed tensors, in entry order
    sparse_momentum: bool = False  # whether any compressed tensor keeps a momentum
    segments: SegmentLayout | None = None  # the batched selection's layout (made when first used)
    static: StaticSelection | None = None  # its compiled shape-static form (``compile_selection``), when used
    out_shift: Tensor | None = None  # per selected slot: bucket offset - offset in the compressed buffer
    steps: int = 0  # steps run with this plan
    grouped: bool = False  # its compressed tensors' memory is one flat buffer per kind (``SparseTopK.replay``)


@dataclass
class SparseWork(BucketWork):
    dense_parts: list[Tensor] = field(default_factory=list)  # entry order: dense gradients, full velocities
    sparse: list[tuple[Entry, Tensor]] = field(default_factory=list)  # compressed tensors, their v'
    # Every compressed tensor's v', one flat buffer (views in ``sparse``), alive from step 2 to the end of
    # step 4 only: the memory itself is updated at commit (``SparseTopK.replay``).
    velocity: Tensor | None = None
    selected: Tensor | None = None  # what was sent: positions in the compressed tensors' flat memory
    selected_mask: Tensor | None = None  # (DEFT's ablation) which of ``selected`` this rank sent
    unsent: Tensor | None = None  # per ``selected``: what the wire's rounding left out (int8 values), kept
    local: Tensor | None = None  # a copy of the local gradient for the commit, when the decode overwrites it
    in_bucket: bool = False  # ``velocity`` is a part of the bucket (v' made in place of the local gradient)
    grouped: bool = False  # the compressed tensors' memory is one flat buffer per kind
    held: bool = False  # the periodic tensors are held back this step (their velocity kept, their update zero)
    per_tensor: bool = False  # ``sparse`` holds no v': the selection makes it tensor by tensor (or group by group)
    gathered: Pending | None = None
    dense: Pending | None = None


def grouped(items: list[Entry], key: Callable[[Entry], object]) -> list[tuple[object, list[int]]]:
    """Positions of ``items`` grouped by ``key`` (``None``: left out), groups in first-seen order."""
    groups: dict[object, list[int]] = {}
    for i, item in enumerate(items):
        value = key(item)
        if value is not None:
            groups.setdefault(value, []).append(i)
    return list(groups.items())


#: The top-k algorithm's configuration (:class:`TopKSettings` at least), plan and work.
ConfigT = TypeVar("ConfigT", bound=TopKSettings)
PlanT = TypeVar("PlanT", bound=SparsePlan)
WorkT = TypeVar("WorkT", bound=SparseWork)


class SparseTopK(Algorithm[ConfigT, PlanT, WorkT], Generic[ConfigT, PlanT, WorkT]):
    """What top-k algorithms share (see the module docstring): the plan of a bucket's tensors, compensation
    with momentum correction, the commit, the selection kernel of a tensor (:meth:`choose`), the average.
    A subclass adds its selection, exchange, decode and wire cost, and its plan and work types."""

    memory_kinds = ("momentum", "velocity")
    residual_kind = "velocity"
    dense_is_ddp = True
    work_class: type[SparseWork] = SparseWork
    #: Whether the selection tensor by tensor (the CPU's numpy path) makes each compressed tensor's v' when
    #: it gets to it, so that one tensor's temporary is alive at a time, not a bucket's (DDP's first bucket
    #: holds the whole model). An algorithm that reads v' of the whole bucket (DEFT: norms, the union's
    #: values) leaves it False.
    velocity_per_tensor: ClassVar[bool] = False

    @property
    def takes_over_momentum(self) -> bool:
        return self.config.momentum_correction

    def plan_key(self) -> tuple[object, ...]:
        return (self.config.density, self.config.value_dtype)

    # -- the plan ------------------------------------------------------------------------------------------
    @classmethod
    def selected_density(cls, config: ConfigT, world_size: int) -> float:
        """The fraction of each compressed tensor one step selects: the configured density."""
        return config.density

    def entries(self, layout: list[TensorSpec]) -> list[Entry]:
        entries = []
        density = self.selected_density(self.config, self.state.world_size)
        for spec in layout:
            k = tensor_values(self.config, spec.numel, spec.ndim, density)
            kind = tensor_kind(spec.numel, spec.ndim, k, self.config)
            entries.append(Entry(spec, kind, k if kind == "sparse" else spec.numel,
                                 periodic(spec.numel, spec.ndim, self.config)))  # fmt: skip
        return entries

    def plan(self, layout: list[TensorSpec], buffer: Tensor) -> SparsePlan:
        device = buffer.device
        entries = self.entries(layout)
        k_total = sum(e.k for e in entries if e.kind == "sparse")
        dense_numel = sum(e.numel for e in entries if e.kind != "sparse")
        numel = sum(s.numel for s in layout)
        nbytes = self.payload_nbytes(k_total, numel)
        plan = SparsePlan(
            layout, entries, k_total, dense_numel, buffer.numel() * buffer.element_size(),
            payload=torch.zeros(nbytes, dtype=torch.uint8, device=device),
            gathered=torch.empty(self.state.world_size * nbytes, dtype=torch.uint8, device=device),
        )  # fmt: skip

        def positions(exchanged: list[Entry]) -> Tensor:  # bucket positions of the tensors exchanged dense
            return torch.cat([torch.empty(0, dtype=torch.long, device=device)] + [
                torch.arange(e.offset, e.offset + e.numel, device=device) for e in exchanged])  # fmt: skip

        if plan.dense_numel and plan.dense_numel != numel:
            plan.dense_index = positions([e for e in entries if e.kind != "sparse"])
        plan.holds = holds_back([e.periodic for e in entries])
        if plan.holds:
            plan.held_index = positions([e for e in entries if e.kind != "sparse" and not e.periodic])
        plan.sparse_names = [e.name for e in entries if e.kind == "sparse"]
        settings = self.state.settings_for
        plan.sparse_momentum = any(settings(name).momentum for name in plan.sparse_names)
        plan.decay_groups = grouped(entries, lambda e: settings(e.name).weight_decay or None)  # type: ignore[assignment]
        plan.memory_groups = grouped(  # type: ignore[assignment]
            entries,
            lambda e: (settings(e.name).momentum, settings(e.name).nesterov) if e.kind != "dense" else None,
        )
        plan.dense_momentum_groups = grouped(  # type: ignore[assignment]
            entries,
            lambda e: (
                (settings(e.name).momentum, settings(e.name).nesterov)
                if e.kind == "dense" and settings(e.name).momentum
                else None
            ),
        )
        return plan

    def holding(self, plan: PlanT) -> bool:
        """Whether this step holds ``plan``'s periodic tensors back (``small_every``: all but every that many steps)."""
        return plan.holds and self.state.step % small_every(self.config) != 0

    def payload_nbytes(self, k_total: int, numel: int) -> int:
        """This algorithm's payload per rank (0 when it compresses nothing in the bucket)."""
        return codec.payload_nbytes(k_total, self.config.value_dtype_torch, numel)

    # -- step 2 ----------------------------------------------------------------------------------------------
    def compensate(self, plan: PlanT, grads: list[Tensor], flat: Tensor) -> WorkT:
        """Local clipping, weight decay, momentum correction into the temporary velocity selected from."""
        work = self.work_class(grads, flat)
        work.held = self.holding(plan)
        cfg, memory, device = self.config, self.state.memory, flat.device
        if cfg.local_clip_norm is not None:
            clip_each_by_norm_(grads, cfg.local_clip_norm / math.sqrt(self.state.world_size))
        for decay, members in plan.decay_groups:
            members = [i for i in members if not self.state.continues(plan.entries[i].name)]  # once per step
            if not members:
                continue
            params = [bucket_order_flat(self.state.param(plan.entries[i].name).detach()) for i in members]
            if params[0].dtype != torch.float32:
                params = [p.float() for p in params]
            torch._foreach_add_([grads[i] for i in members], params, alpha=decay)
        sparse_views: dict[int, Tensor] = {}
        work.grouped = plan.grouped  # (see ``replay``)
        plan.steps += 1
        if plan.sparse_names:
            sizes = [e.numel for e in plan.entries if e.kind == "sparse"]
            sparse = [i for i, e in enumerate(plan.entries) if e.kind == "sparse"]
            side_by_side = sparse == list(range(sparse[0], sparse[-1] + 1))
            if not plan.sparse_momentum and (side_by_side or not self.velocity_per_tensor):
                # error feedback: v' = g + v is made in the bucket itself (the commit copies it), with no
                # temporary; one flat view of it when the compressed tensors lie side by side (DEFT
                # reads the bucket otherwise)
                first, last = plan.entries[sparse[0]], plan.entries[sparse[-1]]
                work.velocity = flat[first.offset : last.offset + last.numel] if side_by_side else None
                work.in_bucket = True
            elif self.velocity_per_tensor and (not self.batched(device) or selected_in_groups(sizes)):
                work.per_tensor = True  # v' made by the selection: a tensor's (or, batched, a group's) at a time
            else:
                work.velocity = torch.empty(sum(sizes), dtype=torch.float32, device=device)
            if work.velocity is not None:
                sparse_views = dict(zip(sparse, work.velocity.split(sizes), strict=True))
            elif work.in_bucket:
                sparse_views = {i: grads[i] for i in sparse}
        velocity_out: dict[int, Tensor] = {}
        for (momentum, nesterov), continuing, members in self._memory_groups(plan):
            names = [plan.entries[i].name for i in members]
            sizes = [plan.entries[i].numel for i in members]
            velocity = [
                memory.buffer("velocity", n, size, device) for n, size in zip(names, sizes, strict=True)
            ]
            if work.in_bucket and momentum == 0.0:  # (g + v is v + g, bit for bit)
                here = [j for j, i in enumerate(members) if i in sparse_views]
                torch._foreach_add_([grads[members[j]] for j in here], [velocity[j] for j in here])
                members_left = [i for i in members if i not in sparse_views]
                velocity = [v for j, v in enumerate(velocity) if j not in here]
                velocity_out.update((i, grads[i]) for i in members if i in sparse_views)
                members = members_left
            if work.per_tensor:  # the memory exists from here on; v' is made by the selection
                if momentum:
                    for i in members:
                        memory.buffer("momentum", plan.entries[i].name, plan.entries[i].numel, device)
                here = [j for j, i in enumerate(members) if plan.entries[i].kind == "sparse"]
                velocity_out.update((members[j], None) for j in here)  # type: ignore[misc]
                velocity = [v for j, v in enumerate(velocity) if j not in here]
                members = [i for j, i in enumerate(members) if j not in here]
            v_out = [
                sparse_views[i] if i in sparse_views else grads[i].new_empty(grads[i].shape) for i in members
            ]
            u: list[Tensor] = []
            if momentum:
                u = [
                    memory.buffer("momentum", plan.entries[i].name, plan.entries[i].numel, device)
                    for i in members
                ]
            compensated_velocity_each(
                [grads[i] for i in members], velocity, v_out, momentum, nesterov, u, continuing
            )
            velocity_out.update(zip(members, v_out, strict=True))
        for _, members in plan.dense_momentum_groups:  # made here, on the hook's stream, not in the callback
            for i in members:
                memory.buffer("momentum", plan.entries[i].name, plan.entries[i].numel, device)
                memory.scratch("momentum", plan.entries[i].name)  # written by the decode (dense_momentum)
        for i, e in enumerate(plan.entries):
            if e.kind == "dense":
                work.dense_parts.append(grads[i])
            elif e.kind == "full":
                if not (work.held and e.periodic):
                    work.dense_parts.append(velocity_out[i])
            else:
                work.sparse.append((e, velocity_out[i]))
        if plan.memory_groups:  # the memory's update, applied in place once the step is known finite
            if not self.state.finish_writes_grads:  # the decode overwrites the local gradient: keep it
                work.local = flat.clone()
            names = [e.name for e in plan.entries if e.kind != "dense"]
            memory.note_replay(names, lambda skip: self.replay(plan, work, skip))
        return work

    def replay(self, plan: PlanT, work: WorkT, skip: Callable[[str], bool]) -> None:
        """Commit this bucket's step to the memory, in place: momentum correction with the very operations
        that made the velocity selected from (:func:`~lightning_dgc.tensor_ops.momentum.momentum_correction_each_`), then
        what was sent cleared (and tensors sent whole emptied). ``skip``: parameters unused in the step."""
        memory, device = self.state.memory, work.flat.device
        grads = work.grads if work.local is None else work.local.split([s.numel for s in plan.layout])
        committed = memory.committed
        for (momentum, nesterov), continuing, members in self._memory_groups(plan):
            used = [i for i in members if not skip(plan.entries[i].name)]
            if work.in_bucket and momentum == 0.0:  # v' is in the bucket already
                here = [i for i in used if plan.entries[i].kind == "sparse"]
                torch._foreach_copy_([committed["velocity"][plan.entries[i].name] for i in here],
                                     [grads[i] for i in here])  # fmt: skip
                used = [i for i in used if plan.entries[i].kind != "sparse"]
            names = [plan.entries[i].name for i in used]
            u = [committed["momentum"][n] for n in names] if momentum else []
            momentum_correction_each_(
                [grads[i] for i in used],
                [committed["velocity"][n] for n in names],
                momentum,
                nesterov,
                u,
                continuing,
            )
            full = [
                committed["velocity"][plan.entries[i].name] for i in used
                if plan.entries[i].kind == "full" and not (work.held and plan.entries[i].periodic)
            ]  # fmt: skip
            if full:  # sent whole: nothing held back
                torch._foreach_zero_(full)
        if work.selected is not None:
            self._clear_sent(plan, work, skip)
        if not plan.grouped and plan.steps >= 2 and plan.sparse_names and self.batched(device):
            # For the batched selection (on a device), the compressed tensors' memory is laid out
            # contiguously (one write clears what was sent) once a layout has lasted two steps: DDP's
            # first bucket is rebuilt after one step, and grouping it first would hold the memory twice
            # while it moves. The tensor-by-tensor path keeps it per parameter.
            sizes = [e.numel for e in plan.entries if e.kind == "sparse"]
            memory.flat("velocity", plan.sparse_names, sizes, device)
            if plan.sparse_momentum:
                memory.flat("momentum", plan.sparse_names, sizes, device)
            plan.grouped = True

    def _memory_groups(self, plan: PlanT) -> list[tuple[tuple[float, bool], bool, list[int]]]:
        """``plan.memory_groups`` with each group split by whether its parameters continue an optimizer step
        that an earlier backward pass exchanged (:meth:`~lightning_dgc.algorithms.context.ExchangeContext.continues`): ``(settings, continuing,
        members)``; every group is one piece unless several backward passes feed one optimizer step."""
        groups: list[tuple[tuple[float, bool], bool, list[int]]] = []
        for settings, members in plan.memory_groups:
            continuing = [i for i in members if self.state.continues(plan.entries[i].name)]
            if continuing:
                groups.append((settings, True, continuing))
            if len(continuing) < len(members):
                groups.append((settings, False, [i for i in members if i not in continuing]))
        return groups

    def _clear_sent(self, plan: PlanT, work: WorkT, skip: Callable[[str], bool]) -> None:
        """Clear what was sent from the velocity (and, with momentum masking, the momentum)."""
        memory, device, committed = self.state.memory, work.flat.device, self.state.memory.committed
        assert work.selected is not None
        positions, sent = work.selected, work.selected_mask
        sparse = [e for e in plan.entries if e.kind == "sparse"]
        sizes = [e.numel for e in sparse]
        kinds = ["velocity"] + (["momentum"] if self.config.momentum_masking and plan.sparse_momentum else [])
        if work.grouped and not any(skip(e.name) for e in sparse):  # one write per buffer of the bucket
            for kind in kinds:  # what was sent is no longer held back
                clear_(memory.flat(kind, plan.sparse_names, sizes, device), positions, sent,
                       work.unsent if kind == "velocity" else None)  # fmt: skip
            return
        # tensor by tensor (a layout's first step, or a parameter unused in the step, whose memory stays)
        ends = torch.tensor(sizes, device=positions.device).cumsum(0)
        segment = torch.bucketize(positions, ends, right=True)
        start = 0
        for j, e in enumerate(sparse):
            if not skip(e.name):
                mine = segment == j
                for kind in kinds:
                    if memory.has(kind, e.name):
                        clear_(
                            committed[kind][e.name],
                            positions[mine] - start,
                            sent[mine] if sent is not None else None,
                            work.unsent[mine] if kind == "velocity" and work.unsent is not None else None,
                        )
            start += e.numel

    # -- step 3 ----------------------------------------------------------------------------------------------
    def choose(self, values: Tensor, k: int) -> Tensor:
        """Exactly ``k`` indices of the largest magnitudes of ``values`` (the configured selection)."""
        if self.config.selection == "exact":
            return topk_indices(values, k)
        backend = "numpy" if self.config.selection_backend == "numpy" else "auto"
        return sampled_topk(values, k, self.config.sample_ratio, self.state.generator, backend=backend)

    def batched(self, device: torch.device) -> bool:
        """Whether the sampled selection runs batched per bucket (see ``DGCConfig.selection_backend``)."""
        backend = self.config.selection_backend
        if backend == "numpy" and device.type != "cpu":
            raise ValueError(
                f"selection_backend='numpy' selects on CPU tensors only, but this bucket is on {device}; "
                "use selection_backend='auto' (batched on the device) or 'torch'."
            )
        return self.config.selection == "sampled" and (
            backend == "torch" or (backend == "auto" and (device.type != "cpu" or self.compiles_selection(device)))
        )

    def compiles_selection(self, device: torch.device) -> bool:
        """Whether the batched selection runs compiled (DGC's ``compile_selection``); the base never compiles."""
        return False
