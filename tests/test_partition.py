"""DEFT's plan (lightning_dgc.algorithms.deft_partition): fragments, k per fragment, LPT assignment, loads."""

from __future__ import annotations

import dataclasses
import itertools
import math
import pickle

import pytest
import torch

from lightning_dgc.algorithms.deft_partition import (
    FRAGMENT_COST,
    SELECTED_COST,
    Fragment,
    allocate_k,
    fragment_layers,
    lpt_assign,
    rank_loads,
    selection_cost,
)

# ----------------------------------------------------------------------------------------------------------
# fragment_layers


def _layer_starts(numels: list[int]) -> list[int]:
    return [sum(numels[:i]) for i in range(len(numels))]


def test_fragments_tile_the_flat_vector_on_random_layouts() -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        num_layers = int(torch.randint(1, 12, (1,), generator=generator))
        world_size = int(torch.randint(1, 9, (1,), generator=generator))
        numels = torch.randint(0, 500, (num_layers,), generator=generator).tolist()
        if torch.rand(1, generator=generator) < 0.5:  # one dominant layer, like an embedding
            numels[int(torch.randint(0, num_layers, (1,), generator=generator))] *= 50
        names = [f"layer{i}" for i in range(num_layers)]
        fragments = fragment_layers(names, numels, world_size)

        position = 0
        for fragment in fragments:  # consecutive, no gap, no overlap, nothing empty
            assert fragment.offset == position
            assert fragment.numel > 0
            position = fragment.stop
        assert position == sum(numels)

        starts = dict(zip(names, _layer_starts(numels), strict=True))
        sizes = dict(zip(names, numels, strict=True))
        for fragment in fragments:  # each fragment stays inside its own layer
            assert fragment.offset == starts[fragment.name] + fragment.layer_offset
            assert fragment.layer_offset + fragment.numel <= sizes[fragment.name]

        total = sum(numels)
        for name, numel in zip(names, numels, strict=True):
            pieces = [f for f in fragments if f.name == name]
            if numel == 0:
                assert pieces == []
            elif numel * world_size > total:
                assert len(pieces) == min(world_size, numel)
                assert max(f.numel for f in pieces) - min(f.numel for f in pieces) <= 1
            else:
                assert len(pieces) == 1 and pieces[0].numel == numel


def test_big_layer_is_split_into_world_size_pieces_and_small_ones_are_not() -> None:
    fragments = fragment_layers(["a", "b", "c"], [10, 100, 5], world_size=4)
    assert fragments == [
        Fragment("a", 0, 10, 0),
        Fragment("b", 10, 25, 0),
        Fragment("b", 35, 25, 25),
        Fragment("b", 60, 25, 50),
        Fragment("b", 85, 25, 75),
        Fragment("c", 110, 5, 0),
    ]


def test_split_sizes_differ_by_at_most_one_and_threshold_is_strict() -> None:
    # 25 * 4 == 100 == total: exactly a fair share, so "a" is not split; 75 > 100 / 4 is, as 19+19+19+18.
    fragments = fragment_layers(["a", "b"], [25, 75], world_size=4)
    assert [(f.name, f.numel) for f in fragments] == [("a", 25), ("b", 19), ("b", 19), ("b", 19), ("b", 18)]


def test_layer_with_fewer_elements_than_workers_gets_one_element_pieces() -> None:
    fragments = fragment_layers(["w"], [3], world_size=4)
    assert [(f.offset, f.numel, f.layer_offset) for f in fragments] == [(0, 1, 0), (1, 1, 1), (2, 1, 2)]


def test_single_worker_keeps_layers_whole() -> None:
    fragments = fragment_layers(["a", "b", "c"], [5, 0, 7], world_size=1)
    assert fragments == [Fragment("a", 0, 5, 0), Fragment("c", 5, 7, 0)]


def test_fragment_layers_is_pure_and_fragments_are_frozen_and_picklable() -> None:
    names, numels = ["x", "y", "z"], [1000, 3, 40]
    first = fragment_layers(names, numels, 3)
    again = fragment_layers(*pickle.loads(pickle.dumps((names, numels))), 3)
    assert first == again
    assert pickle.loads(pickle.dumps(first)) == first
    with pytest.raises(dataclasses.FrozenInstanceError):
        first[0].offset = 1  # type: ignore[misc]


def test_fragment_layers_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="one size per layer"):
        fragment_layers(["a"], [1, 2], 2)
    with pytest.raises(ValueError, match="world_size"):
        fragment_layers(["a"], [1], 0)
    with pytest.raises(ValueError, match="non-negative"):
        fragment_layers(["a"], [-1], 2)


# ----------------------------------------------------------------------------------------------------------
# allocate_k


def _reference_shares(norms: list[float], sizes: list[int], k_total: int) -> list[float]:
    """clip(lam * norm, 1, n) with the sum equal to k_total, lam by bisection (all norms positive)."""
    low, high = 0.0, 1.0
    while sum(min(max(high * w, 1.0), n) for w, n in zip(norms, sizes, strict=True)) < k_total:
        high *= 2.0
    for _ in range(200):
        middle = (low + high) / 2
        if sum(min(max(middle * w, 1.0), n) for w, n in zip(norms, sizes, strict=True)) < k_total:
            low = middle
        else:
            high = middle
    return [min(max(high * w, 1.0), n) for w, n in zip(norms, sizes, strict=True)]


def _random_case(generator: torch.Generator) -> tuple[torch.Tensor, list[int], int]:
    m = int(torch.randint(1, 25, (1,), generator=generator))
    sizes = torch.randint(1, 2000, (m,), generator=generator)
    sizes[torch.rand(m, generator=generator) < 0.2] = 1  # single-element fragments (biases)
    kind = int(torch.randint(0, 3, (1,), generator=generator))
    if kind == 0:
        norms = torch.rand(m, generator=generator, dtype=torch.float64)
    elif kind == 1:  # norms spanning many orders of magnitude, as between layers of a deep net
        norms = torch.pow(10.0, torch.empty(m, dtype=torch.float64).uniform_(-8, 3, generator=generator))
    else:
        norms = torch.rand(m, generator=generator, dtype=torch.float64)
        norms[torch.rand(m, generator=generator) < 0.3] = 0.0
    k_total = int(torch.randint(m, int(sizes.sum()) + 1, (1,), generator=generator))
    return norms, sizes.tolist(), k_total


def test_allocate_k_sums_exactly_and_respects_bounds_on_random_cases() -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(400):
        norms, sizes, k_total = _random_case(generator)
        ks = allocate_k(norms, sizes, k_total)
        assert ks.dtype == torch.int64 and ks.shape == (len(sizes),)
        assert int(ks.sum()) == k_total
        assert all(1 <= k <= n for k, n in zip(ks.tolist(), sizes, strict=True))


def test_allocate_k_is_within_one_of_the_exact_bounded_proportional_share() -> None:
    generator = torch.Generator().manual_seed(2)
    for _ in range(150):
        m = int(torch.randint(1, 15, (1,), generator=generator))
        sizes = torch.randint(1, 500, (m,), generator=generator).tolist()
        norms = (torch.rand(m, generator=generator, dtype=torch.float64) + 1e-3).tolist()
        k_total = int(torch.randint(m, sum(sizes) + 1, (1,), generator=generator))
        reference = _reference_shares(norms, sizes, k_total)
        ks = allocate_k(torch.tensor(norms), sizes, k_total).tolist()
        assert all(abs(k - x) < 1.0 + 1e-6 for k, x in zip(ks, reference, strict=True)), (ks, reference)


def test_allocate_k_exact_proportions_and_monotone_in_norm() -> None:
    assert allocate_k(torch.tensor([1.0, 2.0, 3.0, 4.0]), [1000] * 4, 100).tolist() == [10, 20, 30, 40]
    generator = torch.Generator().manual_seed(3)
    for _ in range(100):
        m = int(torch.randint(2, 30, (1,), generator=generator))
        norms = torch.rand(m, generator=generator)
        k_total = int(torch.randint(m, 64 * m + 1, (1,), generator=generator))
        ks = allocate_k(norms, [64] * m, k_total)
        ordered = ks[torch.argsort(norms)]
        assert bool((ordered[1:] >= ordered[:-1]).all()), (norms, ks)


def test_allocate_k_redistributes_what_clipping_removes_and_adds() -> None:
    # The first fragment would get 100 but holds 5; the other 100 are shared equally.
    assert allocate_k(torch.tensor([100.0, 1.0, 1.0]), [5, 1000, 1000], 105).tolist() == [5, 50, 50]
    # Tiny norm: raised to the floor of 1, paid for by the others.
    assert allocate_k(torch.tensor([1e-9, 1.0, 1.0]), [100, 100, 100], 21).tolist() == [1, 10, 10]


def test_allocate_k_largest_remainder_breaks_ties_by_lower_index() -> None:
    assert allocate_k(torch.ones(3), [10, 10, 10], 4).tolist() == [2, 1, 1]
    assert allocate_k(torch.ones(3), [10, 10, 10], 5).tolist() == [2, 2, 1]


def test_allocate_k_zero_norms() -> None:
    # All zero: shared by size.
    assert allocate_k(torch.zeros(2), [100, 300], 40).tolist() == [10, 30]
    # Some zero: they keep the minimum of 1.
    assert allocate_k(torch.tensor([0.0, 1.0]), [100, 100], 50).tolist() == [1, 49]
    # ... unless the others are full: the rest spills to the zero-norm fragments, by size.
    assert allocate_k(torch.tensor([0.0, 5.0, 0.0]), [100, 10, 300], 110).tolist() == [25, 10, 75]


def test_allocate_k_non_finite_and_negative_norms_count_as_zero() -> None:
    ks = allocate_k(torch.tensor([math.nan, 1.0, math.inf, -1.0, 3.0]), [50] * 5, 42)
    assert int(ks.sum()) == 42
    assert ks.tolist() == [1, 10, 1, 1, 29]
    ks = allocate_k(torch.full((3,), math.nan), [10, 20, 30], 12)  # nothing usable: by size
    assert ks.tolist() == [2, 4, 6]


def test_allocate_k_clamps_an_unreachable_budget_and_handles_empty_input() -> None:
    assert allocate_k(torch.rand(4), [3, 3, 3, 3], 2).tolist() == [1, 1, 1, 1]
    assert allocate_k(torch.rand(3), [3, 4, 5], 1000).tolist() == [3, 4, 5]
    assert allocate_k(torch.zeros(0), [], 10).tolist() == []


def test_allocate_k_accepts_tensor_sizes_and_is_deterministic() -> None:
    generator = torch.Generator().manual_seed(4)
    for _ in range(20):
        norms, sizes, k_total = _random_case(generator)
        first = allocate_k(norms, torch.tensor(sizes), k_total)
        again = allocate_k(*pickle.loads(pickle.dumps((norms, sizes, k_total))))
        assert torch.equal(first, again)
        assert torch.equal(first, allocate_k(norms.tolist(), sizes, k_total))


def test_allocate_k_rejects_mismatched_or_empty_fragments() -> None:
    with pytest.raises(ValueError, match="one norm per fragment"):
        allocate_k(torch.ones(2), [1, 2, 3], 3)
    with pytest.raises(ValueError, match="positive"):
        allocate_k(torch.ones(2), [0, 2], 2)


# ----------------------------------------------------------------------------------------------------------
# selection_cost, lpt_assign, rank_loads


def test_selection_cost_is_one_pass_plus_a_fixed_cost_per_fragment_and_a_little_per_value() -> None:
    fixed, per_value = FRAGMENT_COST, SELECTED_COST
    assert selection_cost([100, 100, 1000, 5_000_000], [1, 8, 1024, 5000]) == [
        100.0 + fixed + per_value,
        100.0 + fixed + 8 * per_value,
        1000.0 + fixed + 1024 * per_value,
        5_000_000.0 + fixed + 5000 * per_value,
    ]
    assert selection_cost(torch.tensor([7]), torch.tensor([1])) == [7.0 + fixed + per_value]
    assert selection_cost([], []) == []
    with pytest.raises(ValueError):
        selection_cost([1, 2], [1])


def test_selection_cost_grows_with_size_and_k_and_no_fragment_is_free() -> None:
    costs = selection_cost([1, 1, 2, 1000, 1000], [1, 2, 1, 1, 2])
    assert all(c > 0 for c in costs)
    assert costs[0] < costs[1] and costs[0] < costs[2] < costs[3] < costs[4]
    assert all(isinstance(c, float) for c in costs)


def test_many_small_fragments_are_shared_not_piled_on_the_least_loaded_rank() -> None:
    """Two big fragments of unequal size and 30 tiny ones, 2 workers: counting elements only, all tiny
    fragments go to the rank with the smaller big one (30 fixed costs on one rank); with the fixed
    cost in the model they are shared, and the rank loads in real time balance."""
    sizes = [1_000_000, 900_000] + [1_000] * 30
    ks = [1_000, 900] + [1] * 30
    elements_only = lpt_assign([float(n) for n in sizes], 2)
    assert [elements_only[i] for i in range(2, 32)].count(elements_only[1]) == 30  # the pile-up

    owners = lpt_assign(selection_cost(sizes, ks), 2)
    tiny_per_rank = [sum(1 for i in range(2, 32) if owners[i] == r) for r in range(2)]
    assert min(tiny_per_rank) >= 10
    assert owners[0] != owners[1]
    # Both ranks within one fragment's cost of each other, in the model's units.
    loads = rank_loads(selection_cost(sizes, ks), owners, 2)
    assert abs(loads[0] - loads[1]) <= max(selection_cost(sizes, ks))


def test_equal_work_gets_equal_fragment_counts_at_any_scale() -> None:
    """Pieces of split layers plus whole small layers, as fragment_layers makes them for a bucket: the
    number of fragments per rank differs by at most a few, so per-call costs are shared too."""
    numels = [2_359_296, 1_048_576, 589_824] + [16_384] * 12 + [65_536] * 8
    fragments = fragment_layers([f"l{i}" for i in range(len(numels))], numels, 8)
    sizes = [f.numel for f in fragments]
    ks = allocate_k(torch.ones(len(sizes)), sizes, sum(numels) // 1000)
    owners = lpt_assign(selection_cost(sizes, ks), 8)
    counts = [owners.count(r) for r in range(8)]
    assert max(counts) - min(counts) <= 2


def _optimal_makespan(costs: list[float], world_size: int) -> float:
    best = math.inf
    for assignment in itertools.product(range(world_size), repeat=len(costs)):
        loads = [0.0] * world_size
        for cost, owner in zip(costs, assignment, strict=True):
            loads[owner] += cost
        best = min(best, max(loads))
    return best


def test_lpt_assigns_every_fragment_once_and_meets_the_graham_bound() -> None:
    generator = torch.Generator().manual_seed(5)
    for _ in range(60):
        world_size = int(torch.randint(2, 4, (1,), generator=generator))
        m = int(torch.randint(1, 8, (1,), generator=generator))
        costs = torch.randint(1, 20, (m,), generator=generator).double().tolist()
        owners = lpt_assign(costs, world_size)
        assert len(owners) == m and all(0 <= owner < world_size for owner in owners)
        makespan = max(rank_loads(costs, owners, world_size))
        optimum = _optimal_makespan(costs, world_size)
        assert makespan <= (4 / 3 - 1 / (3 * world_size)) * optimum + 1e-9


def test_lpt_reaches_the_graham_bound_on_its_worst_case() -> None:
    costs = [3.0, 3.0, 2.0, 2.0, 2.0]  # optimum 6 ({3,3}, {2,2,2}); LPT gives 7 = (4/3 - 1/6) * 6
    owners = lpt_assign(costs, 2)
    assert owners == [0, 1, 0, 1, 0]
    assert rank_loads(costs, owners, 2) == [7.0, 5.0]


def test_lpt_makespan_is_at_most_average_plus_largest_on_large_cases() -> None:
    generator = torch.Generator().manual_seed(6)
    for _ in range(100):
        world_size = int(torch.randint(1, 33, (1,), generator=generator))
        m = int(torch.randint(0, 300, (1,), generator=generator))
        costs = (torch.rand(m, generator=generator, dtype=torch.float64) ** 4 * 1e6).tolist()
        owners = lpt_assign(costs, world_size)
        loads = rank_loads(costs, owners, world_size)
        assert len(owners) == m and all(0 <= owner < world_size for owner in owners)
        assert math.isclose(sum(loads), math.fsum(costs), rel_tol=1e-12, abs_tol=1e-9)
        if costs:
            assert max(loads) <= math.fsum(costs) / world_size + max(costs) + 1e-6


def test_lpt_ties_go_to_the_lower_index_and_lower_bin() -> None:
    assert lpt_assign([1.0, 1.0, 1.0, 1.0], 2) == [0, 1, 0, 1]
    assert lpt_assign([1.0, 5.0, 1.0], 3) == [1, 0, 2]
    assert lpt_assign([], 4) == []


def test_lpt_is_deterministic_including_after_pickling_the_inputs() -> None:
    generator = torch.Generator().manual_seed(7)
    sizes = torch.randint(1, 10_000, (80,), generator=generator).tolist()
    ks = allocate_k(torch.rand(80, generator=generator), sizes, 5000)
    costs = selection_cost(sizes, ks)
    first = lpt_assign(costs, 8, rotation=3)
    assert lpt_assign(costs, 8, rotation=3) == first
    assert lpt_assign(*pickle.loads(pickle.dumps((costs, 8))), rotation=3) == first


def test_rotation_moves_bins_between_ranks_but_keeps_the_loads() -> None:
    generator = torch.Generator().manual_seed(8)
    costs = torch.rand(50, generator=generator, dtype=torch.float64).tolist()
    world_size = 4
    base = lpt_assign(costs, world_size)
    base_loads = rank_loads(costs, base, world_size)
    for rotation in range(1, 9):
        rotated = lpt_assign(costs, world_size, rotation=rotation)
        assert rotated == [(owner + rotation) % world_size for owner in base]
        if rotation % world_size:
            assert rotated != base
        loads = rank_loads(costs, rotated, world_size)
        assert sorted(loads) == sorted(base_loads)
        assert loads == [base_loads[(r - rotation) % world_size] for r in range(world_size)]
    assert lpt_assign(costs, world_size, rotation=-1) == lpt_assign(costs, world_size, rotation=3)


def test_lpt_and_rank_loads_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="world_size"):
        lpt_assign([1.0], 0)
    with pytest.raises(ValueError, match="finite"):
        lpt_assign([1.0, math.nan], 2)
    with pytest.raises(ValueError, match="finite"):
        lpt_assign([-1.0], 2)
    with pytest.raises(ValueError, match="rank"):
        rank_loads([1.0], [2], 2)
    with pytest.raises(ValueError):
        rank_loads([1.0, 2.0], [0], 2)
