"""DGC's batched selection with static shapes: no host synchronisation, one compiled program per bucket.

:func:`~lightning_dgc.tensor_ops.selection.batched.batched_topk` reads the candidates' count on the host once
per bucket, to size their compaction and to find the segments whose sampled threshold came out too high.
A bucket's payload has a fixed size, so the count need not leave the device: here every shape is fixed by
the bucket's layout, and the same steps run as one program that a compiler (``torch.compile``) can fuse:

1. the sample (the same draws as the batched selection: ``torch.rand`` in float64, drawn by the caller)
   and two thresholds per segment, its ``r_t``-th largest sample (``r_t`` as in the batched selection) and
   its ``min(4 r_t, s_t)``-th (lower);
2. every value's *level* (0, 1 or 2: how many of its segment's two thresholds it reaches) and, from two
   int32 running sums, each segment's count at either threshold;
   each segment takes the higher threshold if at least ``k_t`` values reach it, else the lower one, else
   every value;
3. the candidates (values at or above their segment's chosen level) compacted into a buffer of fixed
   *capacity* (``nonzero_static``): per segment twice the expected count at the higher threshold, summed
   over the bucket, plus twice the largest segment's expected count at its lower threshold, so that a
   segment that needs its lower threshold (a few in a thousand) fits;
4. the candidates ordered by (segment, magnitude) in one sort, and the first ``k_t`` of each segment taken.

Every segment whose candidates all fit gets exactly its ``k_t`` largest magnitudes, with ties broken as
the batched selection breaks them: where the higher threshold suffices (nearly always) both compact and
sort the same candidates, so they select the same indices. A segment whose candidates do not all fit in
the capacity (both thresholds missed and the bucket's spare capacity exhausted; not seen in practice)
sends its first ``k_t`` values instead: still ``k_t`` distinct indices, so the payload keeps its size and
the error feedback keeps what was not sent. (Many values tied at the threshold, such as a tensor of zeros,
can do that; for a tensor of zeros any ``k_t`` of them are its top ``k_t``.)

The step is a few dozen operations whatever the number of segments, with no ``.item()``, no ``nonzero``
and no shape that depends on the data. Eagerly, it makes a few full-size temporaries (the segment of
every value, the comparisons, running sums) and is slower than the batched selection on the CPU; it is
meant to be compiled (:class:`StaticSelection` with ``compiled=True``), where the elementwise steps fuse
and about 10 bytes a value live at once (every value's segment, int32; the two comparisons, a byte each;
one running sum, int32), 6 for a tensor selected alone (no segment table).
"""

from __future__ import annotations

import math
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_dgc.tensor_ops.selection.batched import SegmentLayout, batched_topk, to_device
from lightning_dgc.tensor_ops.selection.batched import _threshold_rank as threshold_rank
from lightning_dgc.tensor_ops.selection.sampled import MIN_SAMPLES

__all__ = ["LOWER_RANK_FACTOR", "StaticSelection", "StaticTables", "static_tables", "static_topk"]

#: The lower threshold is the sample of rank ``LOWER_RANK_FACTOR * r_t`` (the batched selection's ``r_t``).
LOWER_RANK_FACTOR = 4
#: Capacity per segment: this many times the expected candidates at the higher threshold (plus a few).
CAPACITY_FACTOR = 2.0
CAPACITY_SLACK = 64
_SEGMENT_SHIFT = 2**32
_MAX_BITS = 2**31 - 1
_LOW32 = 2**32 - 1


@dataclass(frozen=True)
class StaticTables:
    """The fixed-shape tables of one group of segments (device tensors), made once per layout."""

    layout: SegmentLayout
    segment_ends: Tensor  # (T,) int64: where each segment ends (exclusive), for ``bucketize``
    thresholds_at: Tensor  # (T, 2): positions among the sorted samples of the higher and lower threshold
    sizes: Tensor  # (T,) int64
    capacity: int  # candidates kept (a Python int: part of the compiled program's shapes)


def _capacity(n: int, k: int, s: int, rank: int) -> int:
    if k >= n:
        return n
    return min(n, math.ceil(CAPACITY_FACTOR * n * rank / s) + CAPACITY_SLACK)


def static_tables(layout: SegmentLayout, sample_ratio: float) -> StaticTables:
    """The tables :func:`static_topk` reads for ``layout`` (one group: ``layout.groups`` is empty), made by
    ``segment_layout(..., sample_ratio)``; computed on the host from the layout's sizes (no device read)."""
    device = layout.segment_starts.device
    at, capacity, spare, sample_start = [], 0, 0, 0
    for n, k in zip(layout.sizes, layout.ks, strict=True):
        s = min(n, max(math.ceil(n * sample_ratio), MIN_SAMPLES))
        rank = threshold_rank(k, n, s) if k < n else 1  # (as ``segment_layout`` sets it)
        lower = min(s, LOWER_RANK_FACTOR * rank)
        at.append([sample_start + rank - 1, sample_start + lower - 1])
        capacity += _capacity(n, k, s, rank)
        spare = max(spare, _capacity(n, k, s, lower))  # room for the segment with most candidates at its lower one
        sample_start += s
    capacity += spare
    count = len(layout.sizes)
    flat = [i for pair in at for i in pair] + list(layout.starts[1:]) + list(layout.sizes)
    table = to_device(flat, device)
    return StaticTables(
        layout=layout, thresholds_at=table[: 2 * count].view(count, 2), segment_ends=table[2 * count : 3 * count],
        sizes=table[3 * count :], capacity=max(capacity, layout.k_total, 1),
    )  # fmt: skip


def static_topk(
    values: Tensor, draws: Tensor, sample_segment: Tensor, sample_scale: Tensor, sample_base: Tensor,
    thresholds_at: Tensor, take_all: Tensor, segment_starts: Tensor, segment_lasts: Tensor, segment_ends: Tensor,
    k_per_segment: Tensor, sizes: Tensor, out_segment: Tensor, out_within: Tensor, capacity: int,
) -> Tensor:  # fmt: skip
    """Indices into the flat float32 ``values`` of the ``k_t`` largest magnitudes of every segment, segment by
    segment (``out_segment.numel()`` of them), from the sample ``draws`` (float64 in [0, 1)); see the module
    docstring. Every argument is a tensor of a shape fixed by the layout, or the Python int ``capacity``."""
    total = values.numel()
    bits = values.abs().view(torch.int32)  # a non-negative float32's bits order like its value
    # Step 1: the sample and each segment's two thresholds.
    positions = torch.minimum((draws * sample_scale).long(), sample_scale - 1) + sample_base
    sample_bits = bits[positions]
    keys = sample_segment * _SEGMENT_SHIFT + (_MAX_BITS - sample_bits.long())
    # (read back from the sorted keys, not gathered through the sample: a compiler then reads one small table
    # per value instead of a chain of gathers)
    sorted_keys = torch.sort(keys, stable=True).values
    thresholds = (_MAX_BITS - (sorted_keys[thresholds_at] & _LOW32)).to(torch.int32)  # (T, 2)
    thresholds = thresholds.masked_fill(take_all.unsqueeze(1), 0)
    # Step 2: every value's level, and each segment's count at either threshold (one running sum).
    # every value's segment: a running sum of ones at the segments' starts (int32, no per-value search)
    alone = segment_starts.numel() == 1  # a tensor selected alone (a shape: fixed when compiled): no table
    if alone:
        higher, lower = bits >= thresholds[0, 0], bits >= thresholds[0, 1]
    else:
        segment = torch.zeros(total, dtype=torch.int32, device=values.device).index_fill_(0, segment_starts[1:], 1)
        segment = torch.cumsum(segment, 0, dtype=torch.int32)
        higher, lower = bits >= thresholds[:, 0][segment], bits >= thresholds[:, 1][segment]
    count_higher, count_lower = _segment_counts(higher, segment_lasts), _segment_counts(lower, segment_lasts)
    level = torch.where(count_higher >= k_per_segment, 2, torch.where(count_lower >= k_per_segment, 1, 0))
    count = torch.where(level == 2, count_higher, torch.where(level == 1, count_lower, sizes))
    # Step 3: the candidates, compacted into the fixed capacity (position order: segment by segment).
    mask = (higher.long() + lower.long()) >= (level[0] if alone else level[segment])
    candidates = torch.nonzero_static(mask, size=capacity, fill_value=total).squeeze(1)
    first = torch.cumsum(count, 0) - count  # where each segment's candidates begin
    fits = first + count <= capacity
    # Step 4: order by (segment, magnitude) and take the first k of each segment.
    candidate_segment = torch.bucketize(candidates, segment_ends, right=True)  # (the fill: past the last)
    candidate_bits = bits[candidates.clamp(max=total - 1)]
    order = torch.argsort(candidate_segment * _SEGMENT_SHIFT + (_MAX_BITS - candidate_bits.long()), stable=True)
    slot = (first[out_segment] + out_within).clamp(max=capacity - 1)
    chosen = candidates[order[slot]]
    return torch.where(fits[out_segment], chosen, segment_starts[out_segment] + out_within)


def _segment_counts(mask: Tensor, segment_lasts: Tensor) -> Tensor:
    """Each segment's count of ``mask``: a running sum (int32: 4 bytes a value, freed once read at the ends)."""
    ends = torch.cumsum(mask, 0, dtype=torch.int32)[segment_lasts].long()
    return ends - torch.cat([ends.new_zeros(1), ends[:-1]])


def _fresh(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """A copy of ``fn`` with a code object of its own: ``torch.compile`` keeps one cache per code object, so
    each copy holds its own program (one per bucket), and many buckets do not exhaust one cache's limit."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class StaticSelection:
    """:func:`static_topk` for one bucket layout, group by group (``SegmentLayout.groups``), eager or compiled.

    ``compiled=True``: one ``torch.compile`` program per bucket (``fullgraph``: a host read or a data-dependent
    shape would fail to compile rather than stall), built on the first call. The sample's draws are made
    outside the program (one ``torch.rand`` per group, on the generator given), exactly as the batched
    selection draws them, so the compiled and eager forms select the same indices. Should compiling fail
    (no compiler for the device), a ``RuntimeWarning`` says so once and the bucket selects eagerly from then
    on, with :func:`~lightning_dgc.tensor_ops.selection.batched.batched_topk`.
    """

    def __init__(self, layout: SegmentLayout, sample_ratio: float, compiled: bool) -> None:
        self.layout = layout
        groups = layout.groups or ((0, len(layout.sizes), layout),)
        self.groups = [(a, b, static_tables(group, sample_ratio)) for a, b, group in groups]
        self.compiled = compiled
        self.failed: str | None = None  # why compiling failed (the bucket then selects eagerly)
        self._select: Callable[..., Tensor] = (
            torch.compile(_fresh(static_topk), fullgraph=True, dynamic=False) if compiled else static_topk
        )

    def select_group(self, index: int, values: Tensor, generator: torch.Generator | None) -> Tensor:
        """The indices (into ``values``, the group's own flat values) of group ``index``'s selection."""
        _, _, tables = self.groups[index]
        layout = tables.layout
        if layout.k_total == 0:
            return torch.zeros(0, dtype=torch.int64, device=values.device)
        if values.dtype != torch.float32:
            raise TypeError(f"the static selection selects from float32 values, got {values.dtype}")
        if self.failed is not None:
            return batched_topk(values, layout, generator)
        draws = torch.rand(layout.sample_scale.numel(), generator=generator, device=values.device,
                           dtype=torch.float64)  # fmt: skip
        arguments = (
            values, draws, layout.sample_segment, layout.sample_scale, layout.sample_base, tables.thresholds_at,
            layout.take_all, layout.segment_starts, layout.segment_lasts, tables.segment_ends,
            layout.k_per_segment, tables.sizes, layout.out_segment, layout.out_within, tables.capacity,
        )  # fmt: skip
        if not self.compiled:
            return static_topk(*arguments)
        try:
            return self._select(*arguments)
        except Exception as error:  # noqa: BLE001  (no compiler for this device: the eager path, said once)
            self.failed = f"{type(error).__name__}: {error}"[:500]
            warnings.warn(
                f"compile_selection: torch.compile failed for a bucket's selection ({self.failed}); this bucket"
                " selects with the eager batched selection instead. Pass compile_selection=False to skip compiling.",
                RuntimeWarning, stacklevel=2,
            )  # fmt: skip
            return static_topk(*arguments)  # (these draws; the next calls: the batched selection)

    def __call__(self, values: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """The indices into the bucket's flat ``values`` (every group's, bucket order)."""
        if len(self.groups) == 1:
            return self.select_group(0, values, generator)
        starts = self.layout.starts
        return torch.cat([
            self.select_group(j, values[starts[a] : starts[b]], generator).add_(starts[a])
            for j, (a, b, _) in enumerate(self.groups)
        ])  # fmt: skip
