"""Critical regimes: compress lightly where training is sensitive to it, hard everywhere else.

Training is most sensitive to lost gradient information in a few *critical regimes*: at the start,
and right after each drop of the learning rate (Agarwal et al., "Accordion", MLSys 2021). Outside them
a high compression costs little accuracy. :class:`CriticalRegimes` raises the density of a sparse
exchange (DGC, DEFT, any algorithm with a ``density``) for a window after each regime starts, and keeps
the strategy's target density elsewhere.

A regime starts:

* at the start of training (``start=True``);
* when the learning rate drops by ``lr_drop`` (2x) or more from one optimizer step to the next: a step
  schedule's decays (criterion ``"lr"``). A smooth schedule (cosine, exponential by less than 2x a step)
  never drops that much at once and starts no regime;
* when the norm of the gradient accumulated over an interval (an epoch, or ``interval`` optimizer
  steps) changes by ``norm_change`` (50%) or more from the previous interval's (criterion ``"norm"``,
  Accordion's). The gradient is the averaged one every rank holds after the exchange, and rank 0's norm
  is broadcast once per interval, so the decision is the same on every rank.

During a window the density is ``factor`` times the target, never above :func:`breakeven_density`
(where the sparse exchange would cost what DDP's all-reduce does at this world size) and never above 1.
Everything the schedule decides is in its checkpoint state, so a resumed run takes the same densities.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_dgc.algorithms.checks import check_density, check_schedulable, flag, real_number
from lightning_dgc.perfmodel.breakeven import breakeven_density
from lightning_dgc.schedules.warmup import SparsityWarmup

Criterion = Literal["auto", "lr", "norm", "both"]

def lr_dropped(lr: float, reference: float, drop: float) -> bool:
    """Whether ``lr`` lies ``drop`` times or more below ``reference`` (the previous optimizer step's)."""
    return reference > 0 and lr * drop <= reference * (1 + 1e-9)


def norm_changed(previous: float | None, current: float, change: float) -> bool:
    """Accordion's test: the relative change of the accumulated gradient's norm between two intervals."""
    if previous is None or not math.isfinite(current):
        return False
    if previous <= 0:
        return current > 0
    return abs(current - previous) / previous >= change


def _positive(value: object, name: str, *, at_least: float = 0.0, hint: str) -> float:
    number = real_number(value, name)
    if not (math.isfinite(number) and number > 0 and number >= at_least):
        bound = f">= {at_least:g}" if at_least else "> 0"
        raise ValueError(f"`{name}` must be a finite number {bound}, got {value!r}. {hint}")
    return number


class CriticalRegimes(L.Callback):
    """Raise the density of a sparse exchange in the critical regimes of training (see the module's text).

    The density in force is ``max(warm-up, critical)``: ``warm-up`` is what a :class:`SparsityWarmup`
    in the Trainer's callbacks asks for at this step (the strategy's density without one); ``critical``
    is ``factor`` times the strategy's density inside a window, capped at :func:`breakeven_density`.
    The schedule takes the warm-up over (the warm-up no longer sets the density itself), so the order of
    the callbacks does not matter. It is the same on every rank and after a resume. With
    ``density="auto"`` the target is the strategy's ``min_density`` and the density set is a floor under the
    link's choice (:mod:`lightning_dgc.schedules.auto_density`).

    Args:
        window: how long a critical regime lasts, as a fraction of the run's optimizer steps
            (``trainer.estimated_stepping_batches``), in (0, 1]; 0.1 by default.
        factor: the density in a window, as a multiple of the target density (>= 1; 10 by default:
            0.01 for a target of 0.001).
        criterion: what starts a regime besides the start of training: ``"lr"`` (a learning-rate drop),
            ``"norm"`` (the gradient-norm test), ``"both"``, or ``"auto"`` (default): ``"lr"`` when the
            model configures a learning-rate scheduler, ``"norm"`` otherwise. ``"lr"`` or ``"both"``
            without a scheduler fall back to ``"norm"`` with a warning.
        lr_drop: the drop of the learning rate between two optimizer steps that starts a regime (> 1; 2 by
            default).
        norm_change: the relative change of the accumulated gradient's norm that starts one (> 0; 0.5).
        interval: the norm test's interval: ``"epoch"`` or a number of optimizer steps.
        start: whether the start of training is a critical regime (default ``True``).

    Logs ``compression/critical`` (1 inside a window) beside the :class:`CompressionMonitor`'s scalars.

    Example::

        Trainer(strategy=DGCStrategy(density=0.001), callbacks=[CriticalRegimes(), CompressionMonitor()])
    """

    def __init__(
        self,
        window: float = 0.1,
        factor: float = 10.0,
        criterion: Criterion = "auto",
        lr_drop: float = 2.0,
        norm_change: float = 0.5,
        interval: Literal["epoch"] | int = "epoch",
        start: bool = True,
    ) -> None:
        self.window = _positive(window, "window", hint="It is a fraction of the run's steps: 0.1 is a tenth.")
        if self.window > 1:
            raise ValueError(
                f"`window` is a fraction of the run's optimizer steps and must lie in (0, 1], got {window!r}."
            )
        self.factor = _positive(
            factor,
            "factor",
            at_least=1.0,
            hint="It multiplies the target density: 10 sends 10x more in a window.",
        )
        self.lr_drop = _positive(lr_drop, "lr_drop", hint="2 starts a regime when the learning rate halves.")
        if self.lr_drop <= 1:
            raise ValueError(f"`lr_drop` must be > 1 (2: the learning rate halves), got {lr_drop!r}.")
        self.norm_change = _positive(norm_change, "norm_change", hint="0.5 is a change of 50%.")
        if criterion not in ("auto", "lr", "norm", "both"):
            raise ValueError(f"`criterion` must be one of 'auto', 'lr', 'norm', 'both', got {criterion!r}.")
        if interval != "epoch" and (
            isinstance(interval, bool) or not isinstance(interval, int) or interval < 1
        ):
            raise ValueError(
                f"`interval` must be 'epoch' or a number of optimizer steps >= 1, got {interval!r}."
            )
        self.criterion: Criterion = criterion
        self.interval = interval
        self.start = flag(start, "start")
        self.target: float | None = None  # the strategy's density, read once per strategy
        self._strategy: object | None = None
        self._warmups: list[Any] = []
        self._uses_lr = self._uses_norm = False
        self.window_steps = 1
        self.cap = 1.0
        # What the schedule decided, saved in checkpoints.
        self.reference_lr: float | None = None
        self.previous_norm: float | None = None
        self.starts: list[int] = []  # the optimizer steps at which regimes started
        self._sums: list[torch.Tensor] | None = None  # the gradient accumulated over the current interval
        self._interval_steps = 0
        self._restored = False

    # -- what the schedule applies ------------------------------------------------------------------------
    @property
    def critical_density(self) -> float:
        if self.target is None:
            raise RuntimeError(
                "CriticalRegimes reads the target density from the strategy in `setup`; call it first."
            )
        return max(self.target, min(self.factor * self.target, self.cap, 1.0))

    def density_at(self, step: int, base: float | None = None) -> float:
        """The density at optimizer ``step``: ``base`` (the warm-up's, default the target) or, inside a
        window, the critical density if it is higher."""
        base = self.target if base is None else base
        assert base is not None
        return max(base, self.critical_density) if self.critical_at(step) else base

    def critical_at(self, step: int) -> bool:
        """Whether optimizer ``step`` lies in a window."""
        return any(start <= step < start + self.window_steps for start in self.starts)

    def begin(self, step: int) -> None:
        """Start a critical regime at optimizer ``step``: the window runs to ``step + window_steps``."""
        if self.starts[-1:] != [step]:
            self.starts.append(step)

    # -- Lightning ---------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        check_schedulable(strategy, "CriticalRegimes")
        if strategy is not self._strategy:
            auto = getattr(strategy, "auto_density", None)  # density="auto": a floor over the link's density
            self.target = auto.min_density if auto is not None else check_density(strategy.density, "strategy.density")
            self._strategy = strategy
        self._warmups = [callback for callback in trainer.callbacks if isinstance(callback, SparsityWarmup)]
        for warmup in self._warmups:
            warmup.applied_by = self
        self.cap = breakeven_density(strategy.algorithm_class, strategy.config, trainer.world_size)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        steps = trainer.estimated_stepping_batches
        if not math.isfinite(steps):
            raise ValueError(
                "CriticalRegimes sizes its window as a fraction of the run, but the run is unbounded: set"
                " max_epochs or max_steps (and give the train dataloader a length)."
            )
        self.window_steps = max(1, math.ceil(self.window * int(steps)))
        has_scheduler = bool(trainer.lr_scheduler_configs)
        criterion = self.criterion
        if criterion == "auto":
            criterion = "lr" if has_scheduler else "norm"
        elif criterion in ("lr", "both") and not has_scheduler:
            rank_zero_warn(
                f"CriticalRegimes(criterion={criterion!r}) looks for learning-rate drops, but the model"
                " configures no learning-rate scheduler: the gradient-norm criterion starts regimes instead."
            )
            criterion = "norm"
        self._uses_lr = criterion in ("lr", "both")
        self._uses_norm = criterion in ("norm", "both")
        if not self._restored:
            self.starts = []
            self.reference_lr = self.previous_norm = None
            self._sums, self._interval_steps = None, 0
            if self.start:
                self.begin(0)
        rank_zero_info(
            f"CriticalRegimes: density {self.critical_density:g} for {self.window_steps} optimizer steps after each"
            f" regime starts ({criterion} criterion), {self.target:g} elsewhere."
        )

    def _base_density(self, trainer: L.Trainer) -> float:
        densities = [w.warmup_density(trainer) for w in self._warmups]
        return max(densities) if densities else float(self.target)  # type: ignore[arg-type]

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self._uses_lr and trainer.optimizers:
            lr = float(trainer.optimizers[0].param_groups[0]["lr"])
            if self.reference_lr is not None and lr_dropped(lr, self.reference_lr, self.lr_drop):
                self.begin(step)
            self.reference_lr = lr
        density = self.density_at(step, self._base_density(trainer))
        if trainer.strategy.density != density:
            trainer.strategy.density = density

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if not self._uses_norm:
            return
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if self._sums is None or len(self._sums) != len(grads):
            self._sums = [torch.zeros_like(g, dtype=torch.float32) for g in grads]
        elif grads and self._sums[0].device != grads[0].device:  # restored from a checkpoint on the CPU
            self._sums = [total.to(grad.device) for total, grad in zip(self._sums, grads, strict=True)]
        for total, grad in zip(self._sums, grads, strict=True):
            total.add_(grad)
        self._interval_steps += 1

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._uses_norm and self.interval != "epoch" and self._interval_steps >= self.interval:
            self._close_interval(trainer)
        if trainer.is_global_zero and trainer.loggers and trainer.log_every_n_steps:
            if trainer.global_step % trainer.log_every_n_steps == 0:
                flagged = {"compression/critical": float(self.critical_at(trainer.global_step - 1))}
                for logger in trainer.loggers:
                    logger.log_metrics(flagged, step=trainer.global_step)

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._uses_norm and self.interval == "epoch" and self._interval_steps:
            self._close_interval(trainer)

    def _close_interval(self, trainer: L.Trainer) -> None:
        """End a norm interval: compare its accumulated gradient's norm with the previous interval's."""
        assert self._sums is not None
        norm = math.sqrt(sum(float(total.double().pow(2).sum()) for total in self._sums))
        norm = float(trainer.strategy.broadcast(norm, src=0))  # one number, the same on every rank
        if norm_changed(self.previous_norm, norm, self.norm_change):
            self.begin(trainer.global_step)
        self.previous_norm = norm
        for total in self._sums:
            total.zero_()
        self._interval_steps = 0

    # -- checkpoints -------------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "reference_lr": self.reference_lr,
            "previous_norm": self.previous_norm,
            "starts": list(self.starts),
            "interval_steps": self._interval_steps,
            "sums": None if self._sums is None else [t.clone() for t in self._sums],
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.reference_lr = state_dict["reference_lr"]
        self.previous_norm = state_dict["previous_norm"]
        self.starts = [int(s) for s in state_dict["starts"]]
        self._interval_steps = int(state_dict["interval_steps"])
        self._sums = state_dict["sums"]
        self._restored = True
