"""``ExchangeProfiler``: measure one node, so that :mod:`lightning_dgc.perfmodel` can predict many.

Add the callback to any ``Trainer`` (``strategy="dgc"``, ``"deft"``, ``"ddp"`` or a single device) and
train a few steps; at the end of training ``profiler.profile`` holds a
:class:`~lightning_dgc.perfmodel.Profile` (and rank 0 writes it as JSON when ``path`` is given)::

    profiler = ExchangeProfiler(path="profile.json")
    L.Trainer(strategy="dgc", devices=1, max_steps=8, callbacks=[profiler]).fit(model, data)
    lightning-dgc-predict --profile profile.json --workers 8,64 --bandwidths 1,10

What it measures, per optimizer step after ``warmup_steps`` (medians over the steps):

* **step time**: wall time from the start of the step's first batch to the end of its last batch
  (forward, backward with the exchange, optimizer), with CUDA synchronised at both ends;
* **backward time**: ``on_before_backward`` to ``on_after_backward`` (DDP waits for the exchange
  there), the window the performance model lets communication hide behind;
* **selection time**: ``compression_stats()["selection_ms"]`` under DGC; under DEFT the sum of every
  rank's selection (``rank_selection_ms``: the whole gradient's selection, split among ranks); under
  any other strategy, DGC's sampled top-k is timed once on random tensors of the compressed sizes.
  ``compute_s`` and ``backward_s`` of the profile are the step and backward times minus selection.

The profile keeps the model's DDP buckets (as DDP rebuilt them after the first step; without a DDP
wrapper, as DDP would build them) as the shapes of their tensors; the performance model asks every
algorithm what it sends for them (:meth:`lightning_dgc.algorithms.Algorithm.wire_cost`, the formula the
hook's statistics use). Under a compressing strategy the totals of its algorithm are checked against
``compression_stats()`` (``profile.stats_match``; a mismatch warns).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_dgc import comm
from lightning_dgc.algorithms.dgc import DGCConfig
from lightning_dgc.algorithms.topk_plan import tensor_values
from lightning_dgc.front.core import ExchangeAccess
from lightning_dgc.perfmodel import BucketProfile, Profile
from lightning_dgc.tensor_ops.selection import sampled_topk, topk_indices

__all__ = ["ExchangeProfiler", "bucket_layout", "bucket_profiles", "time_selection"]

#: DDP's default bucket caps: the first bucket (the last layers, ready first) and the others.
FIRST_BUCKET_BYTES = 1024 * 1024
BUCKET_BYTES = 25 * 1024 * 1024


def _reducer_parameters(module: nn.Module, ignore: Sequence[str] = ()) -> list[tuple[str, Tensor]]:
    """The parameters in the order DDP's reducer indexes them (trainable, not ignored, shared ones once)."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad and n not in set(ignore)]


def bucket_layout(model: nn.Module) -> list[list[tuple[str, Tensor]]]:
    """``(name, parameter)`` of every DDP bucket, in the order DDP reduces them.

    With a ``DistributedDataParallel`` wrapper whose buckets were rebuilt (after the first backward
    pass), the rebuilt layout from DDP's logging data; otherwise the layout DDP's rebuild produces
    with its default caps: parameters in reverse registration order (the usual order in which
    gradients become ready), a first bucket of 1 MiB, then 25 MiB buckets.
    """
    if isinstance(model, DistributedDataParallel):
        named = _reducer_parameters(model.module, getattr(model, "parameters_to_ignore", ()))
        data = model._get_ddp_logging_data()
        rebuilt = data.get("rebuilt_per_bucket_param_indices")
        if rebuilt:
            return [[named[int(i)] for i in group.split()] for group in str(rebuilt).split(",")]
        cap = int(data.get("bucket_cap_bytes") or BUCKET_BYTES)
        if len(str(data.get("bucket_sizes", "")).split(",")) == 1:  # DDP's first iteration: one bucket
            return [named[::-1]]
    else:
        named, cap = _reducer_parameters(model), BUCKET_BYTES
    ordered = named[::-1]
    groups = comm.bucket_assignment([p for _, p in ordered], [FIRST_BUCKET_BYTES, cap])
    return [[ordered[i] for i in group] for group in groups]


def bucket_profiles(layout: list[list[tuple[str, Tensor]]]) -> list[BucketProfile]:
    """Per bucket, its tensors' names and shapes and what plain DDP all-reduces for it."""
    return [
        BucketProfile(
            shapes=[list(p.shape) for _, p in group],
            dense_bytes=sum(p.numel() * p.element_size() for _, p in group),
            names=[name for name, _ in group],
        )
        for group in layout
    ]


def time_selection(
    sizes: Sequence[tuple[int, int]], config: DGCConfig, device: torch.device, repeats: int = 3
) -> float:
    """Seconds DGC's selection (sampled threshold or exact top-k) takes on tensors of these sizes, each given as
    ``(numel, ndim)``."""
    generator = torch.Generator(device=device).manual_seed(0) if device.type != "cpu" else torch.Generator()
    tensors = [(torch.randn(n, device=device), tensor_values(config, n, ndim, config.density)) for n, ndim in sizes]
    times = []
    for _ in range(repeats):
        _synchronize(device)
        t0 = time.perf_counter()
        for t, k in tensors:
            if config.selection == "exact":
                topk_indices(t, k)
            else:
                sampled_topk(t, k, config.sample_ratio, generator)
        _synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) if times else 0.0


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch_size(batch: Any) -> int:
    """Leading dimension of the first tensor in ``batch`` (samples, sequences or utterances)."""
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = _batch_size(item)
            if size:
                return size
    return 0


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


class ExchangeProfiler(L.Callback):
    """Measure compute, selection and per-bucket wire bytes of DDP, DGC and DEFT on this model.

    Args:
        warmup_steps: optimizer steps left out of the medians (DDP rebuilds its buckets after the
            first; the hook builds its plans on the first calls).
        model_name: name stored in the profile (default: the LightningModule's class name).
        path: rank 0 writes the profile there as JSON at the end of training.
        batch_size: samples per worker per optimizer step; inferred from the batches when ``None``.
        density, value_dtype, min_compress_numel, selection, sample_ratio: the DGC settings to
            compute byte counts (and, under other strategies, to time selection) with; ignored under
            ``dgc``/``deft``, whose own settings are used.
    """

    def __init__(
        self,
        warmup_steps: int = 2,
        model_name: str | None = None,
        path: str | Path | None = None,
        batch_size: int | None = None,
        density: float = 0.001,
        value_dtype: str = "fp32",
        min_compress_numel: int = 1024,
        selection: str = "sampled",
        sample_ratio: float = 0.01,
    ) -> None:
        if warmup_steps < 0:
            raise ValueError(f"`warmup_steps` must be >= 0, got {warmup_steps}.")
        self.warmup_steps = warmup_steps
        self.model_name = model_name
        self.path = Path(path) if path is not None else None
        self.batch_size = batch_size
        self.config = DGCConfig(
            density=density, value_dtype=value_dtype,  # type: ignore[arg-type]
            min_compress_numel=min_compress_numel, selection=selection,  # type: ignore[arg-type]
            sample_ratio=sample_ratio,
        )  # fmt: skip
        self.profile: Profile | None = None
        self.step_times: list[float] = []
        self.backward_times: list[float] = []
        self.selection_times: list[float] = []
        self.stats: dict[str, Any] = {}
        self._reset_step()
        self._global_step = 0
        self._samples: list[int] = []

    def _reset_step(self) -> None:
        self._step_start: float | None = None
        self._backward = 0.0
        self._backward_start = 0.0
        self._step_samples = 0

    def _sync(self, trainer: L.Trainer) -> float:
        _synchronize(trainer.strategy.root_device)
        return time.perf_counter()

    # -- timing -------------------------------------------------------------------------------------------
    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._global_step = trainer.global_step
        self._reset_step()

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = self._sync(trainer)
        if self._step_start is None:
            self._step_start = now
        self._step_samples += _batch_size(batch)

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Tensor) -> None:
        self._backward_start = self._sync(trainer)

    @override
    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._backward += self._sync(trainer) - self._backward_start

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._global_step or self._step_start is None:
            return  # gradient accumulation: the optimizer step is not done yet
        elapsed = self._sync(trainer) - self._step_start
        steps_done = trainer.global_step
        self._global_step = trainer.global_step
        if steps_done > self.warmup_steps:
            self.step_times.append(elapsed)
            self.backward_times.append(self._backward)
            self._samples.append(self._step_samples)
            stats = self._compression_stats(trainer)
            if stats:
                self.stats = stats
                ranks = stats.get("rank_selection_ms")
                ms = (
                    sum(ranks)
                    if isinstance(stats.get("rank_selection_ms"), list) and ranks
                    else stats["selection_ms"]
                )
                self.selection_times.append(float(ms) / 1e3)
        self._reset_step()

    @staticmethod
    def _compression_stats(trainer: L.Trainer) -> dict[str, Any]:
        strategy = trainer.strategy
        return dict(strategy.compression_stats()) if isinstance(strategy, ExchangeAccess) else {}

    # -- the profile --------------------------------------------------------------------------------------
    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.profile = self.build_profile(trainer, pl_module)
        if self.path is not None and trainer.is_global_zero:
            self.profile.save(self.path)

    def _config(self, trainer: L.Trainer) -> Any:
        """The running algorithm's settings, or this callback's DGC settings under another strategy."""
        strategy = trainer.strategy
        return strategy.config if isinstance(strategy, ExchangeAccess) else self.config

    def build_profile(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Profile:
        """The :class:`Profile` of what was measured so far (called at the end of training)."""
        strategy = trainer.strategy
        config = self._config(trainer)
        dgc = config if isinstance(config, DGCConfig) else self.config  # the selection timed offline
        model = strategy.model if isinstance(strategy.model, DistributedDataParallel) else pl_module
        buckets = bucket_profiles(bucket_layout(model))
        device = strategy.root_device
        notes: list[str] = []
        if not self.step_times:
            rank_zero_warn(
                f"ExchangeProfiler measured no step after its {self.warmup_steps} warm-up steps; train for"
                " more steps (max_steps > warmup_steps) or lower `warmup_steps`."
            )
        if self.selection_times:
            selection = _median(self.selection_times)
        else:
            sparse = [
                (math.prod(shape), len(shape))
                for b in buckets
                for shape in b.shapes
                if not dgc.averaged_dense(math.prod(shape), len(shape))
            ]
            selection = time_selection(sparse, dgc, device)
            notes.append("selection_s timed offline on random tensors of the compressed sizes")
        step = _median(self.step_times)
        backward = _median(self.backward_times)
        notes.append(f"{dgc.selection} top-k selection, sample_ratio={dgc.sample_ratio}")
        running = strategy.algorithm if isinstance(strategy, ExchangeAccess) else None
        profile = Profile(
            model=self.model_name or type(pl_module).__name__,
            buckets=buckets,
            compute_s=max(step - (selection if self.selection_times else 0.0), 0.0),
            backward_s=max(backward - (selection if self.selection_times else 0.0), 0.0),
            selection_s=selection,
            batch_size=self.batch_size or (int(_median([float(s) for s in self._samples])) or 1),
            density=dgc.density,
            value_dtype=dgc.value_dtype,
            configs={running: asdict(config)} if running else {},
            world_size=trainer.world_size,
            strategy=running or type(strategy).__name__,
            device=torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
            steps=len(self.step_times),
            step_s=step,
            stats=self.stats,
            notes=notes,
        )
        profile.stats_match = self._check(profile, strategy)
        return profile

    def _check(self, profile: Profile, strategy: Any) -> bool | None:
        """Compare the per-bucket totals with ``compression_stats()`` of the last step."""
        stats = self.stats
        if not stats or not isinstance(strategy, ExchangeAccess):
            return None
        totals = profile.totals(strategy.algorithm, profile.world_size)
        wrong = {
            key: (value, stats.get(key))
            for key, value in totals.items()
            if stats.get(key) is None or not math.isclose(stats[key], value, rel_tol=1e-9)  # (float sums)
        }
        if wrong:
            rank_zero_warn(
                f"ExchangeProfiler: the per-bucket byte counts differ from compression_stats() (profiler, stats):"
                f" {wrong}. The model's bucket layout may have changed after the last step."
            )
        return not wrong
