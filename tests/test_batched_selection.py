"""The batched selection (``selection_backend="torch"``): per segment, exactly its k largest magnitudes."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_dgc.algorithms.dgc import DGCConfig
from lightning_dgc.exchange import hook
from lightning_dgc.exchange.state import ExchangeState
from lightning_dgc.tensor_ops.selection import batched
from lightning_dgc.tensor_ops.selection.batched import (
    batched_topk,
    concatenated_ranges,
    segment_layout,
    topk_in_ranges,
)
from tests.test_selection import _values


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _per_segment(chosen: torch.Tensor, layout) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [chosen[a:b].tolist() for a, b in zip(layout.k_starts[:-1], layout.k_starts[1:], strict=True)]


@pytest.mark.parametrize("seed", range(3))
def test_every_segment_gets_exactly_its_top_k(seed: int) -> None:
    """Sizes from one value to 100k, k from 0 to all of a segment: each segment's slots hold its exact top-k."""
    sizes = [100_000, 1, 4096, 30_000, 7, 2048, 65_537]
    ks = [100, 1, 4096, 30, 3, 0, 66]
    g = _gen(seed)
    flat = torch.cat([torch.randn(n, generator=g) * (i + 1) for i, n in enumerate(sizes)])  # scales differ
    layout = segment_layout(sizes, ks, 0.01, flat.device)
    chosen = batched_topk(flat, layout, _gen(seed + 10))
    assert chosen.numel() == sum(ks) == layout.k_total
    for t, got in enumerate(_per_segment(chosen, layout)):
        start, stop = layout.starts[t], layout.starts[t + 1]
        want = torch.topk(flat[start:stop].abs(), ks[t]).indices + start
        assert sorted(got) == sorted(want.tolist()), t


@pytest.mark.parametrize("dist", ["heavy", "constant", "sparse"])
def test_ties_and_zeros_still_give_k_distinct_indices_inside_each_segment(dist: str) -> None:
    sizes, ks = [5000, 100_000, 4096], [5, 100, 4096]
    flat = torch.cat([_values(dist, n, _gen(n)) for n in sizes])
    layout = segment_layout(sizes, ks, 0.01, flat.device)
    for t, got in enumerate(_per_segment(batched_topk(flat, layout, _gen(0)), layout)):
        assert len(set(got)) == ks[t]
        assert all(layout.starts[t] <= i < layout.starts[t + 1] for i in got)
        kth = torch.topk(flat[layout.starts[t] : layout.starts[t + 1]].abs(), ks[t]).values.min()
        assert bool((flat[got].abs() >= kth).all())  # ties at the k-th value: any of them will do


def test_a_threshold_set_too_high_falls_back_to_the_exact_top_k() -> None:
    """The rare case, forced: a segment's threshold is its largest sample, so fewer than k values pass.
    That segment takes its exact top-k; the others keep their candidates."""
    sizes, ks = [50_000, 20_000], [500, 20]
    flat = torch.randn(sum(sizes), generator=_gen(3))
    layout = segment_layout(sizes, ks, 0.01, flat.device)
    # samples are sorted by segment, then descending: sample 0 is segment 0's largest
    forced = dataclasses.replace(layout, threshold_at=torch.tensor([0, int(layout.threshold_at[1])]))
    draws = torch.rand(
        layout.sample_scale.numel(), generator=_gen(1), dtype=torch.float64
    )  # the call's draws
    sampled = flat.abs()[(draws * layout.sample_scale).long() + layout.sample_base][
        layout.sample_segment == 0
    ]
    assert int((flat[: sizes[0]].abs() >= sampled.max()).sum()) < ks[0]  # what makes segment 0 short
    chosen = batched_topk(flat, forced, _gen(1))
    for t, got in enumerate(_per_segment(chosen, forced)):
        start, stop = layout.starts[t], layout.starts[t + 1]
        assert sorted(got) == sorted((torch.topk(flat[start:stop].abs(), ks[t]).indices + start).tolist())


def test_non_finite_values_still_give_k_indices_inside_the_bucket() -> None:
    """A poisoned gradient is decoded and skipped later: the selection must only stay in bounds."""
    sizes, ks = [10_000, 8192], [10, 9]
    flat = torch.randn(sum(sizes), generator=_gen(4))
    flat[::7] = float("nan")
    flat[5] = float("inf")
    layout = segment_layout(sizes, ks, 0.01, flat.device)
    chosen = batched_topk(flat, layout, _gen(2))
    assert chosen.numel() == 19 and int(chosen.min()) >= 0 and int(chosen.max()) < flat.numel()


def test_only_float32_is_accepted() -> None:
    layout = segment_layout([4096], [4], 0.01, torch.device("cpu"))
    with pytest.raises(TypeError, match="float32"):
        batched_topk(torch.randn(4096, dtype=torch.float64), layout)


def test_the_same_generator_state_gives_the_same_selection() -> None:
    """Every rank seeds its device generator alike (ExchangeState.draw_generator): same draws, same result."""
    flat = torch.randn(70_000, generator=_gen(5))
    flat[:1000] = 1.0  # many ties: only equal draws make equal choices
    layout = segment_layout([30_000, 40_000], [300, 40], 0.01, flat.device)
    assert torch.equal(batched_topk(flat, layout, _gen(9)), batched_topk(flat, layout, _gen(9)))


def test_ranges_are_selected_where_they_lie() -> None:
    """DEFT's owned fragments: scattered ranges of one buffer, each with its own k."""
    flat = torch.randn(200_000, generator=_gen(6))
    starts, sizes, ks = [150_000, 3, 60_000], [40_000, 5000, 1024], [40, 5, 1024]
    positions = concatenated_ranges(starts, sizes, flat.device)
    assert positions.tolist() == [*range(150_000, 190_000), *range(3, 5003), *range(60_000, 61_024)]
    chosen, layout = topk_in_ranges(flat, starts, sizes, ks, 0.01, _gen(0))
    for j, got in enumerate(_per_segment(chosen, layout)):
        want = torch.topk(flat[starts[j] : starts[j] + sizes[j]].abs(), ks[j]).indices + starts[j]
        assert sorted(got) == sorted(want.tolist())
    assert layout.out_segment.tolist() == [0] * 40 + [1] * 5 + [2] * 1024


def test_a_large_bucket_is_selected_in_groups_of_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``max_values``, consecutive segments are selected group by group (a larger segment alone), so that
    the temporaries are a group's, not the bucket's; every segment still gets exactly its top-k, in order."""
    sizes, ks = [30_000, 5000, 5000, 50_000, 100, 20_000], [30, 5, 5000, 50, 1, 0]
    flat = torch.randn(sum(sizes), generator=_gen(7))
    layout = segment_layout(sizes, ks, 0.01, flat.device, max_values=40_000)
    assert [(a, b) for a, b, _ in layout.groups] == [(0, 3), (3, 4), (4, 6)]
    assert segment_layout(sizes, ks, 0.01, flat.device).groups == ()  # under the default bound: one group
    chosen = batched_topk(flat, layout, _gen(8))
    assert chosen.numel() == layout.k_total
    for t, got in enumerate(_per_segment(chosen, layout)):
        start, stop = layout.starts[t], layout.starts[t + 1]
        assert sorted(got) == sorted((torch.topk(flat[start:stop].abs(), ks[t]).indices + start).tolist()), t
    # DEFT's ranges likewise
    monkeypatch.setattr(batched, "MAX_BATCH_VALUES", 45_000)
    starts, sizes, ks = [150_000, 3, 60_000], [40_000, 5000, 1024], [40, 5, 1024]
    flat = torch.randn(200_000, generator=_gen(6))
    chosen, layout = topk_in_ranges(flat, starts, sizes, ks, 0.01, _gen(0))
    assert [(a, b) for a, b, _ in layout.groups] == [(0, 2), (2, 3)]
    for j, got in enumerate(_per_segment(chosen, layout)):
        want = torch.topk(flat[starts[j] : starts[j] + sizes[j]].abs(), ks[j]).indices + starts[j]
        assert sorted(got) == sorted(want.tolist())


class _Outputs(TorchDispatchMode):
    """Every tensor the operations under it return, but aliases: ``(operation, dtype, values)``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and func.overloadpacket.__name__ not in ("view", "detach"):
            self.seen.append((func.overloadpacket.__name__, out.dtype, out.numel()))
        return out

    def largest_float32_allocation(self) -> int:
        empty = ("empty", "empty_like", "empty_strided")
        return max((n for op, dtype, n in self.seen if op in empty and dtype == torch.float32), default=0)


def _dgc_steps(nesterov: bool, steps: int = 4) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], int]:
    """Updates, the committed memory and the largest float32 temporary of DGC's batched path on one bucket."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, 40)) for n in (300, 500, 200, 700)]
    config = DGCConfig(density=0.01, selection_backend="torch", momentum=0.9, nesterov=nesterov, min_compress_numel=64)
    state = ExchangeState(config)
    state.register_parameters([(f"p{i}", p) for i, p in enumerate(params)])
    for p in params:
        p.grad = torch.zeros_like(p)
    numel = sum(p.numel() for p in params)
    updates, watch = [], _Outputs()
    for step in range(steps):
        grad = torch.randn(numel, generator=_gen(100 + step))
        with watch if step == steps - 1 else contextlib.nullcontext():
            updates.append(hook.exchange(state, params, grad).wait().clone())
        state.finish_step()
    committed = state.memory.committed
    memory = {f"{kind}/{name}": t.clone() for kind in ("velocity", "momentum") for name, t in committed[kind].items()}
    return updates, memory, watch.largest_float32_allocation()


@pytest.mark.parametrize("nesterov", [False, True])
def test_dgc_makes_a_grouped_buckets_velocity_one_group_at_a_time(monkeypatch: pytest.MonkeyPatch, nesterov: bool) -> None:
    """A bucket selected in groups has each group's v' made just before that group's selection, so that the
    largest temporary is a group's, not the bucket's; the updates and the memory stay the same, bit for bit."""
    whole_updates, whole_memory, whole_largest = _dgc_steps(nesterov)
    monkeypatch.setattr(batched, "MAX_BATCH_VALUES", 30_000)
    grouped_updates, grouped_memory, grouped_largest = _dgc_steps(nesterov)
    assert whole_largest >= 68_000 and grouped_largest <= 28_000, (whole_largest, grouped_largest)
    for whole, grouped in zip(whole_updates, grouped_updates, strict=True):
        assert torch.equal(whole, grouped)
    assert whole_memory.keys() == grouped_memory.keys()
    for key in whole_memory:
        assert torch.equal(whole_memory[key], grouped_memory[key]), key


def test_a_segment_selected_alone_needs_no_per_value_tables() -> None:
    """One segment has one threshold: its candidates are counted without the thresholds' and the mask's running
    sums (4 bytes a value each); it gets exactly its top-k, as inside a bucket of several."""
    values = torch.randn(50_000, generator=_gen(11))
    layout = segment_layout([50_000], [50], 0.01, values.device)
    with _Outputs() as outputs:
        chosen = batched_topk(values, layout, _gen(12))
    assert sorted(chosen.tolist()) == sorted(torch.topk(values.abs(), 50).indices.tolist())
    assert not [s for s in outputs.seen if s[1] in (torch.int32, torch.int64) and s[2] >= 50_000], outputs.seen
    # the same selection as the tensor's inside a bucket of several (another segment after it)
    both = segment_layout([50_000, 1000], [50, 10], 0.01, values.device)
    inside = batched_topk(torch.cat([values, torch.randn(1000, generator=_gen(13))]), both, _gen(12))
    assert sorted(inside[:50].tolist()) == sorted(chosen.tolist())
