"""The per-run state of a DGC exchange: hyper-parameters, per-parameter memory, statistics."""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import threading
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from lightning_dgc.comm import VALUE_DTYPES, world_size_and_rank
from lightning_dgc.memory import ResidualMemory

Selection = Literal["sampled", "exact"]
ValueDType = Literal["fp32", "fp16"]


def real_number(value: object, name: str) -> float:
    """``value`` as a float if it is a real number of any type (numpy scalars too, not bool or str).

    Raises a ``ValueError`` naming the argument otherwise, so that ``momentum="0.9"`` fails with a
    message that says what to pass rather than a bare ``TypeError`` from a comparison.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"`{name}` must be a number, got {value!r} ({type(value).__name__}).")
    return float(value)


def whole_number(value: object, name: str) -> int:
    """``value`` as an int if it is an integer of any type (numpy integers too, not bool, float or str)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"`{name}` must be an integer, got {value!r} ({type(value).__name__}).")
    return int(value)


def check_density(density: object, name: str = "density") -> float:
    """Return ``density`` as a float if it lies in (0, 1]; raise a ``ValueError`` naming the fix."""
    value = real_number(density, name)
    if not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite number in (0, 1], got {density!r}.")
    if not 0.0 < value <= 1.0:
        raise ValueError(
            f"`{name}` is the fraction of gradient values sent each step and must lie in (0, 1], got {value}."
            " Use 0.001 for DGC's 99.9% sparsity, or 1.0 to send everything."
        )
    return value


def _flag(value: object, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"`{name}` must be True or False, got {value!r} ({type(value).__name__}).")
    return bool(value)


@dataclass
class DGCConfig:
    """Hyper-parameters of DGC, identical on every rank (checked at setup).

    Selection:
        density: fraction of each compressed tensor's values sent per step, in (0, 1].
        sample_ratio: fraction of a tensor sampled to estimate the top-k threshold, in (0, 1].
        selection: ``"sampled"`` (DGC's threshold sampling, exact k guaranteed) or ``"exact"``.
        min_compress_numel: tensors with fewer values, and every 1-D tensor (biases, norms), are
            averaged dense: compressing them saves little and hurts accuracy.
    Momentum correction (used for parameters whose optimizer momentum was not taken over):
        momentum, nesterov: the local momentum ``m``; 0 gives plain error feedback.
        momentum_masking: clear sent coordinates from the momentum too (the paper's default).
        weight_decay: added to the local gradient before momentum correction.
    Clipping:
        local_clip_norm: the paper's local gradient clipping; each tensor's gradient is clipped to
            ``local_clip_norm / sqrt(world_size)`` before accumulation. ``None`` disables it.
    Wire:
        value_dtype: ``"fp32"`` or ``"fp16"``: the dtype of every value on the wire, the payload's and the
            tensors averaged dense alike (those in fp16 are pre-divided by the world size, as in
            torch's ``fp16_compress_hook``).
        seed: seeds the per-rank sampling generator.
    """

    density: float = 0.001
    sample_ratio: float = 0.01
    selection: Selection = "sampled"
    min_compress_numel: int = 1024
    momentum: float = 0.0
    nesterov: bool = False
    momentum_masking: bool = True
    weight_decay: float = 0.0
    local_clip_norm: float | None = None
    value_dtype: ValueDType = "fp32"
    seed: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise a ``ValueError`` that says how to fix the first invalid setting.

        Numbers of any real type are accepted (``numpy.float32(0.1)``, ``fractions.Fraction``) and
        stored as plain ``float``/``int``, so that the config stays JSON- and checkpoint-friendly.
        """
        self.density = check_density(self.density)
        self.sample_ratio = real_number(self.sample_ratio, "sample_ratio")
        if not 0.0 < self.sample_ratio <= 1.0:
            raise ValueError(
                f"`sample_ratio` is the fraction of each tensor sampled to find the top-k threshold and must lie"
                f" in (0, 1], got {self.sample_ratio!r}. The paper samples 0.1% to 1% (0.001 to 0.01)."
            )
        if self.selection not in ("sampled", "exact"):
            raise ValueError(f"`selection` must be 'sampled' or 'exact', got {self.selection!r}.")
        if self.value_dtype not in VALUE_DTYPES:
            raise ValueError(
                f"`value_dtype` must be one of {sorted(VALUE_DTYPES)}, got {self.value_dtype!r}."
            )
        self.momentum = real_number(self.momentum, "momentum")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"`momentum` must lie in [0, 1), got {self.momentum!r}.")
        self.nesterov = _flag(self.nesterov, "nesterov")
        self.momentum_masking = _flag(self.momentum_masking, "momentum_masking")
        if self.nesterov and self.momentum == 0.0:
            raise ValueError("`nesterov=True` needs a momentum > 0.")
        self.weight_decay = real_number(self.weight_decay, "weight_decay")
        if not self.weight_decay >= 0.0:
            raise ValueError(f"`weight_decay` must be >= 0, got {self.weight_decay!r}.")
        if self.local_clip_norm is not None:
            self.local_clip_norm = real_number(self.local_clip_norm, "local_clip_norm")
            if not self.local_clip_norm > 0.0:
                raise ValueError(
                    f"`local_clip_norm` must be > 0 or None (off), got {self.local_clip_norm!r}."
                )
        self.min_compress_numel = whole_number(self.min_compress_numel, "min_compress_numel")
        if self.min_compress_numel < 1:
            raise ValueError(f"`min_compress_numel` must be >= 1, got {self.min_compress_numel!r}.")
        self.seed = whole_number(self.seed, "seed")

    def averaged_dense(self, numel: int, ndim: int) -> bool:
        """Whether a tensor of this size and rank is always averaged dense rather than compressed."""
        return ndim <= 1 or numel < self.min_compress_numel

    def fingerprint(self, exclude: tuple[str, ...] = ("density",)) -> str:
        """A short hash of the settings that must agree across ranks (density may change by schedule)."""
        items = {k: v for k, v in asdict(self).items() if k not in exclude}
        return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ParamSettings:
    """Optimizer settings the hook applies to one parameter (taken over from the optimizer, or defaults)."""

    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0


@dataclass
class StepStats:
    """What one optimizer step put on the wire, per rank."""

    payload_bytes: int = 0  # sparse indices + values + padding
    dense_exchange_bytes: int = 0  # tensors averaged dense
    padding_bytes: int = 0
    dense_bytes: int = 0  # what plain DDP would have sent for the same buckets
    values_sent: int = 0
    numel: int = 0
    selection_ms: float = 0.0
    buckets: int = 0
    density: float = 0.0  # the density the step was compressed with
    control_bytes: int = 0  # DEFT: the norms (and selection times) exchanged to agree on a plan
    k_target: int = 0  # values the density asks for (sum of k over compressed tensors)
    union_values: int = 0  # distinct indices in the union of all ranks' selections
    rank_selected: int = 0  # values this rank selected itself
    rank_selection_ms: list[float] = field(default_factory=list)  # DEFT: every rank's previous selection
    plans: list[tuple[list[int], list[int]]] = field(default_factory=list)  # DEFT: (k, owner) per fragment

    @property
    def bytes_sent(self) -> int:
        return self.payload_bytes + self.dense_exchange_bytes


@dataclass
class DGCState:
    """One object per run: hyper-parameters, memory keyed by parameter name, step counter, statistics.

    Pass it as the ``state`` of :func:`lightning_dgc.hook.dgc_hook`; after every backward pass that
    ran the hook, call :meth:`finish_step` once (the strategy does this), which commits the memory
    only if the step was finite on every rank.
    """

    config: DGCConfig = field(default_factory=DGCConfig)
    process_group: Any = None
    #: Multiplier the incoming gradients carry (a GradScaler's scale); divided out before they enter memory.
    grad_scale: float = 1.0

    def __post_init__(self) -> None:
        # A copy: schedules change the density of this run, never the caller's configuration object.
        self.config = replace(self.config)
        self.world_size, self.rank = world_size_and_rank(self.process_group)
        self.generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + self.rank)
        self.memory = ResidualMemory()
        self.param_names: dict[int, str] = {}
        self._params: dict[str, Tensor] = {}
        self.param_settings: dict[str, ParamSettings] = {}
        self.step = 0
        self.skipped_steps = 0
        self.last_selection_ms = 0.0  # this rank's selection time in the previous step (DEFT shares it)
        self._plans: dict[tuple[Any, ...], Any] = {}
        self._current = StepStats()
        self._last: StepStats | None = None
        self._last_finite = True
        self._finite_flags: list[Tensor] = []
        # The futures the hook returned this step (one per bucket): finish_step waits on them, which on
        # CUDA orders its stream after each decode callback's side-stream work (flags, memory).
        self._bucket_futures: list[torch.futures.Future] = []
        # Decode callbacks of different buckets may run at once in the backend's threads.
        self._stats_lock = threading.Lock()

    # -- parameters --------------------------------------------------------------------------------
    def register_parameters(self, named_parameters: Any) -> None:
        """Remember parameter names (state is keyed by name; DDP re-buckets after step 1)."""
        named = list(named_parameters)
        self.param_names = {id(p): name for name, p in named}
        self._params = {name: p for name, p in named}
        self._plans.clear()

    def name_of(self, param: Tensor) -> str:
        name = self.param_names.get(id(param))
        if name is None:  # not registered: a stable positional fallback would break after re-bucketing
            raise RuntimeError(
                "DGCState received a parameter it does not know. Call `state.register_parameters("
                "model.named_parameters())` before training (DGCStrategy does this for you)."
            )
        return name

    def is_dense(self, name: str) -> bool:
        """Whether parameter ``name`` is always averaged dense (1-D or fewer than ``min_compress_numel`` values)."""
        param = self._params[name]
        return self.config.averaged_dense(param.numel(), param.dim())

    def settings_for(self, name: str) -> ParamSettings:
        default = ParamSettings(self.config.momentum, self.config.nesterov, self.config.weight_decay)
        return self.param_settings.get(name, default)

    @property
    def density(self) -> float:
        return self.config.density

    @density.setter
    def density(self, value: float) -> None:
        value = check_density(value)
        if value != self.config.density:
            self.config.density = value
            self._plans.clear()  # plans (and their payload buffers) are per density

    @property
    def value_dtype(self) -> torch.dtype:
        return VALUE_DTYPES[self.config.value_dtype]

    # -- step boundary -----------------------------------------------------------------------------
    def note_finite(self, flag: Tensor) -> None:
        """Record whether a decoded bucket was finite (identical on every rank)."""
        self._finite_flags.append(flag)

    def note_bucket(self, future: torch.futures.Future) -> torch.futures.Future:
        """Remember the future the hook returns for a bucket (see :meth:`finish_step`); returns it."""
        self._bucket_futures.append(future)
        return future

    def add_union_values(self, count: int) -> None:
        """Add to this step's union size (called from decode callbacks, which may run concurrently)."""
        with self._stats_lock:
            self._current.union_values += count

    def finish_step(self) -> bool:
        """Close the step: commit the memory if every bucket was finite, else discard. Returns finiteness.

        Every rank reaches the same verdict, because it is computed from the decoded (gathered)
        buckets, which are identical on all ranks. Call it once the backward pass is over (DDP has
        waited for every bucket); it first waits on the step's bucket futures, which re-raises a
        failed exchange and, on CUDA, orders this stream after the decode callbacks' side stream,
        without a host synchronisation.

        Parameters that DDP found unused on every rank this step keep their ``.grad`` at ``None``
        and are not stepped by the optimizer; their staged memory update is dropped, so that their
        momentum does not advance either (as with DDP and SGD).
        """
        futures, self._bucket_futures = self._bucket_futures, []
        for future in futures:
            future.wait()
        if not self._finite_flags and not self.memory.pending:
            return True
        finite = bool(torch.stack(self._finite_flags).all()) if self._finite_flags else True
        self._finite_flags = []
        unused = [n for n in self.memory.pending if n in self._params and self._params[n].grad is None]
        if unused and len(unused) == len(self.memory.pending):
            raise RuntimeError(
                "DGCState.finish_step() found no gradient on any parameter the exchange updated: call it"
                " after backward() and before the optimizer's zero_grad() (DGCStrategy does this for you)."
            )
        for name in unused:
            del self.memory.pending[name]
        if finite:
            self.memory.commit()
        else:
            self.memory.discard()
            self.skipped_steps += 1
        self.last_selection_ms = self._current.selection_ms
        self._last, self._current = self._current, StepStats()
        self._last_finite = finite
        self.step += 1
        return finite

    # -- statistics --------------------------------------------------------------------------------
    def compression_stats(self) -> dict[str, float | int | bool]:
        """What the last finished step sent, per rank (empty before the first step).

        ``bytes_sent`` counts the payload (indices, values, padding) and the dense all-reduce;
        ``dense_bytes`` is what plain DDP would have sent; ``compression_ratio`` is their quotient.
        """
        s = self._last
        if s is None:
            return {}
        return {
            "bytes_sent": s.bytes_sent,
            "payload_bytes": s.payload_bytes,
            "dense_exchange_bytes": s.dense_exchange_bytes,
            "padding_bytes": s.padding_bytes,
            "dense_bytes": s.dense_bytes,
            "compression_ratio": s.dense_bytes / s.bytes_sent if s.bytes_sent else float("inf"),
            "density": s.density,
            "values_sent": s.values_sent,
            "numel": s.numel,
            "selection_ms": s.selection_ms,
            "control_bytes": s.control_bytes,
            "k": s.k_target,
            "union_values": s.union_values,
            "buildup_factor": s.union_values / s.k_target if s.k_target else 1.0,
            "rank_selected": s.rank_selected,
            "buckets": s.buckets,
            "step": self.step,
            "finite": self._last_finite,
        } | (
            {
                "rank_selection_ms": list(s.rank_selection_ms),
                "max_rank_selection_ms": max(s.rank_selection_ms),
            }
            if s.rank_selection_ms
            else {}
        )

    def residual_norm(self) -> float:
        return self.memory.residual_norm()

    # -- checkpointing -----------------------------------------------------------------------------
    def state_dict(self, memory: bool = True) -> dict[str, Any]:
        """This rank's state: config, step, memory and generator, loadable with ``weights_only=True``.

        ``memory=False`` leaves the buffers out (a checkpoint gathers them tensor by tensor instead).
        """
        state = {
            "algorithm": "dgc",
            "config": asdict(self.config),
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "world_size": self.world_size,
            "rank": self.rank,
            "generator": self.generator.get_state(),
        }
        return state | {"memory": self.memory.state_dict()} if memory else state

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Restore memory, step and generator. The density stays as configured (arguments and callbacks own it)."""
        self.step = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.memory.load_state_dict(state["memory"], device)
        if "generator" in state:
            self.generator.set_state(state["generator"])
        self._plans.clear()


def state_for_rank(saved: dict[str, Any], world_size: int, rank: int) -> tuple[dict[str, Any], bool]:
    """This rank's state from a checkpoint entry ``{"world_size": N, "ranks": [state_0, ...]}``.

    Same world size: rank r gets exactly what rank r saved. Another world size M: every new rank
    gets the *mean* of the N saved momentum and velocity buffers. The update still owed to the model,
    ``sum(v_r) / N``, is then preserved exactly (``M * mean / M``), while per-rank detail is lost; the
    sampling generator restarts from the seed. Returns ``(state, redistributed)``.
    """
    ranks = saved["ranks"]
    if int(saved["world_size"]) == world_size:
        return ranks[rank], False
    first = ranks[0]
    memory: dict[str, dict[str, Tensor]] = {"momentum": {}, "velocity": {}}
    for kind in memory:
        for name in first["memory"][kind]:
            memory[kind][name] = torch.stack([r["memory"][kind][name] for r in ranks]).mean(0)
    merged = {k: v for k, v in first.items() if k not in ("memory", "generator", "rank")}
    merged["memory"] = memory
    return merged, True
