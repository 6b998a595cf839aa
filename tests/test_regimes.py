"""The critical-regime schedule's pure parts: the byte break-even, the two criteria, the window's
arithmetic and the errors of bad settings."""

from __future__ import annotations

import math

import pytest

from lightning_dgc import algorithms
from lightning_dgc.algorithms.base import ring_allreduce_volume
from lightning_dgc.algorithms.deft import DEFTConfig
from lightning_dgc.algorithms.dgc import DGCConfig
from lightning_dgc.perfmodel.breakeven import _PRICED_LAYOUT, breakeven_density
from lightning_dgc.schedules.regimes import CriticalRegimes, lr_dropped, norm_changed
from lightning_dgc.schedules.warmup import SparsityWarmup


def _link_ratio(name: str, config, density: float, world: int) -> float:
    import dataclasses

    numel = _PRICED_LAYOUT[0].numel
    cost = algorithms.get(name).wire_cost(
        dataclasses.replace(config, density=density), _PRICED_LAYOUT, world, numel * 4
    )
    return cost.link_bytes(world) / ring_allreduce_volume(numel * 4, world)


@pytest.mark.parametrize("world", [4, 8, 16, 64])
def test_the_break_even_density_costs_what_ddp_does(world: int) -> None:
    cap = breakeven_density(algorithms.get("dgc"), DGCConfig(density=0.001), world)
    assert _link_ratio("dgc", DGCConfig(), cap, world) <= 1.0
    assert _link_ratio("dgc", DGCConfig(), cap * 1.01, world) > 1.0
    # DGC's all-gather grows with the ranks: about 6 bytes a value against 4 (N-1)/N * 2 a gradient value
    assert cap == pytest.approx(4 / 6 * 2 / world, rel=0.02)


def test_the_break_even_is_one_where_no_density_costs_more_than_ddp() -> None:
    assert breakeven_density(algorithms.get("dgc"), DGCConfig(), 2) == 1.0  # 0.5 and over is sent whole
    assert breakeven_density(algorithms.get("dgc"), DGCConfig(), 1) == 1.0
    # DEFT's volume does not grow with the ranks: its break-even stays where tensors go whole
    for world in (2, 8, 64):
        assert breakeven_density(algorithms.get("deft"), DEFTConfig(), world) == pytest.approx(0.5, rel=1e-3)


def test_the_warm_up_never_sends_more_than_ddp() -> None:
    """At 8 ranks the paper's first stage (0.25) would carry 1.5x DDP's bytes: it runs at the break-even."""
    warmup = SparsityWarmup()
    warmup.final_density = 0.001
    warmup.cap = breakeven_density(algorithms.get("dgc"), DGCConfig(), 8)
    densities = [warmup.density_at(epoch, 0) for epoch in range(6)]
    assert densities == [pytest.approx(warmup.cap), 0.0625, 0.015625, 0.004, 0.001, 0.001]
    assert all(_link_ratio("dgc", DGCConfig(), d, 8) <= 1.0 for d in densities)
    dense_first = SparsityWarmup(dense_epochs=1)
    dense_first.final_density, dense_first.cap = 0.001, warmup.cap
    assert dense_first.density_at(0, 0) == 1.0  # a dense epoch is DDP's all-reduce, never capped
    assert SparsityWarmup(byte_cap=False).cap == 1.0


@pytest.mark.parametrize(
    ("lr", "reference", "dropped"),
    [(0.05, 0.1, True), (0.01, 0.1, True), (0.06, 0.1, False), (0.1, 0.1, False), (0.2, 0.1, False)],
)
def test_a_drop_of_half_or_more_starts_a_regime(lr: float, reference: float, dropped: bool) -> None:
    assert lr_dropped(lr, reference, 2.0) is dropped


def test_the_norm_criterion_is_the_relative_change_between_intervals() -> None:
    assert norm_changed(None, 5.0, 0.5) is False  # the first interval has nothing to compare with
    assert norm_changed(10.0, 4.9, 0.5) is True
    assert norm_changed(10.0, 15.0, 0.5) is True
    assert norm_changed(10.0, 14.9, 0.5) is False
    assert norm_changed(10.0, math.nan, 0.5) is False


def test_the_window_raises_the_density_by_the_factor_within_the_cap() -> None:
    regimes = CriticalRegimes(window=0.1, factor=10)
    regimes.target, regimes.window_steps = 0.001, 5
    regimes.begin(0)
    regimes.begin(20)
    assert [regimes.density_at(step) for step in (0, 4, 5, 19, 20, 24, 25)] == [
        0.01, 0.01, 0.001, 0.001, 0.01, 0.01, 0.001,
    ]  # fmt: skip
    assert regimes.density_at(0, base=0.25) == 0.25  # a denser warm-up wins
    assert regimes.starts == [0, 20]
    regimes.cap = 0.004
    assert regimes.critical_density == 0.004  # never dearer than DDP
    regimes.target = 0.5
    assert regimes.critical_density == 0.5  # never below the target


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"window": 0}, "`window` must be a finite number > 0"),
        ({"window": math.inf}, "`window` must be a finite number"),
        ({"window": 1.5}, r"must lie in \(0, 1\]"),
        ({"window": "a tenth"}, "window"),
        ({"factor": math.nan}, "`factor` must be a finite number >= 1"),
        ({"factor": 0.5}, "`factor` must be a finite number >= 1"),
        ({"factor": -2}, "`factor`"),
        ({"lr_drop": 1.0}, "`lr_drop` must be > 1"),
        ({"norm_change": 0}, "`norm_change` must be a finite number > 0"),
        ({"criterion": "loss"}, "`criterion` must be one of"),
        ({"interval": 0}, "`interval` must be 'epoch' or a number"),
    ],
)
def test_bad_settings_are_refused_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        CriticalRegimes(**kwargs)
