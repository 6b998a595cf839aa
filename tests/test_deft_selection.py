"""DEFT's partitioned selection (lightning_dgc.tensor_ops.selection.partitioned) on one CPU tensor, all ranks simulated."""

from __future__ import annotations

import pytest
import torch

from lightning_dgc.algorithms.deft_partition import (
    Fragment,
    allocate_k,
    fragment_layers,
    lpt_assign,
    selection_cost,
)
from lightning_dgc.tensor_ops.selection.partitioned import deft_select, fragment_norms
from lightning_dgc.tensor_ops.selection.sampled import sampled_topk

WORLD_SIZE = 4


def _plan(
    generator: torch.Generator, world_size: int = WORLD_SIZE, rotation: int = 0
) -> tuple[torch.Tensor, list[Fragment], list[int], torch.Tensor]:
    """A random model's velocity and the full DEFT plan for it, as every rank would compute it."""
    num_layers = int(torch.randint(1, 10, (1,), generator=generator))
    numels = torch.randint(1, 400, (num_layers,), generator=generator).tolist()
    numels[0] *= 20  # a big layer that gets split
    names = [f"layer{i}.weight" for i in range(num_layers)]
    velocity = torch.randn(sum(numels), generator=generator) * torch.rand(sum(numels), generator=generator)
    fragments = fragment_layers(names, numels, world_size)
    density = float(torch.empty(1).uniform_(0.001, 0.3, generator=generator))
    k_total = max(len(fragments), round(density * velocity.numel()))
    ks = allocate_k(fragment_norms(velocity, fragments), [f.numel for f in fragments], k_total)
    owners = lpt_assign(selection_cost([f.numel for f in fragments], ks), world_size, rotation)
    return velocity, fragments, owners, ks


def test_ranks_select_disjoint_sets_that_together_hold_k_total() -> None:
    generator = torch.Generator().manual_seed(0)
    for step in range(30):
        velocity, fragments, owners, ks = _plan(generator, rotation=step)
        per_rank = [deft_select(velocity, fragments, owners, ks, rank) for rank in range(WORLD_SIZE)]
        counts = [len(indices) for indices, _ in per_rank]
        union = torch.cat([indices for indices, _ in per_rank]).unique()
        assert len(union) == sum(counts) == int(ks.sum())
        for rank, (indices, values) in enumerate(per_rank):
            assert indices.dtype == torch.int64 and values.dtype == velocity.dtype
            assert torch.equal(values, velocity[indices])
            selected = set(indices.tolist())
            for fragment, owner, k in zip(fragments, owners, ks.tolist(), strict=True):
                inside = {i for i in selected if fragment.offset <= i < fragment.stop}
                assert len(inside) == (k if owner == rank else 0)
            assert sum(k for owner, k in zip(owners, ks.tolist(), strict=True) if owner == rank) == len(
                selected
            )


def test_each_fragment_yields_its_largest_magnitudes() -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(20):
        velocity, fragments, owners, ks = _plan(generator)
        for rank in range(WORLD_SIZE):
            indices, _ = deft_select(velocity, fragments, owners, ks, rank)
            for fragment, owner in zip(fragments, owners, strict=True):
                if owner != rank:
                    continue
                magnitude = velocity[fragment.offset : fragment.stop].abs()
                chosen = torch.zeros_like(magnitude, dtype=torch.bool)
                local = indices[(indices >= fragment.offset) & (indices < fragment.stop)] - fragment.offset
                chosen[local] = True
                if bool((~chosen).any()):
                    assert magnitude[chosen].min() >= magnitude[~chosen].max()


def test_output_is_grouped_by_fragment_in_fragment_order() -> None:
    velocity = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.3, 0.0, 7.0, -1.0])
    fragments = [Fragment("a", 0, 3), Fragment("b", 3, 2), Fragment("c", 5, 3)]
    indices, values = deft_select(velocity, fragments, owners=[0, 1, 0], ks=[2, 1, 1], rank=0)
    assert sorted(indices[:2].tolist()) == [1, 2]
    assert indices[2:].tolist() == [6]
    assert torch.equal(values, velocity[indices])
    indices, values = deft_select(velocity, fragments, owners=[0, 1, 0], ks=torch.tensor([2, 1, 1]), rank=1)
    assert indices.tolist() == [3] and values.tolist() == [3.0]


def test_ties_still_give_exactly_k_distinct_elements_per_fragment() -> None:
    velocity = torch.ones(100)
    velocity[::2] = -1.0
    fragments = fragment_layers(["w", "b"], [90, 10], 2)
    owners, ks = [0, 1, 1], [7, 5, 3]
    indices, _ = deft_select(velocity, fragments, owners, ks, rank=1)
    assert len(set(indices.tolist())) == 8
    assert sum(1 for i in indices.tolist() if i >= 90) == 3


def test_rank_without_fragments_and_zero_k_select_nothing() -> None:
    velocity = torch.randn(10, dtype=torch.float64)
    fragments = fragment_layers(["a", "b"], [4, 6], 2)
    indices, values = deft_select(velocity, fragments, [0, 0, 0], [1, 2, 3], rank=1)
    assert indices.shape == (0,) and indices.dtype == torch.int64
    assert values.shape == (0,) and values.dtype == torch.float64
    indices, _ = deft_select(velocity, fragments, [0, 0, 0], [0, 2, 0], rank=0)
    assert len(indices) == 2 and all(4 <= i < 7 for i in indices.tolist())


def test_workspace_is_used_and_gives_the_same_selection() -> None:
    generator = torch.Generator().manual_seed(2)
    velocity, fragments, owners, ks = _plan(generator)
    workspace = torch.empty(velocity.numel())
    for rank in range(WORLD_SIZE):
        plain = deft_select(velocity, fragments, owners, ks, rank)
        reused = deft_select(velocity, fragments, owners, ks, rank, workspace=workspace)
        assert torch.equal(plain[0].sort().values, reused[0].sort().values)
        assert torch.equal(reused[1], velocity[reused[0]])
    with pytest.raises(ValueError, match="larger"):
        deft_select(velocity, fragments, owners, ks, owners[0], workspace=torch.empty(1))
    with pytest.raises(ValueError, match="float32"):
        deft_select(
            velocity,
            fragments,
            owners,
            ks,
            owners[0],
            workspace=torch.empty(velocity.numel(), dtype=torch.float16),
        )


def _assert_top_k_of_each_fragment(
    velocity: torch.Tensor, indices: torch.Tensor, fragments: list[Fragment], owned_ks: dict[int, int]
) -> None:
    """Per fragment: exactly its k (0 if not owned), and no unchosen magnitude above a chosen one."""
    chosen_all = set(indices.tolist())
    for i, fragment in enumerate(fragments):
        magnitude = velocity[fragment.offset : fragment.stop].abs().float()
        chosen = torch.zeros(fragment.numel, dtype=torch.bool)
        local = [j - fragment.offset for j in chosen_all if fragment.offset <= j < fragment.stop]
        chosen[local] = True
        assert len(local) == owned_ks.get(i, 0)
        if local and bool((~chosen).any()):
            assert magnitude[chosen].min() >= magnitude[~chosen].max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_selector_path_gives_the_exact_selection_grouped_by_fragment(dtype: torch.dtype) -> None:
    """With DGC's sampled selector (numpy bookkeeping on CPU for float32/64, torch for bfloat16), every
    rank gets each owned fragment's exact top-k, in fragment order, with the values at those indices."""
    generator = torch.Generator().manual_seed(9)
    numels = [40_000, 3_000, 70_000, 500]  # the big ones are split, some ranks own several fragments
    velocity = torch.randn(sum(numels), generator=generator).to(dtype)
    fragments = fragment_layers([f"l{i}" for i in range(len(numels))], numels, WORLD_SIZE)
    ks = allocate_k(fragment_norms(velocity.float(), fragments), [f.numel for f in fragments], 120)
    owners = lpt_assign(selection_cost([f.numel for f in fragments], ks), WORLD_SIZE)

    def selector(values: torch.Tensor, k: int) -> torch.Tensor:
        return sampled_topk(values, k, 0.01, torch.Generator().manual_seed(k))

    for rank in range(WORLD_SIZE):
        indices, values = deft_select(velocity, fragments, owners, ks, rank, selector=selector)
        assert indices.dtype == torch.int64 and values.dtype == dtype
        assert torch.equal(values, velocity[indices])
        owned_ks = {
            i: int(k) for i, (owner, k) in enumerate(zip(owners, ks.tolist(), strict=True)) if owner == rank
        }
        _assert_top_k_of_each_fragment(velocity, indices, fragments, owned_ks)
        owned = [f for f, owner in zip(fragments, owners, strict=True) if owner == rank]
        firsts = [next(i for i, j in enumerate(indices.tolist()) if f.offset <= j < f.stop) for f in owned]
        assert firsts == sorted(firsts)  # grouped by fragment, in fragment order


def test_selector_results_of_any_integer_dtype_and_wrong_counts() -> None:
    velocity = torch.arange(20, dtype=torch.float32)
    fragments = [Fragment("a", 0, 10), Fragment("b", 10, 10)]
    top_int32 = lambda values, k: torch.topk(values.abs(), k).indices.int()  # noqa: E731
    for owners in ([0, 1], [0, 0]):  # one fragment, then two, per call
        indices, values = deft_select(velocity, fragments, owners, [2, 3], 0, selector=top_int32)
        assert indices.dtype == torch.int64
        want = {8, 9} | ({17, 18, 19} if owners == [0, 0] else set())
        assert set(indices.tolist()) == want and torch.equal(values, velocity[indices])
    with pytest.raises(ValueError, match="must return k"):
        deft_select(velocity, fragments, [0, 1], [2, 3], 0, selector=lambda values, k: torch.arange(k + 1))


def test_selector_path_with_a_velocity_that_requires_grad() -> None:
    velocity = torch.randn(50, generator=torch.Generator().manual_seed(3), requires_grad=True)
    fragments = fragment_layers(["w"], [50], 1)
    indices, values = deft_select(
        velocity, fragments, [0], [5], 0, selector=lambda v, k: v.abs().topk(k).indices
    )
    assert set(indices.tolist()) == set(velocity.detach().abs().topk(5).indices.tolist())
    assert torch.equal(values.detach(), velocity.detach()[indices])


def test_deft_select_rejects_bad_plans() -> None:
    velocity = torch.randn(10)
    fragments = fragment_layers(["a", "b"], [4, 6], 2)
    with pytest.raises(ValueError, match="exceeds"):
        deft_select(velocity, fragments, [0, 0, 0], [5, 1, 1], rank=0)
    with pytest.raises(ValueError, match="one of each"):
        deft_select(velocity, fragments, [0, 0], [1, 1, 1], rank=0)
    with pytest.raises(ValueError, match="1-D"):
        deft_select(velocity.view(2, 5), fragments, [0, 0, 0], [1, 1, 1], rank=0)
    with pytest.raises(ValueError, match="past"):
        deft_select(velocity[:8], fragments, [0, 0, 0], [1, 1, 1], rank=0)


# ----------------------------------------------------------------------------------------------------------
# fragment_norms


def test_fragment_norms_match_per_fragment_norms() -> None:
    generator = torch.Generator().manual_seed(3)
    for _ in range(10):
        velocity, fragments, _, _ = _plan(generator)
        norms = fragment_norms(velocity, fragments)
        expected = torch.stack([velocity[f.offset : f.stop].norm() for f in fragments])
        assert norms.dtype == torch.float32 and norms.shape == (len(fragments),)
        torch.testing.assert_close(norms, expected)


def test_fragment_norms_on_a_sub_range_and_on_scattered_fragments() -> None:
    velocity = torch.arange(10, dtype=torch.float64)
    consecutive = [Fragment("a", 2, 3), Fragment("a", 5, 2)]  # [2, 3, 4], [5, 6]
    scattered = [Fragment("b", 7, 3), Fragment("a", 0, 2)]  # [7, 8, 9], [0, 1]
    norms = fragment_norms(velocity, consecutive)
    assert norms.dtype == torch.float64
    torch.testing.assert_close(norms, torch.tensor([29.0, 61.0], dtype=torch.float64).sqrt())
    torch.testing.assert_close(
        fragment_norms(velocity, scattered), torch.tensor([194.0, 1.0], dtype=torch.float64).sqrt()
    )
    assert fragment_norms(velocity, []).shape == (0,)
    with pytest.raises(ValueError, match="past"):
        fragment_norms(velocity[:6], consecutive)


def test_fragment_norms_of_half_precision_do_not_overflow() -> None:
    velocity = torch.full((8,), 1000.0, dtype=torch.float16)  # 1000**2 overflows float16
    norms = fragment_norms(velocity, fragment_layers(["w"], [8], 1))
    assert norms.dtype == torch.float32
    torch.testing.assert_close(norms, torch.tensor([1000.0 * 8**0.5]))


def test_fragment_norms_with_workspace() -> None:
    generator = torch.Generator().manual_seed(4)
    velocity, fragments, _, _ = _plan(generator)
    workspace = torch.empty(velocity.numel() + 5)
    torch.testing.assert_close(
        fragment_norms(velocity, fragments, workspace=workspace), fragment_norms(velocity, fragments)
    )
    with pytest.raises(ValueError, match="larger"):
        fragment_norms(velocity, fragments, workspace=torch.empty(3))


def test_zero_velocity_gives_zero_norms_and_a_plan_by_size() -> None:
    velocity = torch.zeros(1000)
    fragments = fragment_layers(["a", "b"], [250, 750], 2)
    norms = fragment_norms(velocity, fragments)
    assert norms.tolist() == [0.0, 0.0, 0.0]
    ks = allocate_k(norms, [f.numel for f in fragments], 100)
    assert int(ks.sum()) == 100
    indices, values = deft_select(velocity, fragments, [0, 1, 0], ks, rank=0)
    assert len(indices) == int(ks[0] + ks[2]) and bool((values == 0).all())
