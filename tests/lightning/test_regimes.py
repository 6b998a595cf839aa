"""``CriticalRegimes`` on real Trainers: 2 CPU processes in lockstep with a learning-rate schedule, the
resume inside a window, the norm criterion without a scheduler, and the errors of misuse."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader

from lightning_dgc import DGCStrategy
from lightning_dgc.schedules.regimes import CriticalRegimes
from lightning_dgc.schedules.warmup import SparsityWarmup
from tests.lightning.callbacks_script import DecayingRegression
from tests.lightning.fit_script import Regression, dataset
from tests.lightning.run import results, run_script
from tests.lightning.test_callbacks import Recorder


@pytest.mark.slow
def test_two_ranks_apply_the_same_regimes_and_rank_zero_logs_the_flag(tmp_path: Path) -> None:
    """20 steps, the learning rate / 10 at steps 8 and 16, windows of 2 steps at factor 10 over the paper's
    warm-up: the higher of the two at every step, on both ranks."""
    out = tmp_path / "regimes"
    run_script("callbacks_script.py", out, "--epochs", "5", "--log-every", "1", "--regimes")
    rank0, rank1 = results(out)
    warm = [0.25] * 4 + [0.0625] * 4 + [0.015625] * 4 + [0.004] * 4 + [0.001] * 4
    critical = {0, 1, 8, 9, 16, 17}
    expected = [max(w, 0.01) if step in critical else w for step, w in enumerate(warm)]
    assert expected[16:] == [0.01, 0.01, 0.001, 0.001]
    for summary in (rank0, rank1):
        assert [s["density"] for s in summary["steps"]] == expected
        assert [s["stats_density"] for s in summary["steps"]] == expected
    acc = EventAccumulator(rank0["log_dir"])
    acc.Reload()
    flags = {e.step: e.value for e in acc.Scalars("compression/critical")}
    assert flags == {step + 1: float(step in critical) for step in range(20)}


def _trainer(callbacks: list[L.Callback], root: Path | None = None, **kwargs: Any) -> L.Trainer:
    saves = any(isinstance(c, ModelCheckpoint) for c in callbacks)
    return L.Trainer(
        strategy=DGCStrategy(density=0.001), accelerator="cpu", devices=1, logger=False, callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=saves,
        default_root_dir=root, **kwargs,
    )  # fmt: skip


def _loader() -> DataLoader:
    return DataLoader(dataset(64), batch_size=16)  # 4 optimizer steps per epoch, always in the same order


def test_a_run_resumed_inside_a_window_takes_the_densities_and_weights_of_a_straight_run(
    tmp_path: Path,
) -> None:
    """Windows of 6 steps (0.2 of 30) at the start and at the learning-rate drops; the run resumes from its
    checkpoint of step 12, inside the second window."""
    straight = Recorder()
    torch.manual_seed(0)
    model = DecayingRegression()
    saver = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=6, save_top_k=-1)
    trainer = _trainer([CriticalRegimes(window=0.2), straight, saver], tmp_path, max_steps=30, max_epochs=8)
    trainer.fit(model, _loader())
    densities = [d for _, _, d in straight.batches]
    assert densities == ([0.01] * 6 + [0.001] * 2) * 3 + [0.01] * 6  # drops at steps 8, 16 and 24

    resumed, resumed_model = Recorder(), DecayingRegression()
    again = _trainer([CriticalRegimes(window=0.2), resumed], tmp_path, max_steps=30, max_epochs=8)
    again.fit(resumed_model, _loader(), ckpt_path=tmp_path / "epoch=2-step=12.ckpt")
    assert [d for _, _, d in resumed.batches] == densities[12:]
    for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_without_a_scheduler_the_norm_criterion_starts_regimes_and_lr_warns() -> None:
    """The gradient norm falls as the regression converges: the norm test fires after some epoch, and the
    density follows the regimes it started."""
    recorder = Recorder()
    schedule = CriticalRegimes(window=0.05, criterion="lr")
    with pytest.warns(UserWarning, match="no learning-rate scheduler: the gradient-norm criterion"):
        _trainer([schedule, recorder], max_epochs=10).fit(Regression(lr=0.05), _loader())
    assert schedule.starts[0] == 0 and len(schedule.starts) > 1  # the norm test started at least one more
    assert all(start % 4 == 0 for start in schedule.starts)  # at epoch ends (the norm's interval)
    densities = [d for _, _, d in recorder.batches]
    assert densities == [0.01 if schedule.critical_at(step) else 0.001 for step in range(40)]


def test_the_schedule_takes_over_the_warm_up_whatever_the_order() -> None:
    recorders = []
    for order in (0, 1):
        recorder = Recorder()
        callbacks: list[L.Callback] = [
            CriticalRegimes(window=0.1),
            SparsityWarmup(densities=[0.5] * 3 + [0.002] * 3, interval="step"),
        ]
        if order:
            callbacks.reverse()
        _trainer([*callbacks, recorder], max_steps=20).fit(DecayingRegression(), _loader())
        recorders.append([d for _, _, d in recorder.batches])
    assert (
        recorders[0]
        == recorders[1]
        == [0.5] * 3 + [0.002] * 3 + [0.001] * 2 + [0.01] * 2 + [0.001] * 6 + [0.01] * 2 + [0.001] * 2
    )


def test_the_schedule_on_an_algorithm_without_a_density_is_an_error() -> None:
    trainer = L.Trainer(
        strategy="powersgd", accelerator="cpu", devices=1, logger=False, callbacks=[CriticalRegimes()],
        enable_progress_bar=False, enable_model_summary=False, max_steps=1,
    )  # fmt: skip
    with pytest.raises(TypeError, match='CriticalRegimes changes the density.*has none.*strategy="dgc"'):
        trainer.fit(Regression(), _loader())


def test_with_the_automatic_density_the_schedule_is_a_floor_from_min_density() -> None:
    """``density="auto"``: the target is ``min_density`` and the windows raise the floor under the link's choice."""
    schedule = CriticalRegimes(window=0.25)
    trainer = L.Trainer(
        strategy=DGCStrategy(density="auto", min_density=0.002), accelerator="cpu", devices=1, logger=False,
        callbacks=[schedule], enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        max_steps=8,
    )  # fmt: skip
    trainer.fit(DecayingRegression(), _loader())
    assert schedule.target == 0.002 and schedule.critical_density == 0.02
    assert schedule.starts == [0]  # the learning rate drops at step 8, after the run
