"""The sparsity warm-up schedule as a pure function of (epoch, step): no Trainer, no processes."""

from __future__ import annotations

import math

import pytest

from lightning_dgc.schedules.warmup import PAPER_WARMUP_DENSITIES, SparsityWarmup, warmup_density


def test_paper_schedule_per_epoch() -> None:
    got = [warmup_density(epoch, step=0, final_density=0.001) for epoch in range(7)]
    assert got == [0.25, 0.0625, 0.015625, 0.004, 0.001, 0.001, 0.001]
    # Sparsity 75%, 93.75%, 98.4375%, 99.6%, then 99.9%.
    assert [round(100 * (1 - d), 4) for d in got[:5]] == [75.0, 93.75, 98.4375, 99.6, 99.9]


def test_paper_schedule_ignores_the_step_and_is_never_sparser_than_the_final_density() -> None:
    assert warmup_density(2, step=10_000, final_density=0.001) == 0.015625
    assert [warmup_density(e, 0, final_density=0.01) for e in range(5)] == [
        0.25,
        0.0625,
        0.015625,
        0.01,
        0.01,
    ]
    assert [warmup_density(e, 0, final_density=1.0) for e in range(5)] == [1.0] * 5


def test_custom_per_epoch_list() -> None:
    schedule = [0.5, 0.1]
    got = [warmup_density(e, step=3 * e, final_density=0.01, densities=schedule) for e in range(4)]
    assert got == [0.5, 0.1, 0.01, 0.01]
    assert warmup_density(0, 0, final_density=0.01, densities=[]) == 0.01


def test_custom_per_step_list_ignores_the_epoch() -> None:
    schedule = [0.5, 0.25, 0.125]
    got = [warmup_density(0, s, 0.01, schedule, interval="step") for s in range(5)]
    assert got == [0.5, 0.25, 0.125, 0.01, 0.01]
    assert warmup_density(7, 1, 0.01, schedule, interval="step") == 0.25


def test_dense_epochs_shift_the_epoch_schedule() -> None:
    got = [warmup_density(e, 0, final_density=0.001, dense_epochs=2) for e in range(8)]
    assert got == [1.0, 1.0, 0.25, 0.0625, 0.015625, 0.004, 0.001, 0.001]
    got = [warmup_density(e, 0, 0.01, [0.5], dense_epochs=1) for e in range(3)]
    assert got == [1.0, 0.5, 0.01]


def test_dense_epochs_shift_the_step_schedule_by_whole_epochs() -> None:
    # 3 optimizer steps per epoch, 1 dense epoch: steps 0-2 dense, then the list from step 3 on.
    def at(step: int) -> float:
        return warmup_density(step // 3, step, 0.01, [0.5, 0.25], "step", dense_epochs=1, steps_per_epoch=3)

    assert [at(s) for s in range(7)] == [1.0, 1.0, 1.0, 0.5, 0.25, 0.01, 0.01]
    with pytest.raises(ValueError, match="steps_per_epoch"):
        warmup_density(1, 3, 0.01, [0.5], "step", dense_epochs=1)


def test_paper_schedule_matches_the_constant() -> None:
    assert PAPER_WARMUP_DENSITIES == (0.25, 0.0625, 0.015625, 0.004)
    assert all(math.isclose(d, 0.25 ** (i + 1), rel_tol=0.03) for i, d in enumerate(PAPER_WARMUP_DENSITIES))


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, float("nan"), float("inf"), "0.1", True])
def test_bad_densities_are_rejected(bad) -> None:
    with pytest.raises(ValueError, match=r"densities\[1\]"):
        SparsityWarmup(densities=[0.5, bad])


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="interval"):
        SparsityWarmup(interval="batch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="per step"):
        SparsityWarmup(interval="step")
    with pytest.raises(ValueError, match="dense_epochs"):
        SparsityWarmup(dense_epochs=-1)
    with pytest.raises(ValueError, match="dense_epochs"):
        SparsityWarmup(dense_epochs=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="interval"):
        warmup_density(0, 0, 0.01, interval="batch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="per step"):
        warmup_density(0, 0, 0.01, interval="step")


def test_callback_needs_setup_before_it_knows_the_final_density() -> None:
    warmup = SparsityWarmup()
    with pytest.raises(RuntimeError, match="setup"):
        warmup.density_at(0, 0)
    warmup.final_density = 0.001
    assert [warmup.density_at(e, 0) for e in range(5)] == [0.25, 0.0625, 0.015625, 0.004, 0.001]
