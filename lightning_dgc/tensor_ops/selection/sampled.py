"""DGC's sampled-threshold top-k selection (Lin et al., 2018, section 3 and appendix).

Exact top-k over millions of values is slow; DGC instead estimates the magnitude threshold of the
top ``density`` fraction on a small random sample, keeps every value above it, and re-selects
exactly among those candidates when too many pass (hierarchical selection). Unlike the authors'
code, the result here always holds exactly ``k`` indices, so every rank sends a payload of the
same size and a plain all-gather suffices.

Whatever the sample, the result is the exact top-k set (up to ties at the k-th magnitude): every
value at or above the threshold is a candidate and the re-selection among them is exact, and when too
few pass, the threshold is lowered or exact top-k runs. The sample only decides how fast that is.

The threshold pass is the only step that reads the whole tensor, so it decides the speed of large
tensors. On the CPU it runs in numpy on zero-copy views of the tensors (``torch.ge`` +
``torch.nonzero`` run at a fraction of memory bandwidth there): tensors up to ``DIRECT_NUMEL`` values
get their magnitudes computed once into a reused buffer; larger ones are compared chunk by chunk with
cache-sized scratch, and the few candidates are found by scanning the byte mask 8 bytes at a time.
Tensors under ``CPU_EXACT_NUMEL`` values skip sampling (an exact ``argpartition`` is cheaper there).
For the many mid-sized tensors (and DEFT's fragments) the fixed cost of a call matters as much: the
sample positions are drawn into a reused tensor and every view of the scratch buffers is made once per
tensor size, so a call is little more than the dozen numpy operations that do the work. On other
devices (and for dtypes numpy lacks) the same steps run in torch. Scratch buffers live in a
:class:`SelectionWorkspace` reused across calls (the calling thread's own unless one is passed).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from lightning_dgc.tensor_ops.selection.topk import topk_among, topk_indices
from lightning_dgc.tensor_ops.selection.workspace import (
    CHUNK,
    DIRECT_NUMEL,
    SelectionWorkspace,
    _block,
    default_workspace,
)

__all__ = [
    "CHUNK",
    "CPU_EXACT_NUMEL",
    "DIRECT_NUMEL",
    "EXACT_NUMEL",
    "MAX_LOWERINGS",
    "MIN_SAMPLES",
    "SCAN_NUMEL",
    "THRESHOLD_MARGIN",
    "SelectionWorkspace",
    "default_workspace",
    "sampled_topk",
    "sampled_topk_of",
]

#: Fewest values drawn for the sample, so that small tensors still get a usable threshold.
MIN_SAMPLES = 256
#: How many times the threshold is lowered (each time to a lower sample quantile) before giving up
#: on sampling and running exact top-k; every lowering at least doubles the expected candidates.
MAX_LOWERINGS = 4

#: The first threshold is set this many standard deviations (of the number of sampled values above
#: the k-th largest magnitude, about Poisson) *below* the plain estimate: at the plain estimate about
#: half of all tensors come up short and need a second pass over the whole tensor; with the margin
#: that happens for a few in a thousand, at the price of more candidates (1.6-3x k for typical
#: tensors), among which the exact re-selection is cheap.
THRESHOLD_MARGIN = 3.0
#: Tensors with fewer values go straight to exact top-k: sampling's fixed cost (a dozen small
#: operations) exceeds a ``torch.topk`` over so few values, and the result would be the exact top-k
#: anyway. About where both cost the same for the torch path.
EXACT_NUMEL = 1 << 15
#: The same for the CPU (numpy) path, whose exact top-k is an ``argpartition`` of the magnitudes:
#: about where it and the sampled pass cost the same, measured on tensors not in cache.
CPU_EXACT_NUMEL = 1 << 14
#: Above this many values the direct CPU pass finds the candidates 8 mask bytes at a time
#: (:func:`_scan_mask`: a dozen small numpy calls, but a quarter of the memory traffic); below, one
#: ``nonzero`` on the byte mask costs no more. (The chunked pass always scans.)
SCAN_NUMEL = 1 << 17

#: Dtypes whose threshold pass runs in numpy on CPU (numpy has no bfloat16; its float16 is slow).
_NUMPY_DTYPES = (torch.float32, torch.float64)
_NUMPY_OF = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64)}
_INT64 = np.dtype(np.int64)

Backend = Literal["auto", "numpy", "torch"]


def sampled_topk(
    values: Tensor,
    k: int,
    sample_ratio: float = 0.01,
    generator: torch.Generator | None = None,
    magnitudes: Tensor | None = None,
    *,
    workspace: SelectionWorkspace | None = None,
    backend: Backend = "auto",
) -> Tensor:
    """Indices (int64) of exactly ``k`` entries of the 1-D ``values`` with the largest magnitudes.

    Tensors with fewer than ``CPU_EXACT_NUMEL`` values on the CPU path (an ``argpartition`` of the
    magnitudes), or ``EXACT_NUMEL`` on the torch path (``torch.topk``), go to exact top-k directly,
    without drawing. Otherwise:
    1. draw ``s = max(sample_ratio * n, MIN_SAMPLES)`` positions uniformly (with replacement); about
       ``mu = k * s / n`` sampled magnitudes lie above the k-th largest magnitude of the tensor, so
       the ``ceil(mu + THRESHOLD_MARGIN * sqrt(mu))``-th largest sampled magnitude is the threshold
       (the margin makes a threshold above the k-th largest magnitude rare);
    2. every value whose magnitude is at or above the threshold is a candidate;
    3. at least ``k`` candidates: exact top-k among the candidates (the result is then the exact
       top-k of the tensor, since every value above the threshold is a candidate);
       fewer than ``k``: lower the threshold to a lower sample quantile (doubling the rank) and
       retry, at most ``MAX_LOWERINGS`` times, then fall back to exact top-k over the whole tensor.

    Args:
        values: The 1-D tensor to select from (DGC's velocity); it is only read.
        k: How many indices to return; ``k >= numel`` returns every index in order, ``k <= 0`` none.
        sample_ratio: Fraction of the values sampled to estimate the threshold, in (0, 1].
        generator: Source of the sample positions (a CPU generator works for any device).
        magnitudes: Optional precomputed ``values.abs()`` (for example a preallocated buffer the
            caller filled anyway); the threshold pass then reads it instead of ``values``.
        workspace: The :class:`SelectionWorkspace` whose buffers are reused; by default the calling
            thread's own (:func:`default_workspace`) on the CPU path, fresh tensors on the torch path.
        backend: ``"auto"`` (numpy for float32/float64 CPU tensors, torch otherwise), ``"numpy"``
            or ``"torch"``. Both give the same indices for the same generator state (up to ties at
            the k-th largest magnitude, which they may break differently).

    Returns:
        ``k`` distinct int64 indices into ``values`` (unsorted), on ``values``' device. The result is
        a fresh tensor (on the CPU path, over a numpy array); nothing in it aliases the workspace.
    """
    n = values.numel()
    if k >= n or k <= 0:
        return topk_indices(values, k)
    if backend == "auto" and magnitudes is None:  # the hot path, without a call
        use_numpy = values.is_cpu and values.dtype in _NUMPY_DTYPES and values.dim() == 1
    else:
        use_numpy = _use_numpy(values, magnitudes, backend)
    if use_numpy:
        source = values if magnitudes is None else magnitudes
        source = source.detach() if source.requires_grad else source
        workspace = workspace if workspace is not None else default_workspace()
        if n < CPU_EXACT_NUMEL:
            return _topk_numpy(source.numpy(), k, workspace)
        return _sampled_topk_numpy(source, k, sample_ratio, generator, workspace)
    if n < EXACT_NUMEL:
        return topk_indices(values, k)
    num_samples = min(n, max(math.ceil(n * sample_ratio), MIN_SAMPLES))
    # Positions are drawn on the generator's device (the run's generator is a CPU one) and moved.
    sample_device = generator.device if generator is not None else values.device
    positions = _draw_positions(
        torch.empty(num_samples, dtype=torch.int64, device=sample_device), n, generator
    )
    rank = _threshold_rank(k, n, num_samples)
    return _sampled_topk_torch(values, k, positions.to(values.device), rank, magnitudes, workspace)


def _threshold_rank(k: int, n: int, num_samples: int) -> int:
    """Which sampled magnitude (counted from the largest) is the first threshold: see step 1."""
    expected = k * num_samples / n  # sampled magnitudes above the k-th largest, on average
    return min(num_samples, max(1, math.ceil(expected + THRESHOLD_MARGIN * math.sqrt(expected))))


def _draw_positions(out: Tensor, n: int, generator: torch.Generator | None) -> Tensor:
    """Fill ``out`` (on the generator's device) with positions drawn uniformly from ``[0, n)``, with
    replacement; returns it."""
    return out.random_(0, n, generator=generator)


def _topk_numpy(x: np.ndarray, k: int, workspace: SelectionWorkspace) -> Tensor:
    """Exact top-k of a small CPU array: ``argpartition`` of the magnitudes in a reused buffer.

    A handful of numpy calls, where ``torch.topk`` costs more on CPU; ties at the k-th magnitude are
    broken by ``argpartition``. ``0 < k < x.size``.
    """
    n = x.size
    magnitudes = np.abs(x, out=workspace.floats(n, x.dtype))
    return torch.from_numpy(magnitudes.argpartition(n - k)[n - k :])


def _use_numpy(values: Tensor, magnitudes: Tensor | None, backend: Backend) -> bool:
    numpy_ok = values.device.type == "cpu" and values.dtype in _NUMPY_DTYPES and values.dim() == 1
    if magnitudes is not None:
        numpy_ok = numpy_ok and magnitudes.device.type == "cpu" and magnitudes.dtype in _NUMPY_DTYPES
    if backend == "auto":
        return numpy_ok
    if backend == "numpy":
        if not numpy_ok:
            raise ValueError(
                f"backend='numpy' needs a 1-D float32 or float64 CPU tensor, got a {values.dim()}-D "
                f"{values.dtype} tensor on {values.device}; use backend='auto' or 'torch'"
            )
        return True
    if backend == "torch":
        return False
    raise ValueError(f"backend must be 'auto', 'numpy' or 'torch', got {backend!r}")


def _sampled_topk_numpy(
    source: Tensor,
    k: int,
    sample_ratio: float,
    generator: torch.Generator | None,
    workspace: SelectionWorkspace,
) -> Tensor:
    """Steps 1-3 on zero-copy numpy views of the CPU tensor ``source`` (the values or their magnitudes).

    Up to ``DIRECT_NUMEL`` values, the magnitudes of the whole tensor fit in cache: they are
    computed once and the sample, the comparison and the re-selection all read them. Larger tensors
    never get a magnitude array: see :func:`_candidates_chunked`. Every buffer and view comes from
    the workspace's :meth:`~SelectionWorkspace.layout` for this size: a selection costs a few
    microseconds per numpy call, several times more right after the pass has flushed the caches,
    so the calls here are kept to the few that do the work.
    """
    x = source.numpy()
    n = x.size
    num_samples = min(n, max(math.ceil(n * sample_ratio), MIN_SAMPLES))
    layout = workspace.layout(n, x.dtype, num_samples, n <= DIRECT_NUMEL)
    rank = _threshold_rank(k, n, num_samples)
    try:  # (no ``generator.device`` test up front: a device object per call costs several us cold)
        _draw_positions(layout.positions, n, generator)
    except RuntimeError:  # a generator on another device: drawn where it lives, then brought over
        if generator is None or generator.device.type == "cpu":
            raise
        layout.positions.copy_(_draw_positions(layout.positions.to(generator.device), n, generator))
    mags = layout.magnitudes
    if mags is not None:
        np.abs(x, out=mags)
        sample = mags.take(layout.sample_positions)
    else:
        sample = source.index_select(0, layout.positions).abs_().numpy()  # torch gathers many faster
    if mags is not None:

        def candidates_over(threshold: Any) -> np.ndarray:
            np.greater_equal(mags, threshold, out=layout.mask_head)
            if n > SCAN_NUMEL:
                return _scan_mask(layout.mask, layout.flags, n)
            return layout.mask_head.nonzero()[0]

        def magnitudes_at(positions: np.ndarray) -> np.ndarray:
            return mags.take(positions)

    else:

        def candidates_over(threshold: Any) -> np.ndarray:
            return _candidates_chunked(x, threshold, workspace)

        def magnitudes_at(positions: np.ndarray) -> np.ndarray:
            return np.abs(x.take(positions))

    found = _threshold_search(sample, rank, k, candidates_over, magnitudes_at)
    return found if found is not None else topk_indices(source, k)


def _threshold_search(
    sample: np.ndarray,
    rank: int,
    k: int,
    candidates_over: Callable[[Any], np.ndarray],
    magnitudes_at: Callable[[np.ndarray], np.ndarray],
) -> Tensor | None:
    """Steps 1-3 of the sampled selection, from the sampled magnitudes (partitioned in place): the
    ``k`` indices, or ``None`` when no threshold found ``k`` candidates (the caller's exact fallback).

    ``candidates_over(threshold)`` gives the positions whose magnitude is at least ``threshold``, in
    increasing order; ``magnitudes_at(positions)`` their magnitudes.
    """
    num_samples = sample.size
    # Step 1: the rank-th largest sampled magnitude (a partial sort, in place; a full sort only if
    # the threshold has to be lowered). Methods rather than np.* functions: fewer Python layers.
    sample.partition(num_samples - rank)
    threshold = sample[num_samples - rank]
    sorted_sample: np.ndarray | None = None
    for _ in range(MAX_LOWERINGS + 1):
        candidates = candidates_over(threshold)  # Step 2: the candidates, in increasing order
        count = candidates.size
        if count >= k:  # Step 3: exact top-k among the candidates
            if count > k:
                candidates = candidates.take(magnitudes_at(candidates).argpartition(count - k)[count - k :])
            if candidates.dtype is not _INT64:  # nonzero gives intp: int64 on every 64-bit platform
                candidates = candidates.astype(np.int64)
            return torch.from_numpy(candidates)
        if rank >= num_samples:
            break
        rank = min(2 * rank, num_samples)
        if sorted_sample is None:
            sorted_sample = np.sort(sample)
        threshold = sorted_sample[num_samples - rank]
    return None


def sampled_topk_of(
    numel: int,
    dtype: torch.dtype,
    k: int,
    fill: Callable[[int, int, Tensor], object],
    take: Callable[[Tensor], Tensor],
    sample_ratio: float = 0.01,
    generator: torch.Generator | None = None,
    *,
    whole: Callable[[], Tensor],
    workspace: SelectionWorkspace | None = None,
) -> Tensor:
    """:func:`sampled_topk` of a 1-D CPU vector that is never made whole: the same indices, the same draws.

    For a vector computed from others elementwise (DGC's velocity ``v'`` from ``g``, ``u`` and ``v``),
    which would otherwise be a temporary of the tensor's size: ``fill(start, stop, out)`` writes its values
    ``start:stop`` into ``out`` (a CPU tensor of ``stop - start`` values of ``dtype``) and ``take(positions)``
    returns its values at ``positions`` (int64, CPU). Both must give, bit for bit, the values of the whole
    vector (an elementwise computation does, whatever the split). ``whole()`` makes it whole, for the rare
    fallback to exact top-k. Vectors of at most ``DIRECT_NUMEL`` values (whose pass keeps every magnitude),
    or under ``CPU_EXACT_NUMEL``, and dtypes other than float32/float64 are made whole and selected by
    :func:`sampled_topk`.
    """
    if numel <= DIRECT_NUMEL or numel < CPU_EXACT_NUMEL or k >= numel or k <= 0 or dtype not in _NUMPY_DTYPES:
        return sampled_topk(whole(), k, sample_ratio, generator, workspace=workspace, backend="auto")
    workspace = workspace if workspace is not None else default_workspace()
    num_samples = min(numel, max(math.ceil(numel * sample_ratio), MIN_SAMPLES))
    layout = workspace.layout(numel, _NUMPY_OF[dtype], num_samples, False)
    rank = _threshold_rank(k, numel, num_samples)
    try:
        _draw_positions(layout.positions, numel, generator)
    except RuntimeError:  # a generator on another device: drawn where it lives, then brought over
        if generator is None or generator.device.type == "cpu":
            raise
        layout.positions.copy_(_draw_positions(layout.positions.to(generator.device), numel, generator))
    sample = take(layout.positions).abs_().numpy()
    # the steps of _sampled_topk_numpy's chunked pass, on fill/take
    found = _threshold_search(
        sample,
        rank,
        k,
        lambda threshold: _candidates_chunked(None, threshold, workspace, numel, dtype, fill),
        lambda positions: take(torch.from_numpy(positions)).abs_().numpy(),
    )
    return found if found is not None else topk_indices(whole(), k)


def _candidates_chunked(
    x: np.ndarray | None,
    threshold: np.floating,
    workspace: SelectionWorkspace,
    numel: int = 0,
    dtype: torch.dtype = torch.float32,
    fill: Callable[[int, int, Tensor], object] | None = None,
) -> np.ndarray:
    """Positions of every value of ``x`` with magnitude at least ``threshold``, in increasing order.

    Chunk by chunk, ``|x|`` goes into a cache-sized scratch and its comparison with the threshold
    into the reused byte mask, so the only traffic to memory is reading ``x`` and writing one byte
    per value; :func:`_scan_mask` then finds the few candidates of each block of about
    ``DIRECT_NUMEL`` values. The mask covers one block, not the tensor: the workspace stays about
    ``1.1 * DIRECT_NUMEL`` bytes whatever the largest tensor (a byte per value of the largest tensor
    would be a tenth of its size, held for the whole run). Without ``x``, ``fill`` writes each chunk of
    the ``numel`` values (of ``dtype``) into the scratch first (:func:`sampled_topk_of`).
    """
    n = x.size if x is not None else numel
    block = _block(n)
    mask, flags = workspace.mask(block)  # 8 * ceil(block / 8) bytes, and ceil(block / 8)
    scratch = workspace.floats(CHUNK, x.dtype if x is not None else _NUMPY_OF[dtype])
    found = []
    for first in range(0, n, block):
        last = min(n, first + block)
        for start in range(first, last, CHUNK):
            stop = min(last, start + CHUNK)
            if x is not None:
                magnitude = np.abs(x[start:stop], out=scratch[: stop - start])
            else:
                assert fill is not None
                fill(start, stop, torch.from_numpy(scratch[: stop - start]))
                magnitude = np.abs(scratch[: stop - start], out=scratch[: stop - start])
            np.greater_equal(magnitude, threshold, out=mask[start - first : stop - first])
        words = -(-(last - first) // 8)
        positions = _scan_mask(mask[: 8 * words], flags[:words], last - first)
        if first:
            positions += first
        found.append(positions)
    return found[0] if len(found) == 1 else np.concatenate(found)


def _scan_mask(mask: np.ndarray, flags: np.ndarray, n: int) -> np.ndarray:
    """Positions of the true bytes among the first ``n`` of ``mask`` (``8 * len(flags)`` bytes).

    Scans 8 bytes at a time (a uint64 view) into ``flags`` and expands only the words holding a
    candidate: with candidates a fraction of a per cent of the values, that is several times
    cheaper than ``np.flatnonzero`` on the byte mask, which looks at every byte.
    """
    if n & 7:
        mask[n:] = False  # the tail of the last word
    words = mask.view(np.uint64)
    np.not_equal(words, 0, out=flags)
    hit_words = flags.nonzero()[0]
    hits = words.take(hit_words).view(np.bool_).nonzero()[0]  # positions within the hit words
    positions = hit_words.take(hits >> 3)
    positions <<= 3
    positions += hits & 7
    return positions


def _sampled_topk_torch(
    values: Tensor,
    k: int,
    positions: Tensor,
    rank: int,
    magnitudes: Tensor | None,
    workspace: SelectionWorkspace | None,
) -> Tensor:
    """Steps 1-3 in torch (any device); no host synchronisation except reading the candidate count."""
    n = values.numel()
    if magnitudes is not None:
        mags = magnitudes
    elif workspace is not None:
        mags = torch.abs(values, out=workspace.magnitudes(values, n))
    else:
        mags = values.abs()
    sample = mags.index_select(0, positions)
    num_samples = sample.numel()
    # The thresholds of every lowering at once: the top (rank << MAX_LOWERINGS) samples, sorted.
    top = torch.topk(sample, min(num_samples, rank << MAX_LOWERINGS), sorted=True).values
    for _ in range(MAX_LOWERINGS + 1):
        threshold = top[min(rank, num_samples) - 1]
        candidates = torch.nonzero(mags >= threshold).squeeze(1)
        if candidates.numel() >= k:
            return topk_among(mags, candidates, k)
        if rank >= num_samples:
            break
        rank *= 2
    return topk_indices(values, k)
