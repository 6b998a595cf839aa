"""Single-tensor math of the selection: exactly k, and the right k."""

from __future__ import annotations

import pytest
import torch

from lightning_dgc.compression import dgc as dgc_selection
from lightning_dgc.compression import sampled_topk, topk_among, topk_indices


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("n,k", [(1, 1), (10, 3), (5000, 5), (100_000, 100), (100_000, 1), (4096, 4096)])
@pytest.mark.parametrize("dist", ["normal", "heavy", "constant", "sparse"])
def test_both_selections_return_exactly_k_distinct_indices(n: int, k: int, dist: str) -> None:
    g = _gen(n + k)
    x = {
        "normal": lambda: torch.randn(n, generator=g),
        "heavy": lambda: torch.randn(n, generator=g) ** 5,
        "constant": lambda: torch.full((n,), 0.5),
        "sparse": lambda: torch.where(torch.rand(n, generator=g) < 0.0005, 1.0, 0.0),
    }[dist]()
    for idx in (topk_indices(x, k), sampled_topk(x, k, 0.01, g)):
        assert idx.numel() == k
        assert idx.unique().numel() == k
        assert int(idx.min()) >= 0 and int(idx.max()) < n


@pytest.mark.parametrize("seed", range(5))
def test_sampled_selection_is_exact_topk_when_threshold_admits_enough(seed: int) -> None:
    """Every value above the sampled threshold is a candidate, so re-selection gives the exact top-k set."""
    x = torch.randn(200_000, generator=_gen(seed))
    k = 200
    got = set(sampled_topk(x, k, 0.01, _gen(seed)).tolist())
    want = set(topk_indices(x, k).tolist())
    assert got == want


def test_sampled_selection_lowers_threshold_when_too_few_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sample that overestimates the threshold (all sampled values huge) still yields k indices."""
    x = torch.randn(50_000, generator=_gen(1))
    x[:300] = 1000.0  # 300 huge values; a sample of only these gives a threshold of 1000
    k = 500
    monkeypatch.setattr(dgc_selection, "MIN_SAMPLES", 1)
    idx = sampled_topk(x, k, 1e-4, _gen(0))
    assert idx.numel() == k
    assert set(range(300)) <= set(idx.tolist())


def test_topk_among_keeps_largest_candidates() -> None:
    mags = torch.tensor([5.0, 1.0, 7.0, 3.0, 9.0])
    cand = torch.tensor([0, 1, 2, 3])
    assert sorted(topk_among(mags, cand, 2).tolist()) == [0, 2]
    assert topk_among(mags, cand, 10).tolist() == [0, 1, 2, 3]


def test_selection_by_magnitude_not_sign() -> None:
    x = torch.tensor([0.1, -5.0, 2.0, -0.2])
    assert sorted(topk_indices(x, 2).tolist()) == [1, 2]
