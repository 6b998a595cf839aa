"""Every registered algorithm through the generic hook steps on simulated ranks (no process group).

``comm.simulate`` runs N ranks as threads of this process, joined by ``LocalCollectives``: the same
exchanges as over gloo, checked here for what every algorithm must guarantee.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from lightning_dgc import algorithms, comm
from lightning_dgc.algorithms.base import WireCost, layout_of
from lightning_dgc.algorithms.dgc import DGC, DGCConfig
from lightning_dgc.comm import CollectiveError
from lightning_dgc.exchange import hook
from lightning_dgc.exchange.state import ExchangeState
from lightning_dgc.perfmodel import BucketProfile, Profile

CONFIGS = {
    "dgc": {"density": 0.05},
    "deft": {"density": 0.05},
    "powersgd": {"matrix_approximation_rank": 2, "start_iter": 2},
}
#: DGC and DEFT on both selection paths: numpy tensor by tensor, and the batched device path.
SELECTIONS = [("dgc", "numpy"), ("dgc", "torch"), ("deft", "numpy"), ("deft", "torch")]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 4))


def _train(config: algorithms.AlgorithmConfig, steps: int = 4, world: int = 2, same_data: bool = False,
           fail_at: int | None = None) -> list[dict]:  # fmt: skip
    """Each simulated rank exchanges ``steps`` random gradients of the model's parameters, as one bucket."""

    def rank_run(collectives: comm.Collectives) -> dict:
        model = _model()
        state = ExchangeState(config, collectives=collectives, measure_buildup=True)
        state.register_parameters(model.named_parameters())
        params = list(model.parameters())
        numel = sum(p.numel() for p in params)
        updates, sent = [], []
        for step in range(steps):
            seed = 100 * step + (0 if same_data else collectives.rank)
            local = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
            sent.append(local.clone())
            for p in params:
                p.grad = torch.zeros_like(p)
            updates.append(hook.exchange(state, params, local).wait().clone())
            state.finish_step()
        return {"updates": updates, "local": sent, "stats": state.compression_stats(), "state": state}

    return comm.simulate(world, rank_run, fail_at=fail_at)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_rank_decodes_the_same_update(name: str, world: int) -> None:
    config = algorithms.get(name).config_class(**CONFIGS[name])
    ranks = _train(config, world=world)
    for r in ranks[1:]:
        for a, b in zip(ranks[0]["updates"], r["updates"], strict=True):
            assert torch.equal(a, b)
    assert ranks[0]["stats"]["algorithm"] == name and ranks[0]["stats"]["compression_ratio"] > 1.5


@pytest.mark.parametrize("name", ["dgc", "deft"])
def test_density_one_is_the_plain_average(name: str) -> None:
    config = algorithms.get(name).config_class(density=1.0)
    ranks = _train(config, world=3)
    for step in range(4):
        mean = torch.stack([r["local"][step] for r in ranks]).mean(0)
        torch.testing.assert_close(ranks[0]["updates"][step], mean, rtol=1e-6, atol=1e-7)


def test_powersgd_compresses_only_from_its_start_iteration() -> None:
    ranks = _train(
        algorithms.get("powersgd").config_class(matrix_approximation_rank=1, start_iter=3), steps=4
    )
    for step in range(3):  # plain all-reduce
        mean = torch.stack([r["local"][step] for r in ranks]).mean(0)
        torch.testing.assert_close(ranks[0]["updates"][step], mean)
    mean = torch.stack([r["local"][3] for r in ranks]).mean(0)
    assert not torch.allclose(ranks[0]["updates"][3], mean), "step 3 should be a low-rank approximation"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_statistics_are_the_wire_cost_the_performance_model_reads(name: str) -> None:
    """compression_stats() and Profile.totals() come from one formula, the algorithm's wire_cost."""
    config = algorithms.get(name).config_class(**CONFIGS[name])
    stats = _train(config, world=4)[0]["stats"]
    model = _model()
    bucket = BucketProfile([list(p.shape) for p in model.parameters()], 4 * sum(p.numel() for p in model.parameters()),
                           [n for n, _ in model.named_parameters()])  # fmt: skip
    profile = Profile(
        "toy", [bucket], compute_s=1.0, configs={name: dataclasses.asdict(config)}, world_size=4
    )
    for key, value in profile.totals(name).items():
        assert stats[key] == value, key


def test_deft_shares_k_without_build_up_and_dgc_builds_up() -> None:
    deft = _train(algorithms.get("deft").config_class(density=0.05), world=4)
    dgc = _train(DGCConfig(density=0.05), world=4)
    k = deft[0]["stats"]["k"]
    assert all(r["stats"]["union_values"] == k for r in deft)
    assert sum(r["stats"]["rank_selected"] for r in deft) == k
    assert dgc[0]["stats"]["buildup_factor"] > 1.5


@pytest.mark.parametrize("name", ["dgc", "deft"])
def test_the_build_up_is_measured_only_in_steps_that_ask_for_it(name: str) -> None:
    """Counting the union's distinct indices stalls a GPU's host once per bucket: off the hot path."""

    def rank_run(collectives: comm.Collectives) -> list[dict]:
        model = _model()
        state = ExchangeState(algorithms.get(name).config_class(density=0.05), collectives=collectives)
        state.register_parameters(model.named_parameters())
        params, stats = list(model.parameters()), []
        for step in range(3):
            if step == 1:
                state.request_buildup()  # what CompressionMonitor does before a step it logs
            for p in params:
                p.grad = torch.zeros_like(p)
            hook.exchange(state, params, torch.randn(sum(p.numel() for p in params))).wait()
            state.finish_step()
            stats.append(state.compression_stats())
        return stats

    for stats in comm.simulate(2, rank_run):
        assert ["buildup_factor" in s for s in stats] == [False, True, False]
        assert stats[1]["union_values"] >= stats[1]["k"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_failed_collective_is_raised_naming_it(name: str) -> None:
    config = algorithms.get(name).config_class(**CONFIGS[name])
    with pytest.raises(
        (CollectiveError, RuntimeError), match=r"lightning_dgc: the .* failed on rank \d: .*a peer died"
    ):
        _train(config, steps=4, fail_at=3)


def test_ranks_that_start_different_collectives_fail_instead_of_mixing_data() -> None:
    def rank_run(collectives: comm.Collectives) -> None:
        size = 3 if collectives.rank == 0 else 4
        collectives.all_reduce(torch.ones(size), "all-reduce of a test tensor").wait()

    with pytest.raises(CollectiveError, match=r"rank 1 sent \(4,\)"):
        comm.simulate(2, rank_run)


def test_the_readme_example_algorithm_works(monkeypatch: pytest.MonkeyPatch) -> None:
    """The docs' "add an algorithm" file (docs/extending.md), run as written: registered by name, exact on
    simulated ranks."""
    import re
    import sys
    import types
    from pathlib import Path

    from lightning_dgc.algorithms import base

    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))  # the example's registration is undone
    readme = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text()
    code = next(block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "class FP16(" in block)
    module = types.ModuleType("lightning_dgc.algorithms.fp16")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(code, "docs/extending.md", "exec"), module.__dict__)
    config = algorithms.get("fp16").config_class()
    ranks = _train(config, world=3)
    for step in range(4):
        mean = torch.stack([r["local"][step] for r in ranks]).mean(0)
        torch.testing.assert_close(ranks[0]["updates"][step], mean, rtol=1e-3, atol=1e-3)
    assert ranks[0]["stats"]["compression_ratio"] == 2.0


def test_a_forgotten_finish_step_is_made_by_the_next_step_with_a_warning() -> None:
    """Raw-hook users who never call finish_step() still get their memory committed, and are told."""

    def rank_run(collectives: comm.Collectives) -> tuple[list, int]:
        model = _model()
        state = ExchangeState(DGCConfig(density=0.05), collectives=collectives)
        state.register_parameters(model.named_parameters())
        params = list(model.parameters())
        numel = sum(p.numel() for p in params)
        for step in range(3):
            hook.exchange(
                state, params, torch.randn(numel, generator=torch.Generator().manual_seed(step))
            ).wait()
        return list(state.memory.committed["velocity"].values()), state.step

    with pytest.warns(UserWarning, match="finish_step\\(\\) was not called"):  # (warnings are process-wide)
        ranks = comm.simulate(2, rank_run)
    for velocities, step in ranks:
        assert step == 2 and any(float(v.abs().sum()) > 0 for v in velocities)


@pytest.mark.parametrize("name,backend", SELECTIONS)
def test_both_selection_paths_agree_across_ranks_and_with_each_other(name: str, backend: str) -> None:
    """Each path keeps ranks identical; both select the exact top-k, so they decode the same updates."""
    config = algorithms.get(name).config_class(density=0.05, selection_backend=backend, momentum=0.9,
                                               **({"momentum_correction": True} if name == "deft" else {}))  # fmt: skip
    ranks = _train(config, world=4)
    for r in ranks[1:]:
        for a, b in zip(ranks[0]["updates"], r["updates"], strict=True):
            assert torch.equal(a, b)
    other = dataclasses.replace(config, selection_backend="numpy" if backend == "torch" else "torch")
    for a, b in zip(ranks[0]["updates"], _train(other, world=4)[0]["updates"], strict=True):
        assert torch.equal(a, b)


def _train_deft_with_plans(config: algorithms.AlgorithmConfig, world: int = 4, steps: int = 4) -> list[dict]:
    """Like ``_train``, keeping every step's DEFT plans ((k, owner) per fragment, per bucket)."""

    def rank_run(collectives: comm.Collectives) -> dict:
        model = _model()
        state = ExchangeState(config, collectives=collectives)
        state.register_parameters(model.named_parameters())
        params = list(model.parameters())
        numel = sum(p.numel() for p in params)
        updates, sent, plans = [], [], []
        for step in range(steps):
            local = torch.randn(numel, generator=torch.Generator().manual_seed(100 * step + collectives.rank))
            sent.append(local.clone())
            for p in params:
                p.grad = torch.zeros_like(p)
            updates.append(hook.exchange(state, params, local).wait().clone())
            state.finish_step()
            plans.append(state.stats.last.plans[0])  # type: ignore[union-attr]
        return {"updates": updates, "local": sent, "plans": plans, "state": state}

    return comm.simulate(world, rank_run)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize(
    "switch",
    [{"k_allocation": "size"}, {"fragmenting": False}, {"rotation": False}, {"union_values": "owner"},
     {"selectors": "all"}],
    ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()),
)  # fmt: skip
def test_each_deft_switch_keeps_ranks_identical_and_does_what_it_says(switch: dict, backend: str) -> None:
    """DEFT's parts can be switched off one by one (for ablations); every variant keeps ranks in step."""
    deft = algorithms.get("deft").config_class
    base = {"density": 0.05, "selection_backend": backend}
    if "rotation" in switch:  # k by size: a fixed k, so only the rotation moves the owners
        base["k_allocation"] = "size"
    ranks = _train_deft_with_plans(deft(**base, **switch))
    for r in ranks[1:]:
        assert all(torch.equal(a, b) for a, b in zip(ranks[0]["updates"], r["updates"], strict=True))
        assert r["plans"] == ranks[0]["plans"]
    reference = _train_deft_with_plans(deft(**base))[0]
    plans, default = ranks[0]["plans"], reference["plans"]
    if "k_allocation" in switch:  # k in proportion to size: the same k whatever the gradient
        assert all(ks == plans[0][0] for ks, _ in plans) and len({tuple(ks) for ks, _ in default}) > 1
        # ... so no norms are computed or all-reduced: no blocking control round, no selection times
        assert "max_rank_selection_ms" not in ranks[0]["state"].compression_stats()
        assert "max_rank_selection_ms" in reference["state"].compression_stats()
    if "fragmenting" in switch:  # whole layers: one fragment per compressed layer (2 here)
        assert len(plans[0][0]) == 2 < len(default[0][0])
    if "rotation" in switch:
        assert (
            len({tuple(owners) for _, owners in plans}) == 1 < len({tuple(owners) for _, owners in default})
        )
    if "selectors" in switch:  # every rank selected its share of every fragment: k in all, no owners
        k = sum(plans[0][0])
        assert all(set(owners) == {-1} for _, owners in plans)
        selected = [r["state"].compression_stats()["rank_selected"] for r in ranks]
        assert sum(selected) == k and max(selected) - min(selected) <= len(plans[0][0])
    if "union_values" in switch:  # at every union position, only its owner sent (and cleared) its value
        model = _model()
        offsets, start = {}, 0
        for name, p in model.named_parameters():
            offsets[name] = (start, p.numel())
            start += p.numel()
        for name in ("0.weight", "2.weight"):  # the compressed layers
            a, n = offsets[name]
            union = ranks[0]["updates"][-1][a : a + n] != 0
            cleared = sum((r["state"].memory.committed["velocity"][name].flatten() == 0).int() for r in ranks)
            assert union.any() and bool((cleared[union] == 1).all())


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_deft_with_more_fragments_than_k_sends_one_value_per_fragment(backend: str) -> None:
    """At 8 ranks a low density gives fewer values than fragments (each layer cut into 8): every fragment
    still sends one, and the union, the wire cost and the ranks agree (it raised in repeat_interleave)."""
    config = algorithms.get("deft").config_class(density=0.002, selection_backend=backend)
    ranks = _train_deft_with_plans(config, world=8, steps=3)
    plans = ranks[0]["plans"]
    fragments = len(plans[0][0])
    k_nominal = sum(
        math.ceil(0.002 * n) for n in (32 * 64, 64 * 48, 48 * 4) if math.ceil(0.002 * n) * 8 < n * 4
    )
    assert k_nominal < fragments  # the case under test
    assert all(ks == [1] * fragments for ks, _ in plans)
    for r in ranks[1:]:
        assert all(torch.equal(a, b) for a, b in zip(ranks[0]["updates"], r["updates"], strict=True))
    named = list(_model().named_parameters())
    layout = layout_of([n for n, _ in named], [p.shape for _, p in named])
    cost = algorithms.get("deft").wire_cost(config, layout, 8, 0)
    assert cost.k == fragments and cost.bytes_of("control") > 0
    by_size = dataclasses.replace(config, k_allocation="size")
    assert algorithms.get("deft").wire_cost(by_size, layout, 8, 0).bytes_of("control") == 0


def test_deft_budget_dgc_link_fills_what_dgc_puts_on_each_link() -> None:
    """budget="dgc_link": DEFT's union grows with the ranks until its ring all-reduce carries what DGC's
    all-gather carries at the same density (never below k); the ranks agree, the union stays disjoint."""
    deft = algorithms.get("deft")
    named = list(_model().named_parameters())
    layout = layout_of([n for n, _ in named], [p.shape for _, p in named])

    def payload_link(algorithm: type, config: DGCConfig, world: int) -> float:
        cost = algorithm.wire_cost(config, layout, world, 0)
        return sum(WireCost((m,), 0, 0).link_bytes(world) for m in cost.messages if m.role == "payload")

    published = deft.config_class(density=0.01, k_allocation="size", fragmenting=False)
    linked = dataclasses.replace(published, budget="dgc_link")
    dgc = DGCConfig(density=0.01)
    assert deft.wire_cost(linked, layout, 2, 0).k == deft.wire_cost(published, layout, 2, 0).k
    for world in (4, 8, 16):
        k, k_linked = (
            deft.wire_cost(published, layout, world, 0).k,
            deft.wire_cost(linked, layout, world, 0).k,
        )
        assert k_linked > k
        assert (
            0.9 * payload_link(DGC, dgc, world)
            <= payload_link(deft, linked, world)
            <= payload_link(DGC, dgc, world)
        )
    ranks = _train(linked, world=4)
    for r in ranks[1:]:
        assert all(torch.equal(a, b) for a, b in zip(ranks[0]["updates"], r["updates"], strict=True))
    stats = ranks[0]["stats"]
    assert (
        stats["union_values"] == stats["k"] == deft.wire_cost(linked, layout, 4, 0).k
    )  # disjoint, no build-up
    with pytest.raises(ValueError, match="budget"):
        deft.config_class(budget="bytes")


def test_deft_selectors_all_sends_an_index_two_ranks_chose_once() -> None:
    """With the same gradient everywhere every rank selects the same indices: the union repeats each one,
    and the update there must still be the plain average (the value, not twice it)."""
    config = algorithms.get("deft").config_class(density=0.05, selectors="all", k_allocation="size")
    ranks = _train(config, world=2, steps=1, same_data=True)
    update, local = ranks[0]["updates"][0], ranks[0]["local"][0]
    sent = update != 0
    assert sent.any()
    torch.testing.assert_close(update[sent], local[sent])
    assert ranks[0]["stats"]["union_values"] < ranks[0]["stats"]["k"]  # the repeats are counted once
