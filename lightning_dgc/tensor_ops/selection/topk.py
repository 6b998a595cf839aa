"""Exact top-k selection by magnitude.

The reference selection: it is exact but slow on CPU (``torch.topk`` runs at a fraction of memory
bandwidth), so :func:`lightning_dgc.tensor_ops.selection.sampled.sampled_topk` is the default on the hot path; it
calls these functions for tensors too small for sampling to pay off, and falls back to them when
sampling cannot guarantee exactly ``k`` values.
"""

from __future__ import annotations

import torch
from torch import Tensor


def topk_indices(values: Tensor, k: int) -> Tensor:
    """Indices (int64) of the ``k`` entries of the 1-D tensor ``values`` with the largest magnitude.

    ``k`` is clamped to ``[0, values.numel()]``; with ``k >= numel`` every index is returned in order.
    """
    n = values.numel()
    if k >= n:
        return torch.arange(n, device=values.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=values.device)
    return torch.topk(values.abs(), k, sorted=False).indices


def topk_among(magnitudes: Tensor, candidates: Tensor, k: int) -> Tensor:
    """The ``k`` of ``candidates`` (indices into ``magnitudes``) whose magnitudes are largest.

    This is the second level of DGC's hierarchical selection: the threshold found on a sample
    admits a few more than ``k`` candidates, and exact top-k among those few is cheap.
    """
    if candidates.numel() <= k:
        return candidates
    chosen = torch.topk(magnitudes.index_select(0, candidates), k, sorted=False).indices
    return candidates.index_select(0, chosen)
