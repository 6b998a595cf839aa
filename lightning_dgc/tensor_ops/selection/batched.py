"""DGC's sampled top-k for many tensors at once: a fixed number of kernels per bucket, one host sync.

The per-tensor selection (:func:`lightning_dgc.tensor_ops.selection.sampled.sampled_topk`) launches a dozen
kernels per tensor and synchronises with the host about twice per tensor; on a GPU a bucket of
ResNet-50's 54 compressed tensors then costs more than exact ``torch.topk``. Here the tensors of a
bucket are *segments* of one flat buffer (their memory lives contiguously,
:meth:`lightning_dgc.tensor_ops.memory.ResidualMemory.group`) and every step is one operation over all of them:

1. ``|x|`` of the whole buffer;
2. sample positions drawn on the buffer's device, ``s_t = max(ratio * n_t, MIN_SAMPLES)`` per segment,
   their magnitudes gathered and sorted by (segment, magnitude) in one sort of int64 keys (a
   non-negative float32's bit pattern orders like its value): the threshold of segment ``t`` is its
   ``r_t``-th largest sample, ``r_t`` set a few standard deviations below the expected count of
   sampled values above the k-th largest (as in the per-tensor selection);
3. the candidates ``|x| >= threshold`` of their segment, every value's threshold laid out by a running
   sum of the thresholds' differences at the segment starts (int32 bit patterns, exact; no per-value
   index), and their count per segment from a running sum of the mask: **the one host
   synchronisation**, which sizes the compaction and finds the segments with fewer than ``k_t``
   candidates (the sample put their threshold too high: rare); those take their exact top-k instead,
   a few more kernels but no further synchronisation;
4. the candidates compacted (``nonzero_static``), sorted by (segment, magnitude), and the first
   ``k_t`` of each segment taken.

Full-size passes: ``|x|``, the thresholds' running sum, the comparison, the mask's running sum and
the compaction (about 1.2 GB of memory traffic for ResNet-50's 25.5M values); everything else is
the size of the samples or of the candidates. Memory: ``|x|`` (4 bytes a value) is freed once the
candidates are known, so at most the thresholds (4 bytes), the mask (1) and either ``|x|`` or the mask's
running sum (4) live at once: 9 bytes a value; a single segment (one threshold: a tensor selected alone)
needs neither table, 5 bytes a value. Consecutive segments are selected in groups of at most
:data:`MAX_BATCH_VALUES` values (a larger segment alone), which bounds that by the group, not by the
bucket (DDP's first bucket is the whole model); each group adds its kernels and its synchronisation.

The result is, for every segment, exactly its ``k_t`` largest magnitudes (ties at the threshold
broken by the sort), the same set as the per-tensor selection up to ties; the number of kernels does
not depend on the number of segments. Pure tensor code: it runs on the CPU too (where the per-tensor
numpy path is faster and remains the default).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_dgc.tensor_ops.selection.sampled import MIN_SAMPLES, THRESHOLD_MARGIN

__all__ = [
    "MAX_BATCH_VALUES",
    "SegmentLayout",
    "batched_topk",
    "concatenated_ranges",
    "segment_layout",
    "selected_in_groups",
    "to_device",
    "topk_in_ranges",
]


#: The most values one batched selection reads at once (32 MiB of float32: DDP's default 25 MB buckets
#: are one group; a larger bucket is cut between segments).
MAX_BATCH_VALUES = 2**23


@dataclass(frozen=True)
class SegmentLayout:
    """What a batched selection over fixed segments needs, made once (device tensors: views of one copy)."""

    sizes: tuple[int, ...]
    ks: tuple[int, ...]
    starts: tuple[int, ...]  # where each segment begins (and, last, the total)
    k_starts: tuple[int, ...]  # where each segment's selection begins in the result (and k_total)
    total: int  # values in all segments
    k_total: int
    segment_starts: Tensor  # (T,) int64
    segment_lasts: Tensor  # (T,) int64: the position of each segment's last value
    take_all: Tensor  # (T,) bool: k >= n, every value is selected
    k_per_segment: Tensor  # (T,) int64
    sample_segment: Tensor  # (S,) segment of each sample
    sample_scale: Tensor  # (S,) int64: the size of the sample's segment
    sample_base: Tensor  # (S,) int64: the start of the sample's segment
    threshold_at: Tensor  # (T,) index of each segment's threshold among the sorted samples
    out_segment: Tensor  # (K,) segment of each selected slot
    out_within: Tensor  # (K,) position of the slot within its segment's k
    #: ``(first, end, layout)``: segments ``first..end-1`` selected together, when more than one group
    groups: tuple[tuple[int, int, SegmentLayout], ...] = ()


def _threshold_rank(k: int, n: int, samples: int) -> int:
    expected = k * samples / n
    return min(samples, max(1, math.ceil(expected + THRESHOLD_MARGIN * math.sqrt(expected))))


def _group_bounds(sizes: Sequence[int], max_values: int) -> list[tuple[int, int]]:
    """Consecutive segments in groups of at most ``max_values`` values (a larger segment alone)."""
    bounds, first, total = [], 0, 0
    for t, n in enumerate(sizes):
        if t > first and total + n > max_values:
            bounds.append((first, t))
            first, total = t, 0
        total += n
    bounds.append((first, len(sizes)))
    return bounds


def selected_in_groups(sizes: Sequence[int], max_values: int | None = None) -> bool:
    """Whether :func:`batched_topk` selects segments of ``sizes`` in more than one group (more than
    ``max_values`` values, default :data:`MAX_BATCH_VALUES`, in more than one segment)."""
    return len(sizes) > 1 and sum(sizes) > (MAX_BATCH_VALUES if max_values is None else max_values)


def segment_layout(
    sizes: Sequence[int], ks: Sequence[int], sample_ratio: float, device: torch.device,
    max_values: int | None = None,
) -> SegmentLayout:  # fmt: skip
    """The :class:`SegmentLayout` of consecutive segments of ``sizes`` with ``ks`` values to select each
    (its tables reach the device in one copy); with more than ``max_values`` values (default
    :data:`MAX_BATCH_VALUES`), also one layout per group of segments (``groups``), which
    :func:`batched_topk` selects one after the other."""
    max_values = MAX_BATCH_VALUES if max_values is None else max_values
    sizes, ks = (
        tuple(int(n) for n in sizes),
        tuple(min(int(k), int(n)) for k, n in zip(ks, sizes, strict=True)),
    )
    samples = [min(n, max(math.ceil(n * sample_ratio), MIN_SAMPLES)) for n in sizes]
    starts, sample_starts, k_starts = [0], [0], [0]
    for n, s, k in zip(sizes, samples, ks, strict=True):
        starts.append(starts[-1] + n)
        sample_starts.append(sample_starts[-1] + s)
        k_starts.append(k_starts[-1] + k)
    ranks = [_threshold_rank(k, n, s) if k < n else 1 for k, n, s in zip(ks, sizes, samples, strict=True)]
    sample_counts, k_counts = torch.tensor(samples), torch.tensor(ks)
    segments = torch.arange(len(sizes))
    tables = {  # int64, host
        "segment_starts": torch.tensor(starts[:-1]),
        "segment_lasts": torch.tensor(starts[1:]) - 1,
        "take_all": torch.tensor([int(k >= n) for k, n in zip(ks, sizes, strict=True)]),
        "k_per_segment": k_counts,
        "sample_segment": segments.repeat_interleave(sample_counts),
        "sample_scale": torch.tensor(sizes).repeat_interleave(sample_counts),
        "sample_base": torch.tensor(starts[:-1]).repeat_interleave(sample_counts),
        "threshold_at": torch.tensor([start + r - 1 for start, r in zip(sample_starts, ranks, strict=False)]),
        "out_segment": segments.repeat_interleave(k_counts),
        "out_within": torch.arange(k_starts[-1]) - torch.tensor(k_starts[:-1]).repeat_interleave(k_counts),
    }
    packed = to_device(torch.cat([t.reshape(-1).long() for t in tables.values()]), device)
    views = dict(zip(tables, packed.split([t.numel() for t in tables.values()]), strict=True))
    views["take_all"] = views["take_all"].bool()
    bounds = _group_bounds(sizes, max_values) if selected_in_groups(sizes, max_values) else []
    groups = tuple(
        (a, b, segment_layout(sizes[a:b], ks[a:b], sample_ratio, device, max_values)) for a, b in bounds
    )  # fmt: skip
    return SegmentLayout(sizes=sizes, ks=ks, starts=tuple(starts), k_starts=tuple(k_starts), total=starts[-1],
                         k_total=k_starts[-1], groups=groups, **views)  # fmt: skip


#: Sort keys that order (segment ascending, magnitude descending) in one int64 sort: a non-negative
#: float32's bit pattern orders like its value, so ``segment * 2**32 + (2**31 - 1 - bits)`` does.
_SEGMENT_SHIFT = 2**32
_MAX_BITS = 2**31 - 1


def _order_by_segment(magnitudes: Tensor, segments: Tensor) -> Tensor:
    """The permutation that orders non-negative float32 ``magnitudes`` by segment, then descending."""
    keys = segments * _SEGMENT_SHIFT + (_MAX_BITS - magnitudes.view(torch.int32).long())
    return torch.argsort(keys, stable=True)


def batched_topk(values: Tensor, layout: SegmentLayout, generator: torch.Generator | None = None) -> Tensor:
    """Indices into the flat float32 ``values`` of the ``k_t`` largest magnitudes of every segment,
    segment by segment (unsorted within a segment): ``layout.k_total`` indices. See the module docstring."""
    if layout.k_total == 0:
        return torch.zeros(0, dtype=torch.int64, device=values.device)
    if values.dtype != torch.float32:
        raise TypeError(f"batched_topk selects from float32 values, got {values.dtype}")
    if layout.groups:
        return torch.cat([
            batched_topk(values[layout.starts[a] : layout.starts[b]], group, generator).add_(layout.starts[a])
            for a, b, group in layout.groups
        ])  # fmt: skip
    magnitudes = values.abs()
    # Step 2: every segment's threshold from its samples (as float32 bit patterns: they order alike).
    draws = torch.rand(
        layout.sample_scale.numel(), generator=generator, device=values.device, dtype=torch.float64
    )
    positions = (draws * layout.sample_scale).long()
    positions = torch.minimum(positions, layout.sample_scale - 1).add_(layout.sample_base)
    samples = magnitudes[positions]
    threshold = samples[_order_by_segment(samples, layout.sample_segment)[layout.threshold_at]]
    threshold_bits = threshold.view(torch.int32).masked_fill(layout.take_all, 0)
    # Step 3: candidates and their count per segment (the host synchronisation).
    if len(layout.sizes) == 1:  # one threshold: no per-value tables (a tensor selected alone, e.g. a large one)
        mask = magnitudes.view(torch.int32) >= threshold_bits
        del magnitudes, samples
        counts = mask.sum(dtype=torch.int64).reshape(1)
    else:
        # Every value's threshold, without a per-value index: each segment's threshold minus the previous one
        # at the segment's start, then a running sum (exact: integers).
        per_value = torch.zeros(layout.total, dtype=torch.int32, device=values.device)
        per_value.index_copy_(
            0, layout.segment_starts, torch.diff(threshold_bits, prepend=threshold_bits.new_zeros(1))
        )
        per_value = per_value.cumsum_(0)
        mask = magnitudes.view(torch.int32) >= per_value
        del magnitudes, samples  # (read again from ``values`` where needed: abs is exact)
        running = torch.cumsum(mask, 0, dtype=torch.int32, out=per_value)
        ends = running[layout.segment_lasts].long()
        counts = torch.diff(ends, prepend=ends.new_zeros(1))
        del per_value, running
    host_counts = counts.tolist()
    # Rare: the sample put a segment's threshold above its k-th largest value. Such a segment takes its
    # exact top-k below instead, and leaves the candidates (no further synchronisation).
    short = [t for t, (c, k) in enumerate(zip(host_counts, layout.ks, strict=True)) if c < k]
    starts, k_starts = layout.starts, layout.k_starts
    for t in short:
        mask[starts[t] : starts[t + 1]] = False
        host_counts[t] = 0
    if short:
        counts = torch.where(counts < layout.k_per_segment, 0, counts)
    # Step 4: compact, order by (segment, magnitude), keep the first k of each segment.
    candidates = torch.nonzero_static(mask, size=sum(host_counts)).squeeze(1)
    segment_of = torch.repeat_interleave(torch.arange(len(layout.sizes), device=values.device), counts,
                                         output_size=candidates.numel())  # fmt: skip
    order = _order_by_segment(values[candidates].abs(), segment_of)
    first = (torch.cumsum(counts, 0) - counts)[layout.out_segment] + layout.out_within
    if candidates.numel():
        chosen = candidates[
            order[first.clamp_(max=candidates.numel() - 1)]
        ]  # (short segments' slots: filled below)
    else:
        chosen = torch.zeros(layout.k_total, dtype=torch.int64, device=values.device)
    for t in short:
        exact = torch.topk(values[starts[t] : starts[t + 1]].abs(), layout.ks[t], sorted=False).indices
        chosen[k_starts[t] : k_starts[t + 1]] = exact + starts[t]
    return chosen


def concatenated_ranges(starts: Sequence[int], lengths: Sequence[int], device: torch.device) -> Tensor:
    """The positions ``starts[j] .. starts[j] + lengths[j] - 1`` of every range j, concatenated, on ``device``
    (three kernels and one small copy to the device, whatever the number of ranges): ones, each range's jump
    from the previous range's last position written at its first, then a running sum in place, so that the
    result is the only value-sized tensor made (8 bytes a value)."""
    total, firsts, jumps, position, last = sum(lengths), [], [], 0, 0  # (the sum before the first: 0)
    for begin, length in zip(starts, lengths, strict=True):
        if length:
            firsts.append(position)
            jumps.append(begin - last)
            position, last = position + length, begin + length - 1
    out = torch.ones(total, dtype=torch.int64, device=device)
    if firsts:
        table = to_device([firsts, jumps], device)
        out.index_copy_(0, table[0], table[1])
    return out.cumsum_(0)


def to_device(values: Sequence[int] | Sequence[Sequence[int]] | Tensor, device: torch.device) -> Tensor:
    """Python integers (or an int64 CPU tensor) as an int64 tensor on ``device``, copied from pinned memory
    without stalling the host."""
    host = values if isinstance(values, Tensor) else torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def topk_in_ranges(
    values: Tensor, starts: Sequence[int], sizes: Sequence[int], ks: Sequence[int], sample_ratio: float,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, SegmentLayout]:  # fmt: skip
    """Positions in ``values`` of the ``ks[j]`` largest magnitudes inside each range ``[starts[j], +sizes[j])``:
    the ranges are gathered into one buffer (only they are read; group by group, see :func:`segment_layout`)
    and selected with :func:`batched_topk`. Returns the positions, range by range, and the layout
    (``out_segment``: the range of each)."""
    layout = segment_layout(sizes, ks, sample_ratio, values.device)
    chosen = []
    for a, b, group in layout.groups or ((0, len(layout.sizes), layout),):
        gathered = values[concatenated_ranges(starts[a:b], sizes[a:b], values.device)]  # (positions: freed)
        shift = to_device([s - g for s, g in zip(starts[a:b], group.starts, strict=False)], values.device)
        chosen.append(batched_topk(gathered, group, generator).add_(shift[group.out_segment]))
        del gathered  # (one group's copy at a time)
    return (torch.cat(chosen) if len(chosen) > 1 else chosen[0]), layout
