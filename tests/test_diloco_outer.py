"""DiLoCo's outer step (:mod:`lightning_dgc.local_steps.outer`) on simulated ranks: the math against a hand-written reference,
the outer exchange through a compression algorithm, skipped non-finite rounds, the saved state."""

from __future__ import annotations

import io
import math

import pytest
import torch

from lightning_dgc import comm
from lightning_dgc.algorithms.dgc import DGCConfig
from lightning_dgc.algorithms.powersgd import PowerSGDConfig
from lightning_dgc.local_steps.outer import OuterSettings, OuterStep


def _model() -> torch.nn.Module:
    """The same weights on every simulated rank (its own generator: the ranks are threads of one process)."""
    model = torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _drift(model: torch.nn.Module, rank: int, round_: int) -> None:
    """What a rank's inner steps did to its copy (a different move on every rank and round)."""
    g = torch.Generator().manual_seed(100 * round_ + rank)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)


def _run(config, rounds: int = 3, settings: OuterSettings | None = None, world: int = 2, poison=None):
    settings = settings or OuterSettings(sync_every=1)

    def rank_fn(collectives):
        model = _model()
        outer = OuterStep(settings, config, model.named_parameters(), collectives=collectives)
        verdicts = []
        for r in range(rounds):
            _drift(model, collectives.rank, r)
            if poison == (collectives.rank, r):
                with torch.no_grad():
                    next(model.parameters())[0, 0] = math.nan
            verdicts.append(outer.after_optimizer_step())
        return model, outer, verdicts

    return comm.simulate(world, rank_fn)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_dense_outer_steps_equal_a_hand_written_nesterov_sgd_on_the_mean_pseudo_gradient() -> None:
    lr, mu = 0.7, 0.9
    out = _run(None, settings=OuterSettings(sync_every=1, outer_lr=lr, outer_momentum=mu, outer_nesterov=True))
    reference = [p.detach().clone() for p in _model().parameters()]
    buffers = [torch.zeros_like(p) for p in reference]
    for r in range(3):
        locals_ = []
        for rank in range(2):
            copy = _model()
            with torch.no_grad():
                for p, g in zip(copy.parameters(), reference, strict=True):
                    p.copy_(g)
            _drift(copy, rank, r)
            locals_.append([p.detach() for p in copy.parameters()])
        for i, g in enumerate(reference):
            delta = (2 * g - locals_[0][i] - locals_[1][i]) / 2
            buffers[i] = delta if r == 0 else mu * buffers[i] + delta
            g -= lr * (delta + mu * buffers[i])
    expected = torch.cat([g.reshape(-1) for g in reference])
    (m0, o0, v0), (m1, _, _) = out
    assert v0 == [True, True, True] and o0.outer_steps == 3 and o0.inner_steps == 0
    assert torch.equal(_flat(m0), _flat(m1)), "ranks differ after the outer step"
    torch.testing.assert_close(_flat(m0), expected, rtol=1e-5, atol=1e-6)
    assert not torch.equal(_flat(m0), _flat(_model())), "the outer steps moved nothing"


def test_the_outer_step_runs_after_every_sync_every_th_step_only() -> None:
    (model, outer, verdicts), _ = _run(None, rounds=5, settings=OuterSettings(sync_every=2))
    assert verdicts == [None, True, None, True, None] and outer.inner_steps == 1 and outer.outer_steps == 2


def test_dgc_at_density_one_equals_the_dense_mean() -> None:
    dense = _run(None)
    dgc = _run(DGCConfig(density=1.0, min_compress_numel=16, selection="exact"))
    torch.testing.assert_close(_flat(dgc[0][0]), _flat(dense[0][0]), rtol=1e-6, atol=1e-7)
    assert dgc[0][1].compression_stats()["algorithm"] == "dgc"


@pytest.mark.parametrize("config", [DGCConfig(density=0.05, min_compress_numel=16), PowerSGDConfig(start_iter=2)])
def test_a_compressed_outer_exchange_keeps_its_error_feedback_and_the_ranks_identical(config) -> None:
    (m0, o0, v0), (m1, o1, _) = _run(config)
    assert v0 == [True] * 3 and torch.equal(_flat(m0), _flat(m1))
    assert torch.equal(torch.cat([g.reshape(-1) for g in o0.global_params]), _flat(m0))
    state = o0.exchange_state
    assert state is not None and state.step == 3 and (state.residual_norm() or 0.0) > 0.0
    assert set(next(iter(state.memory.committed.values()))) <= set(o0.names)  # keyed by parameter name
    stats = o0.compression_stats()
    assert 0 < stats["bytes_sent"] < stats["dense_bytes"] and stats["compression_ratio"] > 1.0


@pytest.mark.parametrize("config", [None, DGCConfig(density=0.05, min_compress_numel=16)], ids=["dense", "dgc"])
def test_each_steps_bytes_sum_to_the_runs_and_only_the_steps_that_end_a_round_send(config) -> None:
    """``bytes_sent`` / ``link_bytes`` are the optimizer step's (what a per-step sum such as parity's recorder adds
    up): 0 inside a round, the outer exchange's on the step that ends it, and the last round cut short too."""

    def rank_fn(collectives):
        model = _model()
        outer = OuterStep(OuterSettings(sync_every=3), config, model.named_parameters(), collectives=collectives)
        per_step = []
        for r in range(7):
            _drift(model, collectives.rank, r)
            outer.after_optimizer_step()
            per_step.append(outer.compression_stats())
        outer.step()  # the round cut short at 7 (what the front doors' finish() runs)
        return outer, per_step, outer.compression_stats()

    (outer, per_step, last), _ = comm.simulate(2, rank_fn)
    sent = [s["bytes_sent"] for s in per_step]
    assert [bool(b) for b in sent] == [False, False, True, False, False, True, False]
    assert all(s["link_bytes"] == 0 for i, s in enumerate(per_step) if i not in (2, 5))
    assert per_step[2]["outer_bytes_sent"] == per_step[3]["outer_bytes_sent"] == sent[2]  # the last exchange's
    total = sum(s["link_bytes"] for s in per_step) + last["link_bytes"]
    assert last["link_bytes"] > 0 and total == pytest.approx(outer.link_bytes_total)
    assert last["link_bytes_per_step"] == pytest.approx(total / 7) and last["outer_steps"] == 3
    if config is None:
        assert sent[2] == per_step[2]["dense_bytes"] == 4 * sum(p.numel() for p in _model().parameters())
    else:
        assert 0 < sent[2] < per_step[2]["dense_bytes"]


def test_a_non_finite_pseudo_gradient_on_one_rank_skips_the_outer_step_on_every_rank() -> None:
    clean = _run(None, rounds=1)
    (m0, o0, v0), (m1, o1, v1) = _run(None, rounds=2, poison=(1, 1))
    assert v0 == v1 == [True, False]
    assert o0.skipped_outer_steps == o1.skipped_outer_steps == 1 and o0.consecutive_skipped == 1
    # local := the last good global weights, on every rank
    assert torch.equal(_flat(m0), _flat(m1)) and torch.equal(_flat(m0), _flat(clean[0][0]))


@pytest.mark.parametrize("config", [None, DGCConfig(density=0.1, min_compress_numel=16)], ids=["dense", "dgc"])
def test_hierarchical_the_nodes_first_ranks_exchange_and_every_rank_of_a_node_ends_as_the_flat_run(config) -> None:
    """2 nodes x 2 ranks, the ranks of a node holding the same local weights (DDP inside the node): the same
    weights as a flat run of one rank per node, on all 4 ranks; only the first rank of a node sends across."""
    flat = _run(config, rounds=3)

    def rank_fn(topology):
        model = _model()
        outer = OuterStep(OuterSettings(sync_every=1), config, model.named_parameters(), collectives=topology.across,
                          node=topology.node)  # fmt: skip
        for r in range(3):
            _drift(model, topology.node_rank, r)  # the node's move: the same on both of its ranks
            outer.after_optimizer_step()
        return model, outer

    out = comm.simulate_nodes(2, 2, rank_fn)
    for rank, (model, outer) in enumerate(out):
        assert torch.equal(_flat(model), _flat(flat[rank // 2][0])), rank
        assert outer.leader == (rank % 2 == 0)
        stats = outer.compression_stats()
        assert (stats["outer_bytes_sent"] > 0) == outer.leader, (rank, stats["outer_bytes_sent"])


def test_hierarchical_a_non_finite_pseudo_gradient_skips_the_outer_step_on_every_rank_of_every_node() -> None:
    def rank_fn(topology):
        model = _model()
        outer = OuterStep(OuterSettings(sync_every=1), None, model.named_parameters(), collectives=topology.across,
                          node=topology.node)  # fmt: skip
        _drift(model, topology.node_rank, 0)
        if topology.node_rank == 1:
            with torch.no_grad():
                next(model.parameters())[0, 0] = math.nan
        return outer.after_optimizer_step(), _flat(model)

    out = comm.simulate_nodes(2, 2, rank_fn)
    assert [verdict for verdict, _ in out] == [False] * 4
    assert all(torch.equal(weights, _flat(_model())) for _, weights in out), "every rank restarts from the global weights"


def test_the_state_round_trips_through_a_weights_only_load() -> None:
    (_, outer, _), _ = _run(None, rounds=3, settings=OuterSettings(sync_every=2))
    buffer = io.BytesIO()
    torch.save(outer.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    fresh = OuterStep(OuterSettings(sync_every=2), None, _model().named_parameters())
    fresh.load_state_dict(saved)
    assert fresh.inner_steps == 1 and fresh.outer_steps == 1 and fresh.optimizer_steps == 3
    for a, b in zip(fresh.global_params, outer.global_params, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(
        fresh.outer_optimizer.state_dict()["state"][0]["momentum_buffer"],
        outer.outer_optimizer.state_dict()["state"][0]["momentum_buffer"],
    )
    other = OuterStep(OuterSettings(sync_every=2), DGCConfig(), _model().named_parameters())
    with pytest.raises(ValueError, match="resume with algorithm='dense'"):
        other.load_state_dict(saved)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sync_every": 0}, "sync_every` must be >= 1"),
        ({"sync_every": 2.5}, "sync_every"),
        ({"sync_every": True}, "sync_every"),
        ({"sync_every": 4, "outer_lr": math.nan}, "outer_lr` must be a finite number > 0"),
        ({"sync_every": 4, "outer_lr": 0.0}, "outer_lr"),
        ({"sync_every": 4, "outer_momentum": 1.0}, r"outer_momentum` must be a finite number in \[0, 1\)"),
        ({"sync_every": 4, "outer_momentum": math.inf}, "outer_momentum"),
        ({"sync_every": 4, "outer_momentum": 0.0}, "pass outer_nesterov=False"),
    ],
)
def test_bad_settings_are_refused_with_the_fix(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        OuterSettings(**kwargs)
