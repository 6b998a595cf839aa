"""``SparsityWarmup`` and ``CompressionMonitor`` on real Trainers: 2 CPU processes writing a real
TensorBoard event file, and 1-process runs for gradient accumulation, per-step warm-up and errors."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
from lightning.pytorch.loggers import Logger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader

from lightning_dgc import DGCStrategy
from lightning_dgc.schedules.warmup import CompressionMonitor, SparsityWarmup, warmup_density
from tests.lightning.fit_script import Regression, dataset
from tests.lightning.run import results, run_script

SCALARS = ("density", "ratio", "bytes_sent", "link_bytes", "inter_node_bytes", "dense_bytes", "selection_ms",
           "residual_norm")  # fmt: skip


@pytest.mark.slow
def test_two_ranks_warm_up_in_lockstep_and_rank_zero_logs_to_tensorboard(tmp_path: Path) -> None:
    out = tmp_path / "cb"
    epochs, steps_per_epoch, every = 5, 4, 2
    run_script("callbacks_script.py", out, "--epochs", str(epochs), "--log-every", str(every))
    rank0, rank1 = results(out)

    # Both ranks applied the same density at the same optimizer step, following the paper's schedule.
    expected = [warmup_density(e, 0, final_density=0.001) for e in range(epochs)]
    assert expected == [0.25, 0.0625, 0.015625, 0.004, 0.001]
    for summary in (rank0, rank1):
        steps = summary["steps"]
        assert [s["global_step"] for s in steps] == list(range(1, epochs * steps_per_epoch + 1))
        assert [s["density"] for s in steps] == [expected[s["epoch"]] for s in steps]
        assert [s["stats_density"] for s in steps] == [s["density"] for s in steps]
        assert summary["final_density"] == 0.001
    assert [(s["global_step"], s["density"]) for s in rank0["steps"]] == [
        (s["global_step"], s["density"]) for s in rank1["steps"]
    ]

    # Only rank 0 wrote TensorBoard events.
    event_files = sorted(Path(f"{out}.tb").rglob("events.out.tfevents.*"))
    assert event_files, "no TensorBoard event file was written"
    writers = {int(f.name.split(".")[-2]) for f in event_files}  # events.out.tfevents.<time>.<host>.<pid>.<n>
    assert writers == {rank0["pid"]} and rank1["pid"] not in writers

    acc = EventAccumulator(rank0["log_dir"])
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    logged_steps = list(range(every, epochs * steps_per_epoch + 1, every))
    series = {}
    for name in SCALARS:
        assert f"compression/{name}" in tags, f"compression/{name} missing from {sorted(tags)}"
        events = acc.Scalars(f"compression/{name}")
        assert [e.step for e in events] == logged_steps, name
        series[name] = [e.value for e in events]
    assert "compression/max_rank_selection_ms" not in tags  # DEFT only
    buildup = [e.value for e in acc.Scalars("compression/buildup_factor")]
    assert buildup and all(1.0 <= b <= 2.0 for b in buildup)  # DGC: 2 ranks' unions hold k to 2k indices

    for step, density in zip(logged_steps, series["density"], strict=True):
        assert density == pytest.approx(expected[(step - 1) // steps_per_epoch], rel=1e-6)
    for ratio, sent, dense in zip(series["ratio"], series["bytes_sent"], series["dense_bytes"], strict=True):
        assert sent > 0 and dense > sent
        assert ratio > 1 and ratio == pytest.approx(dense / sent, rel=1e-5)
    # at 2 ranks a ring all-reduce and an all-gather both carry what each rank hands them, once
    assert series["link_bytes"] == pytest.approx(series["bytes_sent"], rel=1e-6)
    assert series["inter_node_bytes"] == series["link_bytes"]  # a flat exchange: every byte may cross nodes
    assert series["ratio"][-1] > 5 * series["ratio"][0]  # 99.9% sparsity sends far less than 75%
    assert all(ms >= 0 for ms in series["selection_ms"])
    assert all(norm > 0 for norm in series["residual_norm"])


class RecordingLogger(Logger):
    """A logger that keeps every ``log_metrics`` call, to count what the monitor logged and when."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((step, dict(metrics)))

    def compression(self) -> list[tuple[int, dict[str, float]]]:
        return [(s, m) for s, m in self.calls if any(k.startswith("compression/") for k in m)]


class Recorder(L.Callback):
    def __init__(self) -> None:
        self.batches: list[tuple[int, int, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append((trainer.current_epoch, trainer.global_step, trainer.strategy.density))


def _fit(strategy: Any, callbacks: list[L.Callback], logger: Any = False, **trainer_kwargs: Any) -> L.Trainer:
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, logger=logger, callbacks=callbacks,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(Regression(), DataLoader(dataset(64), batch_size=16))  # 4 batches per epoch
    return trainer


def test_per_step_warmup_after_dense_epoch_under_gradient_accumulation() -> None:
    """4 batches, 2 accumulated: 2 optimizer steps per epoch; the monitor logs once per optimizer step."""
    warmup = SparsityWarmup(densities=[0.5, 0.25, 0.1], interval="step", dense_epochs=1)
    logger, recorder = RecordingLogger(), Recorder()
    _fit(
        DGCStrategy(density=0.01),
        [warmup, CompressionMonitor(log_every_n_steps=1), recorder],
        logger=logger,
        max_epochs=3,
        accumulate_grad_batches=2,
        log_every_n_steps=3,  # overridden by the monitor's own 1
    )
    # Density in force at optimizer steps 0..5: one dense epoch (2 steps), the list, then the final density.
    per_step = [1.0, 1.0, 0.5, 0.25, 0.1, 0.01]
    assert recorder.batches == [(b // 4, (b + 1) // 2, per_step[b // 2]) for b in range(12)]
    logged = logger.compression()
    assert [step for step, _ in logged] == [1, 2, 3, 4, 5, 6]  # not once per batch
    assert [m["compression/density"] for _, m in logged] == per_step
    assert all(set(m) == {f"compression/{n}" for n in (*SCALARS, "buildup_factor")} for _, m in logged)
    assert logged[0][1]["compression/ratio"] == pytest.approx(1.0, rel=0.05)  # density 1: all sent dense
    assert logged[-1][1]["compression/ratio"] > 5


def test_a_warmup_over_a_fraction_of_the_run_is_per_step_and_a_long_epoch_warmup_warns() -> None:
    """A short run: the paper's four stages over the first half of its 20 steps (3 steps each), 0.004
    clipped to the final 0.01; the per-epoch warm-up would take 4 of its 5 epochs, and says so."""
    recorder = Recorder()
    _fit(DGCStrategy(density=0.01), [SparsityWarmup(run_fraction=0.5), recorder], max_epochs=5)
    want = [0.25] * 3 + [0.0625] * 3 + [0.015625] * 3 + [0.01] * 11
    assert [density for _, _, density in recorder.batches] == want
    with pytest.warns(
        UserWarning, match=r"takes 4 of the run's 5 epochs.*SparsityWarmup\(run_fraction=0.2\)"
    ):
        _fit(DGCStrategy(density=0.01), [SparsityWarmup()], max_epochs=5, max_steps=1)
    with pytest.raises(ValueError, match="run_fraction"):
        SparsityWarmup(run_fraction=0.0)
    with pytest.raises(ValueError, match="leave `interval`"):
        SparsityWarmup(densities=[0.5], interval="step", run_fraction=0.2)


def test_a_run_fraction_warmup_that_takes_the_whole_short_run_warns() -> None:
    """3 steps for the paper's 4 stages (one step each at least): the final density is never reached."""
    recorder = Recorder()
    with pytest.warns(UserWarning, match=r"4 of the run's 3 optimizer steps .*never reaches the density 0.01"):
        _fit(DGCStrategy(density=0.01), [SparsityWarmup(run_fraction=0.2), recorder], max_steps=3)
    assert [density for _, _, density in recorder.batches] == [0.25, 0.0625, 0.015625]


def test_monitor_follows_the_trainers_log_every_n_steps() -> None:
    """It logs at steps 3 and 6 of 7, and reads the strategy's statistics in those steps only."""
    logger, strategy = RecordingLogger(), DGCStrategy(density=0.01)
    reads, read = [], strategy.compression_stats
    strategy.compression_stats = lambda: reads.append(1) or read()  # type: ignore[method-assign]
    _fit(strategy, [CompressionMonitor()], logger=logger, max_steps=7, log_every_n_steps=3)
    assert [step for step, _ in logger.compression()] == [3, 6]
    assert len(reads) == 2


def test_monitor_without_a_logger_warns() -> None:
    with pytest.warns(UserWarning, match="no logger"):
        _fit(DGCStrategy(density=0.01), [CompressionMonitor()], max_steps=1)


def test_warmup_reads_the_final_density_once_per_strategy() -> None:
    """Set up again with the same strategy (a second fit), the warm-up keeps the configured final density."""
    strategy, warmup = DGCStrategy(density=0.001), SparsityWarmup(densities=[0.5])
    _fit(strategy, [warmup], max_steps=2)  # stops in epoch 0: density 0.5 left in force
    assert strategy.density == 0.5 and warmup.final_density == 0.001
    warmup.setup(SimpleNamespace(strategy=strategy, world_size=1), Regression(), "fit")  # type: ignore[arg-type]
    assert warmup.final_density == 0.001
    warmup.setup(SimpleNamespace(strategy=DGCStrategy(density=0.01), world_size=1), Regression(), "fit")  # type: ignore[arg-type]
    assert warmup.final_density == 0.01


@pytest.mark.parametrize("callback", [SparsityWarmup(), CompressionMonitor()], ids=["warmup", "monitor"])
def test_callbacks_refuse_a_strategy_without_dgc(callback: L.Callback) -> None:
    with pytest.raises(TypeError, match='strategy="dgc"'):
        _fit("ddp", [callback], max_steps=1)


def test_monitor_rejects_a_bad_interval() -> None:
    with pytest.raises(ValueError, match="log_every_n_steps"):
        CompressionMonitor(log_every_n_steps=0)


def test_a_warmup_is_a_floor_under_the_automatic_density_and_the_monitor_logs_it() -> None:
    """density="auto" on one process: measured dense, then nothing to exchange keeps it dense; the warm-up's
    densities set the floor and its schedule ends at `min_density`; the monitor logs the automatic figures."""
    strategy = DGCStrategy(density="auto", min_density=0.02)
    warmup, logger, recorder = SparsityWarmup(densities=[0.5, 0.25], interval="step"), RecordingLogger(), Recorder()
    _fit(strategy, [warmup, CompressionMonitor(log_every_n_steps=1), recorder], logger=logger, max_steps=9)
    assert warmup.final_density == 0.02 and strategy.auto_density.floor == 0.02
    assert [density for _, _, density in recorder.batches] == [1.0] * 9
    last = logger.compression()[-1][1]
    assert last["compression/auto_density"] == 1.0 and last["compression/density"] == 1.0
    assert "compression/measured_exchange_ms" in last and last["compression/compute_window_ms"] > 0
    strategy.density = 0.3  # a schedule's density while the link asks for 1: the larger wins
    assert strategy.density == 1.0 and strategy.auto_density.floor == 0.3
