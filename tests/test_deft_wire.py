"""DEFT's compact wire (``wire="compact"``): 2-byte index codes all-gathered, fp16 values all-reduced.

Simulated ranks (``comm.simulate``): the union it decodes is the all-reduce wire's, ranks stay
bit-identical, the bytes it reports are the bytes it hands to the collectives, and a step whose values
overflow fp16 is skipped on every rank.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor, nn

from lightning_dgc import comm
from lightning_dgc.algorithms.base import WireCost, layout_of
from lightning_dgc.algorithms.deft import DEFT, DEFTConfig
from lightning_dgc.algorithms.dgc import DGC, DGCConfig
from lightning_dgc.comm import LocalCollectives
from lightning_dgc.exchange import hook
from lightning_dgc.exchange.state import ExchangeState
from lightning_dgc.kit import CountingCollectives, check_algorithm
from lightning_dgc.tensor_ops import codec


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 4))


def _train(config: DEFTConfig, world: int, steps: int = 3, big: int | None = None) -> list[dict]:
    """Each simulated rank exchanges ``steps`` random gradients as one bucket; per step its update, its
    union, its plan, whether the step counted, and the bytes it handed to the collectives. ``big``: the step
    whose gradients get one value of 1e6 (finite in fp32, past fp16's range once averaged)."""

    def rank_run(collectives: comm.Collectives) -> dict:
        assert isinstance(collectives, LocalCollectives)
        counting = CountingCollectives(collectives)
        model = _model()
        state = ExchangeState(config, collectives=counting, measure_buildup=True)
        state.register_parameters(model.named_parameters())
        params = list(model.parameters())
        numel = sum(p.numel() for p in params)
        out: dict = {"updates": [], "unions": [], "plans": [], "finite": [], "handed": [], "stats": [], "local": []}
        for step in range(steps):
            local = torch.randn(numel, generator=torch.Generator().manual_seed(100 * step + collectives.rank))
            if big == step:
                local[5] = 1e6
            out["local"].append(local.clone())
            for p in params:
                p.grad = torch.zeros_like(p)
            before = counting.nbytes
            memory = {n: t.clone() for n, t in state.memory.committed.get("velocity", {}).items()}
            out["updates"].append(hook.exchange(state, params, local).wait().clone())
            out["finite"].append(state.finish_step())
            out["handed"].append(counting.nbytes - before)
            out["stats"].append(state.compression_stats())
            union = state.plans[0].union
            out["unions"].append(None if union is None else union.clone())
            last = state.stats.last.plans  # type: ignore[union-attr]
            out["plans"].append(last[0] if last else None)
            out.setdefault("memory_before", []).append(memory)
            out.setdefault("memory_after", []).append(
                {n: t.clone() for n, t in state.memory.committed.get("velocity", {}).items()}
            )
        return out

    return comm.simulate(world, rank_run)


def _per_fragment(union: Tensor, ks: list[int]) -> list[list[int]]:
    return [sorted(part.tolist()) for part in union.split(ks)]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("switch", [{}, {"selectors": "all", "k_allocation": "size"}], ids=["owner", "all"])
def test_compact_wire_decodes_the_allreduce_wires_union(world: int, switch: dict) -> None:
    """The same plan and, fragment by fragment, the same union as the int32 all-reduce; bit-identical ranks;
    the update the all-reduce wire's up to fp16 rounding (the memories, hence the plans, stay equal)."""
    published = DEFTConfig(density=0.05, **switch)
    compact = _train(dataclasses.replace(published, wire="compact"), world)
    reference = _train(published, world)
    for step in range(3):
        ks, owners = compact[0]["plans"][step]
        assert (ks, owners) == reference[0]["plans"][step]
        for r in range(world):
            assert torch.equal(compact[r]["unions"][step], compact[0]["unions"][step])
            assert torch.equal(compact[r]["updates"][step], compact[0]["updates"][step])
        got, want = compact[0]["unions"][step], reference[0]["unions"][step]
        assert _per_fragment(got, ks) == _per_fragment(want, ks)
        if "selectors" not in switch:  # one selector per fragment: its slots decoded in ascending order
            assert all(part.tolist() == sorted(part.tolist()) for part in got.split(ks))
        torch.testing.assert_close(compact[0]["updates"][step], reference[0]["updates"][step], rtol=2e-3, atol=2e-3)
        stats = compact[0]["stats"][step]
        if "selectors" not in switch:
            assert stats["union_values"] == stats["k"]  # disjoint: no build-up


def test_compact_wire_at_density_one_is_the_mean() -> None:
    """Density 1 sends every tensor dense (in ``value_dtype``, fp32 here): the plain mean, as with the
    all-reduce wire; the budget's cap on the union is the same."""
    ranks = _train(DEFTConfig(density=1.0, wire="compact"), world=3)
    for step in range(3):
        mean = torch.stack([r["local"][step] for r in ranks]).mean(0)
        torch.testing.assert_close(ranks[0]["updates"][step], mean, rtol=1e-6, atol=1e-6)
    linked = DEFTConfig(density=0.2, wire="compact", budget="dgc_link")
    assert DEFT.selected_density(linked, 8) == 1.0  # capped: every value
    assert DEFT.selected_density(linked, 2) == pytest.approx(0.4)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_compact_wire_reports_the_bytes_it_hands_to_the_collectives(world: int) -> None:
    """compression_stats() (the step's cost) == what the collectives got; the code rows are as wide as the
    largest rank's count, and the static wire_cost (equal counts) is what a balanced plan costs."""
    config = DEFTConfig(density=0.05, wire="compact", k_allocation="size", budget="dgc_link")
    ranks = _train(config, world)
    named = list(_model().named_parameters())
    layout = layout_of([n for n, _ in named], [p.shape for _, p in named])
    numel = sum(s.numel for s in layout)
    static = DEFT.wire_cost(config, layout, world, 0)
    for step in range(3):
        ks, owners = ranks[0]["plans"][step]
        counts = [sum(k for k, o in zip(ks, owners, strict=True) if o == r) for r in range(world)]
        values = 2 * sum(ks)
        codes = 2 * codec.code_slots(max(counts), numel)
        dense = ranks[0]["stats"][step]["bytes_sent"] - values - codes
        for r in ranks:
            assert r["handed"][step] == r["stats"][step]["bytes_sent"]
        assert dense == static.bytes_of("dense") > 0
        link = (world - 1) * codes + 2 * (world - 1) / world * (values + dense)
        assert ranks[0]["stats"][step]["link_bytes"] == pytest.approx(link)
        assert sum(ks) == static.k
    assert static.bytes_of("payload") == 2 * static.k + 2 * codec.code_slots(-(-static.k // world), numel)


def test_compact_wire_budget_fills_dgcs_link_with_n_k_values() -> None:
    """budget="dgc_link" with the compact wire: N k values (against DGC in fp32), never more than every value,
    at about DGC's link bytes; 2.7x fewer bytes per value than the all-reduce wire."""
    shapes = [(4096, 512), (512,), (2048, 1024)]
    layout = layout_of([f"t{i}" for i in range(len(shapes))], shapes)
    published = DEFTConfig(density=0.001, k_allocation="size")
    compact = dataclasses.replace(published, wire="compact", budget="dgc_link")
    dgc = DGC.wire_cost(DGCConfig(density=0.001), layout, 8, 0)
    for world in (2, 4, 8):
        k = DEFT.wire_cost(published, layout, world, 0).k
        cost = DEFT.wire_cost(compact, layout, world, 0)
        assert cost.k == pytest.approx(world * k, rel=1e-3)
        dgc = DGC.wire_cost(DGCConfig(density=0.001), layout, world, 0)
        payload = sum(WireCost((m,), 0, 0).link_bytes(world) for m in cost.messages if m.role == "payload")
        dgc_payload = dgc.link_bytes(world) - WireCost(
            tuple(m for m in dgc.messages if m.role == "dense"), 0, 0
        ).link_bytes(world)
        assert 0.97 * dgc_payload <= payload <= 1.03 * dgc_payload


def test_compact_wire_skips_a_step_whose_average_overflows_fp16_on_every_rank() -> None:
    """A finite gradient of 1e6 (selected by its owner) overflows fp16 (its average 1e6 > 65504): every
    rank skips the step with its memory intact, and the next step counts again."""
    config = DEFTConfig(density=0.05, wire="compact")
    ranks = _train(config, world=4, steps=3, big=1)
    for r in ranks:
        assert r["finite"] == [True, False, True]
        before, after = r["memory_before"][1], r["memory_after"][1]
        assert all(torch.equal(before[n], after[n]) for n in before)
    for r in ranks[1:]:
        assert torch.equal(r["updates"][2], ranks[0]["updates"][2])


@pytest.mark.parametrize("switch", [{}, {"selectors": "all", "selection_backend": "torch"}, {"union_values": "owner"}])
def test_compact_wire_passes_check_algorithm(switch: dict) -> None:
    for world in (2, 3):
        config = DEFTConfig(density=0.1, min_compress_numel=64, wire="compact", **switch)
        check_algorithm(config, world_size=world, conservation_rtol=2e-3)


def test_compact_wire_in_two_levels_keeps_ranks_identical() -> None:
    from tests.test_two_level import _train as train_two_level

    ranks = train_two_level(DEFTConfig(density=0.05, wire="compact"), nodes=3, per_node=2)
    for r in ranks[1:]:
        for a, b in zip(ranks[0]["updates"], r["updates"], strict=True):
            assert torch.equal(a, b)
    assert all(torch.isfinite(u).all() for u in ranks[0]["updates"])
    stats = ranks[0]["stats"]
    assert ranks[0]["state"].world_size == 3 and 0 < stats["inter_node_bytes"] < stats["link_bytes"]


def test_codes_round_trip_with_fillers_counts_and_a_corrupt_row() -> None:
    span = 200_000  # 3 filler slots
    generator = torch.Generator().manual_seed(0)
    rows, counts, width = [], [5, 0, 3], 5
    slots = codec.code_slots(width, span)
    picks = [torch.randperm(span, generator=generator)[:c].sort().values for c in counts]
    picks[0][-1] = span - 1  # a gap past 65535 before it
    picks[0] = picks[0].sort().values
    for p in picks:
        codes = torch.empty(slots, dtype=torch.int16)
        codec.pack_codes(codes, p)
        rows.append(codes)
    decoded = codec.unpack_codes(torch.stack(rows), torch.tensor(counts), width, span).view(3, width)
    for r, p in enumerate(picks):
        assert decoded[r, : counts[r]].tolist() == p.tolist()
        assert decoded[r, counts[r] :].eq(0).all()
    corrupt = torch.full((1, slots), 7, dtype=torch.int16)  # more entries than its count
    out = codec.unpack_codes(corrupt, torch.tensor([2]), 2, span)
    assert out.tolist() == [6, 13]


def test_wire_must_be_known() -> None:
    with pytest.raises(ValueError, match="`wire` must be 'allreduce'"):
        DEFTConfig(wire="gather")  # type: ignore[arg-type]


def test_a_checkpoint_of_the_allreduce_wire_resumes_on_the_compact_wire() -> None:
    """The wire shapes no memory: a state saved with wire="allreduce" (or before the option existed) loads
    into a compact-wire run, which keeps that memory and the ranks identical."""
    published = DEFTConfig(density=0.05)

    def rank_run(collectives: comm.Collectives) -> tuple[Tensor, dict, dict]:
        model = _model()
        params = list(model.parameters())
        numel = sum(p.numel() for p in params)
        states = []
        for config in (published, dataclasses.replace(published, wire="compact")):
            state = ExchangeState(config, collectives=collectives)
            state.register_parameters(model.named_parameters())
            states.append(state)
        for p in params:
            p.grad = torch.zeros_like(p)
        local = torch.randn(numel, generator=torch.Generator().manual_seed(collectives.rank))
        hook.exchange(states[0], params, local).wait()
        states[0].finish_step()
        saved = states[0].state_dict()
        del saved["config"]["wire"]  # as saved before the option existed
        states[1].load_state_dict(saved)
        loaded = {n: t.clone() for n, t in states[1].memory.committed["velocity"].items()}
        update = hook.exchange(states[1], params, local.clone()).wait().clone()
        states[1].finish_step()
        return update, loaded, states[0].memory.committed["velocity"]

    ranks = comm.simulate(2, rank_run)
    for update, loaded, memory in ranks:
        assert torch.equal(update, ranks[0][0]) and update.abs().sum() > 0
        assert all(torch.equal(loaded[n], memory[n]) for n in memory)
