"""No silent stalls, no silent divergence: PowerSGD on zero and rank-deficient gradients, the checks of a
checkpoint's exchange state, and arguments that must be refused at construction, not accepted or failing late."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

from lightning_dgc import comm
from lightning_dgc.algorithms.dgc import DGCConfig
from lightning_dgc.algorithms.powersgd import PowerSGDConfig, orthogonalize_
from lightning_dgc.exchange import hook
from lightning_dgc.exchange.entry import check_checkpoint_entry, state_for_rank
from lightning_dgc.exchange.state import ExchangeState
from lightning_dgc.schedules.warmup import SparsityWarmup


# -- 1. PowerSGD never makes NaN from a finite gradient ------------------------------------------------------
def test_orthogonalize_keeps_a_zero_column_zero_and_every_other_column_bit_for_bit_torchs() -> None:
    torch.manual_seed(0)
    for rank in (1, 2, 4):
        matrices = torch.randn(3, 7, rank)
        matrices[1, :, -1] = 0.0  # an all-zero column (torch: 0 / 0)
        ours, theirs = matrices.clone(), matrices.clone()
        orthogonalize_(ours)
        for i in range(3):
            _orthogonalize(theirs[i : i + 1])
        assert torch.isfinite(ours).all()
        finite = torch.isfinite(theirs).all(dim=(1, 2))
        assert torch.equal(ours[finite], theirs[finite])  # where torch is finite, bit for bit
        if rank <= 2:
            assert not finite[1] and torch.equal(ours[1, :, -1], torch.zeros(7))


def _train_powersgd(config: PowerSGDConfig, grads, world: int = 2) -> list[list[torch.Tensor]]:
    """Each simulated rank exchanges ``grads(step, rank, param)`` of a small MLP; returns the updates."""

    def rank_run(collectives: comm.Collectives) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 24))
        state = ExchangeState(config, collectives=collectives)
        state.register_parameters(model.named_parameters())
        params = list(model.parameters())
        updates = []
        for step in range(8):
            local = torch.cat([grads(step, collectives.rank, i, p).reshape(-1) for i, p in enumerate(params)])
            for p in params:
                p.grad = torch.zeros_like(p)
            updates.append(hook.exchange(state, params, local).wait().clone())
            assert state.finish_step(), f"step {step} was skipped as non-finite"
        return updates

    return comm.simulate(world, rank_run)


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_powersgd_trains_through_a_zero_gradient_matrix_and_then_learns_it(rank: int) -> None:
    """The first weight's gradient is exactly 0 for 4 compressed steps (a branch multiplied by 0), then not:
    no step is non-finite, and the approximation then follows the gradient again (warm start not stuck)."""

    def grads(step: int, r: int, i: int, p: torch.Tensor) -> torch.Tensor:
        g = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + 10 * r + i))
        return g * 0 if i == 0 and step < 6 else g

    config = PowerSGDConfig(matrix_approximation_rank=rank, start_iter=2)
    updates = _train_powersgd(config, grads)
    first = 32 * 16
    for step in range(2, 6):
        assert torch.equal(updates[0][step][:first], torch.zeros(first))
    for step in (6, 7):
        assert updates[0][step][:first].abs().sum() > 0, f"step {step}: the zero matrix's Q got stuck at 0"
    assert torch.equal(updates[0][7], updates[1][7])


def test_powersgd_is_finite_on_a_rank_deficient_gradient() -> None:
    """Rank-1 gradients approximated with rank 2: the second column of P is (numerically) zero."""

    def grads(step: int, r: int, i: int, p: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(10 * step + i)
        if p.dim() == 2:
            return torch.outer(torch.randn(p.shape[0], generator=g), torch.ones(p.shape[1]))
        return torch.randn(p.shape, generator=g)

    updates = _train_powersgd(PowerSGDConfig(matrix_approximation_rank=2, start_iter=2), grads)
    assert all(torch.isfinite(u).all() for u in updates[0])


# -- 6, 7, 10. PowerSGD's arguments --------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 0.5])
def test_powersgd_rejects_a_min_compression_rate_that_is_not_a_finite_number_of_at_least_one(bad) -> None:
    with pytest.raises(ValueError, match=r"`min_compression_rate` must be a finite number >= 1"):
        PowerSGDConfig(min_compression_rate=bad)


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_powersgd_rejects_a_seed_numpy_cannot_take_at_construction(bad) -> None:
    with pytest.raises(ValueError, match=r"`seed` must lie in \[0, 2\*\*32 - 1\]"):
        PowerSGDConfig(seed=bad)


def test_powersgd_warns_once_naming_the_matrices_its_rank_is_too_large_for() -> None:
    state = _state(PowerSGDConfig(matrix_approximation_rank=16, start_iter=2))
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(64, 256))  # (never run: its parameters' shapes only)
    state.register_parameters(model.named_parameters())
    params = list(model.parameters())
    buffer = torch.zeros(sum(p.numel() for p in params))
    with pytest.warns(UserWarning, match=r"rank=16 is too large for 1 matrix.*0.weight \(32 x 16\): at most 5"):
        state.plan(params, buffer)
    state.finish_step(check_unused=False)
    state.clear_plans()  # a new plan (DDP re-bucketed): no second warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state.plan(params, buffer)  # once per parameter
    assert [f.spec.name for f in state.plans[0].factors] == ["1.weight"]  # 256 x 64 is compressed at rank 16


# -- 2, 3, 4. Every buffer of a checkpoint checked against the run ---------------------------------------------
def _state(config, world: int = 1, rank: int = 0) -> ExchangeState:
    return ExchangeState(config, collectives=comm.LocalCollectives(comm.LocalGroup(world), rank))


def _saved(config) -> tuple[ExchangeState, dict]:
    """A state with a buffer of every kind its algorithm keeps for both weights, and its state_dict."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 24))
    state = _state(config)
    state.register_parameters(model.named_parameters())
    for name, p in model.named_parameters():
        if p.dim() == 2:
            for kind in state.algorithm.memory_kinds:
                shape = state.algorithm.memory_shape(kind, name, tuple(p.shape))
                if shape is None:
                    continue
                state.memory.buffer(kind, name, shape, torch.device("cpu")).normal_()
    return state, state.state_dict()


def test_a_checkpoint_made_by_the_same_run_loads() -> None:
    for config in (DGCConfig(), PowerSGDConfig(matrix_approximation_rank=2, start_iter=2)):
        state, saved = _saved(config)
        assert state.check_state_dict(saved) == []
        state.load_state_dict(saved)


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda m: m["velocity"].__setitem__("0.weight", torch.zeros(7)),
         r"'velocity' buffer of parameter '0.weight' has shape \(7,\), this run expects \(512,\)"),
        (lambda m: m["velocity"]["2.weight"].__setitem__(3, math.nan),
         r"'velocity' buffer of parameter '2.weight' holds NaN or inf"),
        (lambda m: m["momentum"].__setitem__("0.weight", m["momentum"]["0.weight"].double()),
         r"'momentum' buffer of parameter '0.weight' is torch.float64, the memory is torch.float32"),
        (lambda m: m["velocity"].__setitem__("9.weight", torch.zeros(3)),
         r"'velocity' buffer of parameter '9.weight': the model has no parameter of that name"),
        (lambda m: m.__setitem__("error", {"0.weight": torch.zeros(512)}),
         r"'error' buffer of parameter '0.weight': this run of dgc keeps no such buffer"),
    ],
    ids=["shape", "nan", "dtype", "unknown-parameter", "unknown-kind"],
)
def test_a_buffer_that_does_not_fit_is_an_error_naming_the_parameter_and_the_fix(corrupt, match) -> None:
    state, saved = _saved(DGCConfig())
    corrupt(saved["memory"])
    with pytest.raises(ValueError, match=match) as error:
        state.load_state_dict(saved)
    assert "delete the checkpoint's 'lightning_dgc' entry" in str(error.value)


@pytest.mark.parametrize("other_rank", [1, 3])
def test_powersgd_refuses_a_checkpoint_of_another_matrix_approximation_rank(other_rank: int) -> None:
    _, saved = _saved(PowerSGDConfig(matrix_approximation_rank=2, start_iter=2))
    state, _ = _saved(PowerSGDConfig(matrix_approximation_rank=other_rank, start_iter=2))
    problems = state.check_state_dict(saved)
    assert f"made with matrix_approximation_rank=2, this run has matrix_approximation_rank={other_rank}" in problems[0]
    assert "Resume with matrix_approximation_rank=2" in problems[0]
    assert any("'q' buffer of parameter '0.weight' has shape (16, 2)" in p for p in problems)


def test_powersgd_without_warm_start_refuses_the_q_it_would_drop() -> None:
    _, saved = _saved(PowerSGDConfig(matrix_approximation_rank=2, start_iter=2))
    state, _ = _saved(PowerSGDConfig(matrix_approximation_rank=2, start_iter=2, warm_start=False))
    with pytest.raises(ValueError, match=r"'q' buffer of parameter '0.weight': this run of powersgd keeps no such"):
        state.load_state_dict(saved)


# -- A checkpoint that lost buffers the run kept -------------------------------------------------------------------
def _exchanged_entry(config, steps: int = 4, world: int = 2) -> dict:
    """A checkpoint entry of ``world`` simulated ranks after ``steps`` real exchanges of a small MLP (biases and
    the small last layer averaged dense; its middle layer unused in every step: its gradient stays ``None``)."""

    def rank_run(collectives: comm.Collectives) -> dict:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 96), nn.Tanh(), nn.Linear(96, 96), nn.Linear(96, 4))
        state = ExchangeState(config, collectives=collectives)
        state.register_parameters(model.named_parameters())
        params = list(model.parameters())
        for step in range(steps):
            g = torch.Generator().manual_seed(10 * step + collectives.rank)
            for p in params:
                p.grad = None if any(p is q for q in model[2].parameters()) else torch.zeros_like(p)
            hook.exchange(state, params, torch.randn(sum(p.numel() for p in params), generator=g)).wait()
            state.finish_step()
        return state.state_dict()

    ranks = comm.simulate(world, rank_run)
    return {"algorithm": ranks[0]["algorithm"], "format": 2, "world_size": world, "ranks": ranks}


def _fresh_state(config) -> ExchangeState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 96), nn.Tanh(), nn.Linear(96, 96), nn.Linear(96, 4))
    state = _state(config)
    state.register_parameters(model.named_parameters())
    return state


_CONFIGS = {
    "dgc-momentum": DGCConfig(density=0.05, momentum=0.9),
    "dgc-no-momentum": DGCConfig(density=0.05),
    "powersgd-compressing": PowerSGDConfig(matrix_approximation_rank=1, start_iter=2),
    "powersgd-before-start": PowerSGDConfig(matrix_approximation_rank=1, start_iter=10),
    "powersgd-cold-start": PowerSGDConfig(matrix_approximation_rank=1, start_iter=2, warm_start=False),
}


@pytest.mark.parametrize("config", _CONFIGS.values(), ids=_CONFIGS.keys())
def test_what_a_run_keeps_resumes_whatever_buffers_it_never_made(config) -> None:
    """Kinds never allocated (momentum at 0, PowerSGD before start_iter, q without warm start), tensors averaged
    dense and unused parameters: the list names what the run held, so none of these is asked for."""
    entry = _exchanged_entry(config)
    check_checkpoint_entry(entry)
    for world in (1, 2):  # the same ranks, and the mean on another world size
        state = _fresh_state(config)
        state.load_state_dict(state_for_rank(entry, world, 0)[0])
        if world == 2:
            assert state.state_dict()["buffers"] == entry["ranks"][0]["buffers"]


@pytest.mark.parametrize("config", _CONFIGS.values(), ids=_CONFIGS.keys())
def test_a_checkpoint_that_lost_a_parameters_buffers_is_refused_naming_them_and_the_fix(config) -> None:
    entry = _exchanged_entry(config)
    kept = {kind: names for kind, names in entry["ranks"][0]["buffers"].items() if "0.weight" in names}
    if not kept:  # PowerSGD before start_iter keeps nothing: nothing can be lost
        assert entry["ranks"][0]["buffers"] == {}
        return
    for state in entry["ranks"]:  # lost on every rank alike (a per-rank difference is refused anyway)
        for kind in kept:
            del state["memory"][kind]["0.weight"]
    lost = ", ".join(f"'{kind}' of '0.weight'" for kind in kept)
    with pytest.raises(ValueError, match=r"\['ranks'\]\[0\]\['memory'\] lacks buffers .*: " + lost) as error:
        check_checkpoint_entry(entry)
    assert "delete checkpoint['lightning_dgc'] to start the exchange with empty buffers" in str(error.value)
    for world in (1, 2):
        with pytest.raises(ValueError, match="lacks buffers"):
            state_for_rank(entry, world, 0)
    state = _fresh_state(config)  # one rank's state on its own
    with pytest.raises(ValueError, match=f"no {next(iter(kept))!r} buffer of parameter '0.weight'") as error:
        state.load_state_dict(entry["ranks"][0])
    assert "delete the checkpoint's 'lightning_dgc' entry" in str(error.value)
    for state in entry["ranks"]:  # the way out the message names: those buffers restart from zeros
        del state["buffers"]
    _fresh_state(config).load_state_dict(state_for_rank(entry, 2, 0)[0])


# -- 5. A malformed checkpoint entry --------------------------------------------------------------------------
def _unlisted(state: dict) -> dict:
    """A rank's state without the list of its buffers (as written before the list was kept)."""
    return {k: v for k, v in state.items() if k != "buffers"}


def _entry() -> dict:
    _, saved = _saved(DGCConfig())
    return {"algorithm": "dgc", "format": 2, "world_size": 2, "ranks": [saved, dict(saved)]}


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda e: "dgc", r"checkpoint\['lightning_dgc'\] must be a dict written by lightning-dgc, got a str"),
        (lambda e: {k: v for k, v in e.items() if k != "ranks"}, r"\['ranks'\] must be a list, found nothing"),
        (lambda e: e | {"world_size": "2"}, r"\['world_size'\] must be a int, found a str"),
        (lambda e: e | {"ranks": e["ranks"][:1]}, r"world_size=2 ranks but holds 1 rank states"),
        (lambda e: e | {"ranks": [e["ranks"][0], "x"]}, r"\['ranks'\]\[1\] must be a dict with 'step' and 'memory'"),
        (lambda e: e | {"ranks": [e["ranks"][0], e["ranks"][1] | {"memory": {"velocity": {"0.weight": 1.0}}}]},
         r"\['ranks'\]\[1\]\['memory'\] must map every buffer kind to \{parameter name: tensor\}"),
        (lambda e: e | {"ranks": [e["ranks"][0], _unlisted(e["ranks"][1]) | {"memory": {"velocity": {}}}]},
         r"\['ranks'\]\[1\]\['memory'\] holds other buffers \(or shapes\) than rank 0's: 'momentum' of"
         r" '0.weight', 'momentum' of '2.weight', 'velocity' of '0.weight'"),
        (lambda e: e | {"ranks": [e["ranks"][0], e["ranks"][1] | {"memory": {"velocity": {}}}]},
         r"\['ranks'\]\[1\]\['memory'\] lacks buffers that the run which wrote it kept .*'momentum' of '0.weight'"),
        (lambda e: e | {"ranks": [e["ranks"][0], e["ranks"][1] | {"buffers": ["velocity"]}]},
         r"\['ranks'\]\[1\]\['buffers'\] must map every buffer kind to a list of parameter names"),
    ],
    ids=["string", "no-ranks", "world-size-type", "fewer-ranks", "rank-not-dict", "not-tensor", "other-layout",
         "missing-on-one-rank", "buffers-not-dict"],
)
def test_a_malformed_checkpoint_entry_is_an_error_naming_the_entry(make, match) -> None:
    entry = make(_entry())
    with pytest.raises(ValueError, match=match) as error:
        check_checkpoint_entry(entry)
    assert "delete checkpoint['lightning_dgc']" in str(error.value)
    for world in (1, 2):  # and on a resume at any world size
        with pytest.raises(ValueError, match=match):
            state_for_rank(entry, world, 0)


def test_a_well_formed_entry_passes_at_the_same_and_another_world_size() -> None:
    check_checkpoint_entry(_entry())
    assert state_for_rank(_entry(), 1, 0)[1] is True


# -- 8, 9. SparsityWarmup's run_fraction ------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -0.1, 1.5, math.nan])
def test_a_bad_run_fraction_is_rejected_with_its_own_message(bad) -> None:
    with pytest.raises(ValueError, match=r"`run_fraction` is the fraction of the run's optimizer steps") as error:
        SparsityWarmup(run_fraction=bad)
    assert "density" not in str(error.value) and "99.9%" not in str(error.value)


# -- The stall detector ----------------------------------------------------------------------------------------
def test_consecutive_skipped_steps_count_non_finite_steps_in_a_row_identically_on_every_rank() -> None:
    """Rank 1 sends inf in steps 1, 2, 3 and 5: both ranks count 1, 2, 3, then 0 after a finite step."""

    def rank_run(collectives: comm.Collectives) -> list[int]:
        torch.manual_seed(0)
        model = nn.Linear(64, 32)
        state = ExchangeState(DGCConfig(density=0.1), collectives=collectives)
        state.register_parameters(model.named_parameters())
        params, counts = list(model.parameters()), []
        for step in range(7):
            local = torch.randn(sum(p.numel() for p in params))
            if collectives.rank == 1 and step in (1, 2, 3, 5):
                local[0] = math.inf
            for p in params:
                p.grad = torch.zeros_like(p)
            hook.exchange(state, params, local)
            state.finish_step()
            counts.append(state.consecutive_skipped_steps)
        return counts

    assert comm.simulate(2, rank_run) == [[0, 1, 2, 3, 0, 1, 0]] * 2


@pytest.mark.parametrize("bad, match", [(-1, "must be >= 0"), (2.5, "must be an integer"), ("10", "must be an integer")])
def test_a_bad_max_consecutive_skips_is_rejected_naming_it(bad, match) -> None:
    from lightning_dgc import CompressionStrategy, DGCStrategy

    for strategy in (lambda: CompressionStrategy("powersgd", max_consecutive_skips=bad),
                     lambda: DGCStrategy(max_consecutive_skips=bad)):  # fmt: skip
        with pytest.raises(ValueError, match=f"`max_consecutive_skips` {match}"):
            strategy()
    assert DGCStrategy(max_consecutive_skips=None).max_consecutive_skips == 0  # off
