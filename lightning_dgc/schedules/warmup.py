"""Lightning callbacks for DGC: the sparsity warm-up and the compression monitor.

What changes over training (the density in force) and what is reported (bytes on the wire,
compression ratio, residual size) live here rather than in the strategy, so that the strategy
stays a plain exchange with one ``density`` knob.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_dgc.algorithms.checks import check_density, check_schedulable, flag, real_number
from lightning_dgc.perfmodel.breakeven import breakeven_density

Interval = Literal["epoch", "step"]

#: The DGC paper's warm-up (Lin et al., 2018, Sec. 3.3): sparsity 75%, 93.75%, 98.4375%, 99.6% in
#: epochs 0-3, i.e. the density shrinks exponentially (by 4x per epoch) before the final 99.9%.
PAPER_WARMUP_DENSITIES: tuple[float, ...] = (0.25, 0.0625, 0.015625, 0.004)


def warmup_density(
    epoch: int,
    step: int,
    final_density: float,
    densities: Sequence[float] | None = None,
    interval: Interval = "epoch",
    dense_epochs: int = 0,
    steps_per_epoch: int | None = None,
) -> float:
    """The density in force at ``epoch`` / optimizer ``step``: a pure function, so it survives resume.

    Args:
        epoch: the current epoch (``trainer.current_epoch``), counted from 0.
        step: optimizer steps done so far (``trainer.global_step``): the index of the step about to run.
        final_density: the density once the warm-up is over (the strategy's configured density).
        densities: the warm-up, one density per epoch (``interval="epoch"``) or per optimizer step
            (``interval="step"``). ``None`` is the paper's schedule :data:`PAPER_WARMUP_DENSITIES`
            (per epoch), never sparser than ``final_density``: with ``final_density=0.01`` it is
            0.25, 0.0625, 0.015625, 0.01, ...
        interval: what one entry of ``densities`` lasts: an epoch or an optimizer step.
        dense_epochs: epochs of density 1.0 before the warm-up starts; the warm-up is shifted by them.
            At density 1 every tensor is averaged whole and its momentum is not masked, so these epochs
            train exactly as DDP + SGD with momentum.
        steps_per_epoch: optimizer steps per epoch; needed only for ``interval="step"`` with
            ``dense_epochs > 0``, where the step schedule starts after ``dense_epochs * steps_per_epoch``.
    """
    if interval not in ("epoch", "step"):
        raise ValueError(f"`interval` must be 'epoch' or 'step', got {interval!r}.")
    if dense_epochs < 0:
        raise ValueError(f"`dense_epochs` must be >= 0, got {dense_epochs!r}.")
    if epoch < dense_epochs:
        return 1.0
    if densities is None:
        if interval != "epoch":
            raise ValueError(
                "The paper's warm-up is per epoch; pass an explicit `densities` list to warm up per step."
            )
        index = epoch - dense_epochs
        if index < len(PAPER_WARMUP_DENSITIES):
            return max(PAPER_WARMUP_DENSITIES[index], final_density)
        return final_density
    if interval == "epoch":
        index = epoch - dense_epochs
    else:
        if dense_epochs and steps_per_epoch is None:
            raise ValueError("`steps_per_epoch` is needed to shift a per-step warm-up by `dense_epochs`.")
        index = max(0, step - dense_epochs * (steps_per_epoch or 0))
    return float(densities[index]) if index < len(densities) else final_density


def spread_warmup(
    steps: int, fraction: float, final_density: float, stages: Sequence[float] | None = None
) -> list[float]:
    """A per-step warm-up over the first ``fraction`` of a run of ``steps`` optimizer steps: each of
    ``stages`` (the paper's :data:`PAPER_WARMUP_DENSITIES` by default, never sparser than
    ``final_density``) for ``ceil(fraction * steps / len(stages))`` steps, at least one.
    ``SparsityWarmup(run_fraction=...)`` applies it; the list suits ``SparsityWarmup(densities=...,
    interval="step")``."""
    if stages is None:
        stages = [max(d, final_density) for d in PAPER_WARMUP_DENSITIES]
    stage = max(1, math.ceil(fraction * steps / max(1, len(stages))))
    return [float(d) for d in stages for _ in range(stage)]


def check_run_fraction(run_fraction: object) -> float:
    """``run_fraction`` as a float if it lies in (0, 1]; a ``ValueError`` naming the argument otherwise."""
    value = real_number(run_fraction, "run_fraction")
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise ValueError(
            "`run_fraction` is the fraction of the run's optimizer steps that the warm-up takes and must lie in"
            f" (0, 1], got {run_fraction!r}. Use 0.2 to warm up over the first fifth of the run."
        )
    return value


class SparsityWarmup(L.Callback):
    """Raise the sparsity gradually at the start of training (DGC's "warm-up training").

    Early gradients change fast, and sending only 0.1% of them from the first step delays
    convergence; the paper starts at 75% sparsity and raises it exponentially to 99.9% over the
    first four epochs. By default this callback applies density 0.25, 0.0625, 0.015625 and 0.004 in
    epochs 0-3 and the strategy's configured density (e.g. ``DGCStrategy(density=0.001)``, read once
    when the callback is first set up with that strategy) from epoch 4 on.

    The density in force is a pure function of ``(trainer.current_epoch, trainer.global_step)``
    (:func:`warmup_density`): it needs no callback state in checkpoints, is right after a resume,
    and every rank applies the same density at the same optimizer step. It is applied by setting
    ``trainer.strategy.density`` in ``on_train_epoch_start`` and, for ``interval="step"``, in
    ``on_train_batch_start`` (under gradient accumulation all batches of one optimizer step see
    the same ``global_step``, hence the same density).

    Args:
        densities: the warm-up densities, one per epoch or per optimizer step (see ``interval``), each
            in (0, 1]; ``None`` is the paper's schedule. After the list the strategy's density applies.
            An empty list means no warm-up (only ``dense_epochs``).
        interval: ``"epoch"`` (default) or ``"step"``: what one entry of ``densities`` lasts. A
            per-step warm-up needs an explicit ``densities`` list.
        dense_epochs: epochs of density 1.0 before the warm-up (the schedule starts after them). With
            ``interval="step"`` the optimizer steps per epoch are taken from the Trainer
            (``ceil(num_training_batches / accumulate_grad_batches)``), so the train loader needs a length.
        run_fraction: for runs too short for a warm-up in epochs: the warm-up (``densities``, or the
            paper's four stages) spread evenly over this fraction of the run's optimizer steps
            (``trainer.estimated_stepping_batches``), each stage lasting ``ceil(run_fraction * steps /
            stages)`` steps. ``SparsityWarmup(run_fraction=0.2)`` on a 4-epoch run warms up in the
            first 0.8 epochs instead of all four. A per-epoch warm-up that takes half of ``max_epochs``
            or more warns and suggests it.
        byte_cap: never send more than DDP would (default ``True``): a stage denser than the density at
            which the algorithm's exchange carries as many link bytes as DDP's ring all-reduce at this
            world size (:func:`lightning_dgc.perfmodel.breakeven.breakeven_density`: about 1.3/N for DGC, whose values
            and indices take about 6 bytes against the all-reduce's 2 x 4 (N-1)/N: 0.167 at 8 processes)
            runs at that density instead. Stages of density 1 (dense) are DDP's all-reduce.

    With ``DGCStrategy(density="auto")`` the schedule is a floor: the density in force is the larger of the
    schedule's and the one the link asks for (:mod:`lightning_dgc.schedules.auto_density`), and the schedule ends at the
    strategy's ``min_density``. The schedule says how light compression must be, the link how heavy it needs
    to be; while the link is measured the exchange is dense.

    Example::

        Trainer(strategy=DGCStrategy(density=0.001), callbacks=[SparsityWarmup()])
        Trainer(strategy=DGCStrategy(density=0.001), max_epochs=4, callbacks=[SparsityWarmup(run_fraction=0.2)])
    """

    def __init__(
        self,
        densities: list[float] | None = None,
        interval: Interval = "epoch",
        dense_epochs: int = 0,
        run_fraction: float | None = None,
        byte_cap: bool = True,
    ) -> None:
        if interval not in ("epoch", "step"):
            raise ValueError(f"`interval` must be 'epoch' or 'step', got {interval!r}.")
        if run_fraction is not None:
            if interval != "epoch":
                raise ValueError(
                    "`run_fraction` spreads the warm-up over a fraction of the run's steps by itself; leave"
                    f" `interval` at its default (got interval={interval!r})."
                )
            run_fraction = check_run_fraction(run_fraction)
        if densities is None and interval == "step":
            raise ValueError(
                "The paper's warm-up is per epoch; pass `densities=[...]` (one per optimizer step) to warm up"
                " per step with interval='step'."
            )
        if isinstance(dense_epochs, bool) or not isinstance(dense_epochs, int) or dense_epochs < 0:
            raise ValueError(f"`dense_epochs` must be an integer >= 0, got {dense_epochs!r}.")
        self.densities = (
            None
            if densities is None
            else [check_density(d, f"densities[{i}]") for i, d in enumerate(densities)]
        )
        self.interval: Interval = interval
        self.dense_epochs = dense_epochs
        self.run_fraction = run_fraction
        self._stages = self.densities  # the schedule run_fraction spreads (None: the paper's)
        self.final_density: float | None = None
        self._strategy: object | None = None  # the strategy final_density was read from
        self.byte_cap = flag(byte_cap, "byte_cap")
        self.cap = 1.0  # the highest density a stage may have (set in setup from the world size)
        #: A schedule that applies this warm-up's density itself (``CriticalRegimes``), or ``None``.
        self.applied_by: object | None = None

    def density_at(self, epoch: int, step: int, steps_per_epoch: int | None = None) -> float:
        """The density this callback applies at ``epoch`` / optimizer ``step`` (after :meth:`setup`)."""
        if self.final_density is None:
            raise RuntimeError(
                "SparsityWarmup reads the final density from the strategy in `setup`; call it first."
            )
        density = warmup_density(
            epoch,
            step,
            self.final_density,
            self.densities,
            self.interval,
            self.dense_epochs,
            steps_per_epoch,
        )
        if density < 1.0 and density > self.cap:  # a stage dearer than DDP's all-reduce (density 1 is one)
            density = max(self.cap, self.final_density)
        return density

    def warmup_density(self, trainer: L.Trainer) -> float:
        """The density this warm-up asks for at the Trainer's current epoch and optimizer step."""
        return self.density_at(trainer.current_epoch, trainer.global_step, self._steps_per_epoch(trainer))

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        check_schedulable(strategy, "SparsityWarmup")
        # Read once per strategy: the warm-up itself changes `strategy.density`, so a second `fit`
        # with the same Trainer must not take a warm-up value for the final one.
        if strategy is not self._strategy:
            auto = getattr(strategy, "auto_density", None)
            # density="auto": the schedule is a floor under the link's density, ending at `min_density`
            self.final_density = (
                auto.min_density if auto is not None else check_density(strategy.density, "strategy.density")
            )
            self._strategy = strategy
        if self.byte_cap:
            self.cap = breakeven_density(strategy.algorithm_class, strategy.config, trainer.world_size)
        epochs = getattr(trainer, "max_epochs", None)
        if self.run_fraction is None and self.interval == "epoch" and epochs is not None and epochs > 0:
            warm = self.dense_epochs + len(
                self.densities if self.densities is not None else PAPER_WARMUP_DENSITIES
            )
            if 2 * warm >= epochs:
                rank_zero_warn(
                    f"SparsityWarmup: the warm-up takes {warm} of the run's {epochs} epochs, so the run spends"
                    f" {'all' if warm >= epochs else 'half or more'} of its time above the density"
                    f" {self.final_density:g}. For a short run, spread the warm-up over a fraction of it:"
                    " SparsityWarmup(run_fraction=0.2)."
                )

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.run_fraction is None:
            return
        # The run's length, hence the schedule, is the same for every rank and after a resume.
        steps = trainer.estimated_stepping_batches
        if not math.isfinite(steps):
            raise ValueError(
                "SparsityWarmup(run_fraction=...) needs the run's length, but it is unbounded: set"
                " max_epochs or max_steps (and give the train dataloader a length), or warm up per epoch."
            )
        self.densities = spread_warmup(int(steps), self.run_fraction, self.final_density or 0.0, self._stages)
        self.interval = "step"
        warm, stages = len(self.densities), len(self._stages or PAPER_WARMUP_DENSITIES)
        if warm >= steps or self.run_fraction * steps < stages:  # every stage lasts one step at least
            reached = "never reaches" if warm >= steps else "reaches only after"
            rank_zero_warn(
                f"SparsityWarmup(run_fraction={self.run_fraction:g}): the warm-up's {stages} stages take one step"
                f" each at least, {warm} of the run's {int(steps)} optimizer steps (more than the"
                f" {self.run_fraction:g} asked), so the run {reached} the density {self.final_density:g}. Train"
                " for more steps (max_steps / max_epochs), or pass fewer stages (`densities=[...]`)."
            )

    def _steps_per_epoch(self, trainer: L.Trainer) -> int | None:
        if self.interval != "step" or not self.dense_epochs:
            return None
        batches = trainer.num_training_batches
        if not math.isfinite(batches):
            raise ValueError(
                "SparsityWarmup(interval='step', dense_epochs>0) needs the number of steps per epoch, but the"
                " train dataloader has no length. Use `dense_epochs=0` and put the dense steps (1.0) at the"
                " start of `densities` instead."
            )
        return math.ceil(int(batches) / trainer.accumulate_grad_batches)

    def _apply(self, trainer: L.Trainer) -> float:
        density = self.warmup_density(trainer)
        if self.applied_by is None and trainer.strategy.density != density:
            trainer.strategy.density = density
        return density

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        density = self._apply(trainer)
        if self.interval == "epoch":
            rank_zero_info(f"SparsityWarmup: density {density:g} in epoch {trainer.current_epoch}.")

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.interval == "step":
            self._apply(trainer)


class CompressionMonitor(L.Callback):
    """Log what the gradient exchange puts on the wire, to the Trainer's logger(s) (TensorBoard by default).

    Every ``log_every_n_steps`` optimizer steps (after the step, in ``on_train_batch_end``; under
    gradient accumulation only after batches that ran an optimizer step), global rank 0 logs, at
    ``step=trainer.global_step``, the statistics of the last optimizer step from
    ``trainer.strategy.compression_stats()``. The values are rank 0's own: no collective is issued
    (every rank sends payloads of the same size, so the byte counts hold for every rank). Between the
    steps it logs it reads nothing (and on other ranks it never does): its cost is that of the steps
    logged (the statistics, the residual norm, the build-up count asked for before the step).

    Scalars (``prefix`` is ``"compression/"`` by default):

    * ``compression/density``: the density in force, the fraction of each compressed tensor's
      values sent per step (changes under :class:`SparsityWarmup`).
    * ``compression/ratio``: dense bytes / bytes actually sent, counting indices, values, padding
      and the tensors averaged dense; what DGC saves on the wire (1 = nothing saved).
    * ``compression/bytes_sent``: bytes this rank handed to the collectives in the step (sparse payloads
      plus dense all-reduce).
    * ``compression/link_bytes``: bytes each worker's link carried in the step, every collective a
      ring (an all-gather forwards all ranks' payloads; DDP's ring all-reduce would carry
      ``2 (N-1)/N`` times ``dense_bytes``).
    * ``compression/inter_node_bytes``: the part of ``link_bytes`` that crosses nodes (all of it on a
      flat exchange; the algorithm's exchange of this rank's shard in a two-level one).
    * ``compression/dense_bytes``: bytes plain DDP would have all-reduced for the same gradients.
    * ``compression/selection_ms``: milliseconds spent selecting the top-k values in the step (rank 0).
    * ``compression/residual_norm``: L2 norm of the gradient held back in the local memory (all
      velocities of rank 0); a steadily growing value means the density is too low to keep up.
    * ``compression/buildup_factor``: distinct indices in the union of all ranks' selections divided
      by k, the values the density asks for (gradient build-up: 1 for DEFT, up to the number of
      ranks for DGC).
    * ``compression/link_bytes_per_step`` (:class:`~lightning_dgc.DiLoCoStrategy` only): the link bytes of every
      outer exchange so far divided by the optimizer steps (the other byte counts are the step's: 0 inside a round).
    * ``compression/max_rank_selection_ms`` (DEFT only, when reported): the slowest rank's
      selection time, the one that holds the step back.
    * with ``density="auto"`` (:mod:`lightning_dgc.schedules.auto_density`): ``compression/auto_density`` (the density
      the link asks for; ``compression/density`` is the one in force), ``compression/predicted_exchange_ms``
      (the model's exchange time at the density in force), ``compression/measured_exchange_ms`` (the time the
      step's collectives were in flight), ``compression/compute_window_ms`` and ``compression/link_mbit_s``
      (what the last measuring phase found).

    Args:
        log_every_n_steps: log after every this many optimizer steps (when ``global_step`` is a
            multiple of it); ``None`` uses the Trainer's ``log_every_n_steps`` (0 there: no logging).
        prefix: prepended to every scalar name.
    """

    #: TensorBoard name (after the prefix) -> key of ``compression_stats()``; missing keys are skipped.
    SCALARS: dict[str, str] = {
        "density": "density",
        "ratio": "compression_ratio",
        "bytes_sent": "bytes_sent",
        "link_bytes": "link_bytes",
        "inter_node_bytes": "inter_node_bytes",
        "dense_bytes": "dense_bytes",
        "selection_ms": "selection_ms",
        "buildup_factor": "buildup_factor",
        "max_rank_selection_ms": "max_rank_selection_ms",
        "link_bytes_per_step": "link_bytes_per_step",
        "auto_density": "auto_density",
        "predicted_exchange_ms": "predicted_exchange_ms",
        "measured_exchange_ms": "measured_exchange_ms",
        "compute_window_ms": "compute_window_ms",
        "link_mbit_s": "link_mbit_s",
    }

    def __init__(self, log_every_n_steps: int | None = None, prefix: str = "compression/") -> None:
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool)
            or not isinstance(log_every_n_steps, int)
            or log_every_n_steps < 1
        ):
            raise ValueError(
                f"`log_every_n_steps` must be an integer >= 1 or None, got {log_every_n_steps!r}."
            )
        self.log_every_n_steps = log_every_n_steps
        self.prefix = prefix
        self._every = log_every_n_steps or 1
        self._last_seen_step: Any = (
            None  # stats["step"] of the last step logged: the same value = no new optimizer step
        )

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not callable(getattr(trainer.strategy, "compression_stats", None)):
            raise TypeError(
                f"CompressionMonitor reads `compression_stats()` from the strategy, but"
                f' {type(trainer.strategy).__name__} has none. Use `Trainer(strategy="dgc")` (or'
                " `strategy=DGCStrategy(...)`) with this callback."
            )
        every = self.log_every_n_steps if self.log_every_n_steps is not None else trainer.log_every_n_steps
        self._every = int(every)  # 0 (Trainer(log_every_n_steps=0)) turns logging off
        if not trainer.loggers:
            rank_zero_warn(
                "CompressionMonitor: the Trainer has no logger (logger=False); nothing will be logged."
            )

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_seen_step = None

    def metrics(self, trainer: L.Trainer, stats: dict[str, Any]) -> dict[str, float]:
        """The scalars to log for ``stats`` (one optimizer step's ``compression_stats()``)."""
        out = {self.prefix + name: float(stats[key]) for name, key in self.SCALARS.items() if key in stats}
        if not stats.get("bytes_sent"):  # nothing was sent: the ratio is infinite, not worth a point
            out.pop(self.prefix + "ratio", None)
        residual_norm = getattr(trainer.strategy, "residual_norm", None)
        if callable(residual_norm) and (norm := residual_norm()) is not None:
            out[self.prefix + "residual_norm"] = float(norm)
        return out

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # The build-up factor costs a host synchronisation per bucket: measured only in steps logged.
        request = getattr(trainer.strategy, "request_buildup", None)
        if callable(request) and self._every and (trainer.global_step + 1) % self._every == 0:
            request()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if (
            not trainer.is_global_zero
            or not trainer.loggers
            or not self._every
            or trainer.global_step % self._every
        ):
            return  # nothing read in the steps not logged: the monitor costs nothing there
        stats = trainer.strategy.compression_stats()
        if not stats or stats.get("step") == self._last_seen_step:
            return  # no optimizer step finished since the step last logged (gradient accumulation)
        self._last_seen_step = stats.get("step")
        metrics = self.metrics(trainer, stats)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
