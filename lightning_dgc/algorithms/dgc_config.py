"""DGC's settings (:class:`DGCConfig`): the density and how it is found, the selection, which tensors are
compressed, momentum correction, clipping and the values' dtype on the wire."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from lightning_dgc.algorithms.base import AlgorithmConfig
from lightning_dgc.algorithms.checks import check_density, flag, real_number, whole_number
from lightning_dgc.tensor_ops.codec import VALUE_DTYPES

Selection = Literal["sampled", "exact"]
SelectionBackend = Literal["auto", "torch", "numpy"]
ValueDType = Literal["fp32", "fp16", "int8"]


@dataclass
class DGCConfig(AlgorithmConfig):
    """Hyper-parameters of DGC, identical on every rank (checked at setup).

    Selection:
        density: fraction of each compressed tensor's values sent per step, in (0, 1], or ``"auto"``: picked
            from the link the run measures (:mod:`lightning_dgc.schedules.auto_density`), never below ``min_density``.
        min_density: with ``density="auto"``, the lowest density it may pick, in (0, 1].
        auto_every: with ``density="auto"``, measure the link again (a few dense steps) every this many
            optimizer steps; 0: once, at the start of each ``fit``.
        sample_ratio: fraction of a tensor sampled to estimate the top-k threshold, in (0, 1].
        selection: ``"sampled"`` (DGC's threshold sampling, exact k guaranteed) or ``"exact"``.
        selection_backend: how the sampled selection runs. ``"torch"``: the bucket's compressed tensors
            together, a fixed number of kernels and one host synchronisation per bucket
            (:mod:`lightning_dgc.tensor_ops.selection.batched`), with sample positions drawn on the tensors'
            device, seeded identically on every rank; ``"numpy"``: tensor by tensor on zero-copy numpy
            views (CPU only); ``"auto"`` (default): numpy for CPU float32 buckets, torch elsewhere.
        compile_selection: whether the batched selection runs as one compiled program per bucket
            (``torch.compile`` of its shape-static form, :mod:`lightning_dgc.tensor_ops.selection.static`: no
            host synchronisation), from a bucket layout's second step on (the first runs eagerly: DDP rebuilds
            its buckets after it). ``"auto"`` (default): on CUDA buckets only; ``True``: everywhere (on the CPU
            it also makes the selection batched, ``selection_backend="auto"`` or ``"torch"``); ``False``: never.
            The first compiled step of each bucket layout pays the compilation (seconds to a minute).
        min_compress_numel: tensors with fewer values, and every 1-D tensor (biases, norms) unless
            ``compress_vectors``, are averaged dense: compressing them saves little on a large model.
        compress_vectors: compress the 1-D tensors too (biases, norm scales and shifts), each with its own
            residual, as every other tensor; with ``min_compress_numel=1`` nothing is averaged dense. On a small
            model (ResNet-20: 2.5 k of its 270 k values) those tensors are most of what a step at density 0.001
            sends.
        small_density: compress the tensors that ``min_compress_numel`` and ``compress_vectors`` leave dense
            (1-D, small) at this density instead, each with its own residual, never below ``density``.
            ``None`` (default): they are averaged dense. At ``density`` itself (``compress_vectors``,
            ``min_compress_numel=1``) a 16-value norm scale or a 640-weight classifier sends one value a step
            (k is at least 1); at 1/8 each sends an eighth of its values a step, for a fraction of the bytes of
            averaging them dense (what it costs and keeps: docs/algorithms/dgc.md). DGC only.
        small_every: send the tensors ``min_compress_numel`` and ``compress_vectors`` leave dense (1-D, small)
            whole every this many steps rather than every step, from their own residual: in the other steps
            their momentum-corrected gradient accumulates, as a compressed tensor's unsent values do, and their
            update is zero; every value is then at most ``small_every - 1`` steps late, none lost. 1 (default):
            averaged every step. A step is an exchange (an optimizer step unless several backward passes feed
            one); the first sends. A bucket with nothing else to send sends them every step. DGC only; not with
            ``small_density``. Costly in accuracy: on ResNet-20 every 8 steps lost 11 points where compressing
            them at 1/8 lost 0.9 (docs/algorithms/dgc.md).
    Momentum correction:
        momentum_correction: ``True`` (the paper's): SGD's momentum, Nesterov and weight decay are taken
            over and applied to the local gradient before selection (``u <- m u + g``, ``v <- v + u``).
            ``False``: plain error feedback in the exchange (``v <- v + g``), the optimizer's own momentum
            and weight decay applied to the averaged sparse update, every step and dense (the "top-k with
            error feedback" of the literature; any optimizer works). ``momentum`` needs ``True``.
        momentum, nesterov: the local momentum ``m`` for parameters whose optimizer has none to take over;
            0 gives plain error feedback.
        momentum_masking: clear sent coordinates from the momentum too (the paper's default; tensors
            sent whole are never masked, see the module docstring).
        weight_decay: added to the local gradient before momentum correction.
    Clipping:
        local_clip_norm: the paper's local gradient clipping; each tensor's gradient is clipped to
            ``local_clip_norm / sqrt(world_size)`` before accumulation. ``None`` disables it.
    Wire:
        value_dtype: ``"fp32"`` or ``"fp16"``: the dtype of every value on the wire, the payload's and the
            tensors averaged dense alike (those in fp16 are pre-divided by the world size, as in
            torch's ``fp16_compress_hook``). ``"int8"``: the payload's values as int8, each 32 with one
            fp32 scale, the rounding error kept in the error feedback (3.125 bytes a value with its
            index, not 6); the tensors averaged dense travel in fp16. DGC only.
        seed: seeds the per-rank sampling generator.
    """

    density: float | Literal["auto"] = 0.001
    sample_ratio: float = 0.01
    selection: Selection = "sampled"
    selection_backend: SelectionBackend = "auto"
    compile_selection: bool | Literal["auto"] = "auto"
    min_compress_numel: int = 1024
    compress_vectors: bool = False
    small_density: float | None = None
    small_every: int = 1
    momentum_correction: bool = True
    momentum: float = 0.0
    nesterov: bool = False
    momentum_masking: bool = True
    weight_decay: float = 0.0
    local_clip_norm: float | None = None
    value_dtype: ValueDType = "fp32"
    seed: int = 0
    min_density: float = 0.001
    auto_every: int = 1000

    def validate(self) -> None:
        """Raise a ``ValueError`` that says how to fix the first invalid setting.

        Numbers of any real type are accepted (``numpy.float32(0.1)``, ``fractions.Fraction``) and
        stored as plain ``float``/``int``, so that the config stays JSON- and checkpoint-friendly.
        """
        if isinstance(self.density, str):
            if self.density != "auto":
                raise ValueError(
                    f"`density` must be a number in (0, 1] or 'auto' (picked from the measured link), got"
                    f" {self.density!r}."
                )
        else:
            self.density = check_density(self.density)
        self.min_density = check_density(self.min_density, "min_density")
        self.auto_every = whole_number(self.auto_every, "auto_every")
        if self.auto_every < 0:
            raise ValueError(
                f"`auto_every` must be >= 0 (optimizer steps between two measurements of the link; 0: once),"
                f" got {self.auto_every!r}."
            )
        self.sample_ratio = real_number(self.sample_ratio, "sample_ratio")
        if not 0.0 < self.sample_ratio <= 1.0:
            raise ValueError(
                f"`sample_ratio` is the fraction of each tensor sampled to find the top-k threshold and must lie"
                f" in (0, 1], got {self.sample_ratio!r}. The paper samples 0.1% to 1% (0.001 to 0.01)."
            )
        if self.selection not in ("sampled", "exact"):
            raise ValueError(f"`selection` must be 'sampled' or 'exact', got {self.selection!r}.")
        if self.selection_backend not in ("auto", "torch", "numpy"):
            raise ValueError(
                f"`selection_backend` must be 'auto', 'torch' or 'numpy', got {self.selection_backend!r}."
            )
        if isinstance(self.compile_selection, str) and self.compile_selection != "auto":
            raise ValueError(
                f"`compile_selection` must be 'auto' (compiled on CUDA), True or False, got {self.compile_selection!r}."
            )
        if self.compile_selection != "auto":
            self.compile_selection = flag(self.compile_selection, "compile_selection")
        if self.compile_selection is True and (self.selection != "sampled" or self.selection_backend == "numpy"):
            raise ValueError(
                "`compile_selection=True` compiles the batched sampled selection; it needs `selection='sampled'` and"
                f" `selection_backend='auto'` or 'torch' (got {self.selection!r}, {self.selection_backend!r}), or"
                " pass `compile_selection='auto'` (compiled on CUDA only) or False."
            )
        if self.value_dtype not in VALUE_DTYPES:
            raise ValueError(
                f"`value_dtype` must be one of {sorted(VALUE_DTYPES)}, got {self.value_dtype!r}."
            )
        self.momentum = real_number(self.momentum, "momentum")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"`momentum` must lie in [0, 1), got {self.momentum!r}.")
        self.nesterov = flag(self.nesterov, "nesterov")
        self.momentum_correction = flag(self.momentum_correction, "momentum_correction")
        self.momentum_masking = flag(self.momentum_masking, "momentum_masking")
        if self.nesterov and self.momentum == 0.0:
            raise ValueError("`nesterov=True` needs a momentum > 0.")
        self.weight_decay = real_number(self.weight_decay, "weight_decay")
        if not self.weight_decay >= 0.0:
            raise ValueError(f"`weight_decay` must be >= 0, got {self.weight_decay!r}.")
        if self.momentum and not self.momentum_correction:
            raise ValueError(
                f"`momentum={self.momentum!r}` is applied in the exchange only with `momentum_correction=True`;"
                " leave momentum to the optimizer (SGD(momentum=...)), or pass `momentum_correction=True`."
            )
        if self.local_clip_norm is not None:
            self.local_clip_norm = real_number(self.local_clip_norm, "local_clip_norm")
            if not self.local_clip_norm > 0.0:
                raise ValueError(
                    f"`local_clip_norm` must be > 0 or None (off), got {self.local_clip_norm!r}."
                )
        self.compress_vectors = flag(self.compress_vectors, "compress_vectors")
        self.min_compress_numel = whole_number(self.min_compress_numel, "min_compress_numel")
        if self.min_compress_numel < 1:
            raise ValueError(f"`min_compress_numel` must be >= 1, got {self.min_compress_numel!r}.")
        if self.small_density is not None:
            self.small_density = check_density(self.small_density, "small_density")
            if self.compress_vectors and self.min_compress_numel == 1:
                raise ValueError(
                    f"`small_density={self.small_density!r}` sets the density of the tensors `min_compress_numel`"
                    " and `compress_vectors` leave dense, and with `compress_vectors=True` and"
                    " `min_compress_numel=1` there are none: leave those two at their defaults (1-D tensors and"
                    " those under 1,024 values are the small ones), or drop `small_density`."
                )
        self.small_every = whole_number(self.small_every, "small_every")
        if self.small_every < 1:
            raise ValueError(
                f"`small_every` must be >= 1 (steps between two sends of the small tensors; 1: every step), got"
                f" {self.small_every!r}."
            )
        if self.small_every > 1 and self.small_density is not None:
            raise ValueError(
                f"`small_every={self.small_every!r}` sends the small tensors whole every few steps and"
                f" `small_density={self.small_density!r}` compresses them: pick one (drop the other)."
            )
        if self.small_every > 1 and self.compress_vectors and self.min_compress_numel == 1:
            raise ValueError(
                f"`small_every={self.small_every!r}` sets how often the tensors `min_compress_numel` and"
                " `compress_vectors` leave dense are sent, and with `compress_vectors=True` and"
                " `min_compress_numel=1` there are none: leave those two at their defaults, or drop `small_every`."
            )
        self.seed = whole_number(self.seed, "seed")

    def small(self, numel: int, ndim: int) -> bool:
        """Whether a tensor of this size and rank is one of the small ones (1-D unless ``compress_vectors``, or
        under ``min_compress_numel`` values): averaged dense, or compressed at ``small_density``."""
        return (ndim <= 1 and not self.compress_vectors) or numel < self.min_compress_numel

    def averaged_dense(self, numel: int, ndim: int) -> bool:
        """Whether a tensor of this size and rank is never compressed: averaged dense, or with ``small_every`` sent
        whole from its residual every few steps."""
        return self.small_density is None and self.small(numel, ndim)

    def tensor_density(self, numel: int, ndim: int, density: float) -> float:
        """The density a compressed tensor of this size and rank is selected at when the step's is ``density``."""
        if self.small_density is not None and self.small(numel, ndim):
            return max(density, self.small_density)
        return density

    @property
    def value_dtype_torch(self) -> torch.dtype:
        return VALUE_DTYPES[self.value_dtype]

    @property
    def dense_dtype_torch(self) -> torch.dtype:
        """The dtype the tensors averaged dense travel in (an all-reduce cannot sum int8 levels)."""
        return torch.float16 if self.value_dtype == "int8" else self.value_dtype_torch
