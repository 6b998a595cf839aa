"""DGC's sampled-threshold top-k selection (Lin et al., 2018, section 3 and appendix).

Exact top-k over millions of values is slow; DGC instead estimates the magnitude threshold of the
top ``density`` fraction on a small random sample, keeps every value above it, and re-selects
exactly among those candidates when too many pass (hierarchical selection). Unlike the authors'
code, the result here always holds exactly ``k`` indices, so every rank sends a payload of the
same size and a plain all-gather suffices.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_dgc.compression.topk import topk_among, topk_indices

#: Fewest values drawn for the sample, so that small tensors still get a usable threshold.
MIN_SAMPLES = 256
#: How many times the threshold is lowered (each time to a lower sample quantile) before giving up
#: on sampling and running exact top-k; every lowering at least doubles the expected candidates.
MAX_LOWERINGS = 4


def sampled_topk(
    values: Tensor,
    k: int,
    sample_ratio: float = 0.01,
    generator: torch.Generator | None = None,
    magnitudes: Tensor | None = None,
) -> Tensor:
    """Indices (int64) of exactly ``k`` entries of the 1-D ``values`` with (near-)largest magnitude.

    Steps:
    1. draw ``max(sample_ratio * n, MIN_SAMPLES)`` positions uniformly (with replacement) and take
       the magnitude of the ``ceil(k * samples / n)``-th largest sampled value as the threshold;
    2. every value at or above the threshold is a candidate;
    3. more than ``k`` candidates: exact top-k among the candidates (the result is then the exact
       top-k of the tensor, since every value above the threshold is a candidate);
       fewer than ``k``: lower the threshold to a lower sample quantile and retry, at most
       ``MAX_LOWERINGS`` times, then fall back to exact top-k over the whole tensor.

    ``magnitudes`` may pass a precomputed ``values.abs()`` (a preallocated buffer) to save a pass.
    """
    n = values.numel()
    if k >= n or k <= 0:
        return topk_indices(values, k)
    mags = values.abs() if magnitudes is None else magnitudes
    num_samples = min(n, max(math.ceil(n * sample_ratio), MIN_SAMPLES))
    positions = torch.randint(0, n, (num_samples,), generator=generator, device=values.device)
    sample = mags.index_select(0, positions)
    sample_sorted = torch.sort(sample, descending=True).values
    rank = max(1, math.ceil(k * num_samples / n))
    for _ in range(MAX_LOWERINGS + 1):
        threshold = sample_sorted[min(rank, num_samples) - 1]
        candidates = torch.nonzero(mags >= threshold).squeeze(1)
        if candidates.numel() >= k:
            return topk_among(mags, candidates, k)
        if rank >= num_samples:
            break
        rank *= 2
    return topk_indices(values, k)
