"""The per-run state of the exchange: the algorithm and its settings, the memory, the step, statistics."""

from __future__ import annotations

import threading
import warnings
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from lightning_dgc import algorithms
from lightning_dgc.algorithms import Algorithm, AlgorithmConfig, BucketWork, WireCost
from lightning_dgc.algorithms.dgc import DGCConfig
from lightning_dgc.checks import check_density
from lightning_dgc.comm import Collectives, TorchCollectives
from lightning_dgc.memory import ResidualMemory


def algorithm_for(config: AlgorithmConfig) -> type[Algorithm[Any, Any, Any]]:
    """The registered algorithm whose configuration class is ``type(config)``."""
    for cls in algorithms.registered().values():
        if cls.config_class is type(config):
            return cls
    raise ValueError(f"no registered algorithm takes a {type(config).__name__}")


@dataclass(frozen=True)
class ParamSettings:
    """Optimizer settings the exchange applies to one parameter (taken over from SGD, or defaults)."""

    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0


@dataclass
class StepStats:
    """What one optimizer step put on the wire, per rank."""

    payload_bytes: int = 0  # the compressed part: indices/codes, values or factors, padding, control
    dense_exchange_bytes: int = 0  # tensors averaged dense
    padding_bytes: int = 0
    dense_bytes: int = 0  # what plain DDP would have sent for the same buckets
    values_sent: int = 0
    link_bytes: float = 0.0  # what each worker's link carries, every collective a ring (WireCost.link_bytes)
    numel: int = 0
    selection_ms: float = 0.0
    buckets: int = 0
    density: float | None = None  # the density the step was compressed with (algorithms that have one)
    control_bytes: int = 0  # DEFT: the norms (and selection times) exchanged to agree on a plan
    k_target: int = 0  # values the density asks for (sum of k over compressed tensors)
    union_values: int = 0  # distinct indices in the union of all ranks' selections
    rank_selected: int = 0  # values this rank selected itself
    buildup_measured: bool = False  # whether union_values was measured (only on request: a host sync)
    rank_selection_ms: list[float] = field(default_factory=list)  # DEFT: every rank's previous selection
    plans: list[tuple[list[int], list[int]]] = field(default_factory=list)  # DEFT: (k, owner) per fragment

    @property
    def bytes_sent(self) -> int:
        return self.payload_bytes + self.dense_exchange_bytes


class ExchangeState:
    """One object per run: the algorithm, the memory keyed by parameter name, the step counter, statistics.

    Pass it as the ``state`` of :func:`lightning_dgc.hook.exchange_hook`. The algorithm is the one
    registered for the configuration's class (:class:`~lightning_dgc.algorithms.dgc.DGCConfig` by
    default); ``collectives`` defaults to the process group's (:class:`~lightning_dgc.comm.TorchCollectives`).
    After every backward pass that ran the hook, call :meth:`finish_step` once (the strategy does): it
    commits the memory only if the step was finite on every rank. If it is not called, the hook
    commits the previous step itself when the next one starts, with a warning.
    """

    def __init__(
        self,
        config: AlgorithmConfig | None = None,
        process_group: Any = None,
        collectives: Collectives | None = None,
        grad_scale: float = 1.0,
        measure_buildup: bool = False,
        finish_writes_grads: bool = False,
    ) -> None:
        # A copy: schedules change the density of this run, never the caller's configuration object.
        self.config = replace(config) if config is not None else DGCConfig()
        self.collectives = collectives if collectives is not None else TorchCollectives(process_group)
        self.world_size, self.rank = self.collectives.world_size, self.collectives.rank
        #: Multiplier the incoming gradients carry (a GradScaler's scale); divided out before they enter memory.
        self.grad_scale = grad_scale
        #: The future the hook returns holds the bucket as it is, and :meth:`finish_step` writes the averaged
        #: update into the parameters' ``.grad`` (DGC, DEFT; see :mod:`lightning_dgc.hook`): the memory's
        #: commit reads the local gradient where DDP holds it, which saves a model-sized copy. For DDP
        #: models whose ``.grad`` the caller reads only after ``finish_step()`` (the strategies set it).
        self.finish_writes_grads = finish_writes_grads
        #: Count the distinct indices of all ranks' selections (the build-up factor) in every step; it costs a
        #: host synchronisation per bucket, so otherwise only in steps :meth:`request_buildup` asks for.
        self.measure_buildup = measure_buildup
        self._buildup_step = -1
        self.generator = torch.Generator().manual_seed(
            int(getattr(self.config, "seed", 0)) * 1_000_003 + self.rank
        )
        self._draw_generators: dict[torch.device, tuple[torch.Generator, int]] = {}
        self.memory = ResidualMemory()
        self.param_names: dict[int, str] = {}
        self._params: dict[str, Tensor] = {}
        self.param_settings: dict[str, ParamSettings] = {}
        self.step = 0
        self.skipped_steps = 0
        self.last_selection_ms = 0.0  # this rank's selection time in the previous step (DEFT shares it)
        self._plans: dict[tuple[Any, ...], Any] = {}
        self._planned_this_step: set[tuple[Any, ...]] = set()
        self._current = StepStats()
        self._last: StepStats | None = None
        self._last_finite = True
        self._stats_lock = threading.Lock()  # decode callbacks of different buckets may run at once
        self.algorithm = algorithm_for(self.config)(self.config, self)

    # -- parameters --------------------------------------------------------------------------------
    def register_parameters(self, named_parameters: Any) -> None:
        """Remember parameter names (state is keyed by name; DDP re-buckets after step 1)."""
        named = list(named_parameters)
        self.param_names = {id(p): name for name, p in named}
        self._params = dict(named)
        self.clear_plans()

    def name_of(self, param: Tensor) -> str:
        name = self.param_names.get(id(param))
        if name is None:  # not registered: a stable positional fallback would break after re-bucketing
            raise RuntimeError(
                "ExchangeState received a parameter it does not know. Call `state.register_parameters("
                "model.named_parameters())` before training (the strategies do this for you)."
            )
        return name

    def draw_generator(self, device: torch.device) -> torch.Generator:
        """A generator on ``device`` for this step's random draws, the same on every rank.

        Seeded from the configuration's seed and the step counter at the first draw of every step: it
        needs no state in checkpoints, and a resumed run draws what the straight run would.
        """
        generator, step = self._draw_generators.get(device, (None, -1))
        if generator is None:
            generator = torch.Generator(device=device)
        if step != self.step:
            generator.manual_seed(int(getattr(self.config, "seed", 0)) * 1_000_003 + self.step)
            self._draw_generators[device] = (generator, self.step)
        return generator

    def param(self, name: str) -> Tensor:
        return self._params[name]

    def is_dense(self, name: str) -> bool:
        """Whether parameter ``name`` is always averaged dense (DGC and DEFT: 1-D or small)."""
        param = self._params[name]
        averaged_dense = getattr(self.config, "averaged_dense", None)
        return averaged_dense is None or averaged_dense(param.numel(), param.dim())

    def settings_for(self, name: str) -> ParamSettings:
        cfg = self.config
        default = ParamSettings(
            getattr(cfg, "momentum", 0.0), getattr(cfg, "nesterov", False), getattr(cfg, "weight_decay", 0.0)
        )
        return self.param_settings.get(name, default)

    @property
    def density(self) -> float | None:
        """The density in force, or ``None`` for an algorithm without one."""
        return getattr(self.config, "density", None)

    @density.setter
    def density(self, value: float) -> None:
        if not hasattr(self.config, "density"):
            raise AttributeError(f"the {self.algorithm.name} algorithm has no density")
        value = check_density(value)
        if value != self.config.density:  # type: ignore[attr-defined]
            self.config.density = value  # type: ignore[attr-defined]
            self.clear_plans()  # plans (and their payload buffers) are per density

    # -- the bucket's plan -----------------------------------------------------------------------------
    def plan(self, params: list[Tensor], buffer: Tensor) -> Any:
        """The algorithm's plan for a bucket of ``params`` (made once per layout and :meth:`Algorithm.plan_key`)."""
        key = (tuple(id(p) for p in params), self.algorithm.plan_key())
        if key in self._planned_this_step:  # the previous step was never finished: finish it now
            warnings.warn(
                "ExchangeState.finish_step() was not called after the previous backward pass; the hook committed"
                " the memory itself (parameters unused in a step are then not told apart). Call finish_step()"
                " after every backward pass, before the optimizer's zero_grad().",
                stacklevel=3,
            )
            self.finish_step(check_unused=False)
        self._planned_this_step.add(key)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        names = [self.name_of(p) for p in params]
        if buffer.is_sparse:
            raise ValueError(sparse_gradient_message(names))
        layout = algorithms.layout_of(names, [tuple(p.shape) for p in params])
        numel = sum(s.numel for s in layout)
        if numel != buffer.numel():
            raise RuntimeError(f"DDP bucket holds {buffer.numel()} values but its parameters {numel}.")
        plan = self._plans[key] = self.algorithm.plan(layout, buffer)
        return plan

    @property
    def plans(self) -> list[Any]:
        """The plans made so far (one per bucket layout in force)."""
        return list(self._plans.values())

    def clear_plans(self) -> None:
        """Forget the plans: they are made again from the next buckets (their buffers too)."""
        self._plans.clear()

    # -- statistics ------------------------------------------------------------------------------------
    def request_buildup(self) -> None:
        """Measure the build-up factor in the coming step (``CompressionMonitor`` asks before it logs)."""
        self._buildup_step = self.step

    @property
    def measures_buildup(self) -> bool:
        """Whether this step counts the union of all ranks' selections (see :meth:`request_buildup`)."""
        return self.measure_buildup or self._buildup_step == self.step

    def record(self, cost: WireCost, work: BucketWork, selection_s: float) -> None:
        """Add one bucket's wire cost and measured figures to this step's statistics."""
        payload = cost.bytes_sent - cost.bytes_of("dense")
        with self._stats_lock:
            stats = self._current
            stats.payload_bytes += payload
            stats.control_bytes += cost.bytes_of("control")
            stats.padding_bytes += cost.padding_bytes
            stats.dense_exchange_bytes += cost.bytes_of("dense")
            stats.dense_bytes += cost.dense_bytes
            stats.values_sent += cost.values_sent
            stats.link_bytes += cost.link_bytes(self.world_size)
            stats.k_target += cost.k
            stats.numel += cost.numel
            stats.selection_ms += selection_s * 1e3
            stats.buckets += 1
            stats.density = self.density
            stats.rank_selected += work.stats.get("rank_selected", 0)
            stats.union_values += work.stats.get("union_values", 0)
            stats.buildup_measured = self.measures_buildup
            if "rank_selection_ms" in work.stats:
                stats.rank_selection_ms = work.stats["rank_selection_ms"]
            if "plan" in work.stats:
                stats.plans.append(work.stats["plan"])

    def add_union_values(self, count: int) -> None:
        """Add to this step's union size (called from decode callbacks, which may run concurrently)."""
        with self._stats_lock:
            self._current.union_values += count

    # -- step boundary -----------------------------------------------------------------------------
    @property
    def step_pending(self) -> bool:
        """Whether the hook ran since the last :meth:`finish_step` (a step is waiting to be finished)."""
        return bool(self._planned_this_step)

    def finish_step(self, check_unused: bool = True) -> bool:
        """Close the step (:meth:`ResidualMemory.finish_step`): commit or discard; returns finiteness.

        Call it once the backward pass is over and before ``zero_grad()``. Parameters that DDP found
        unused on every rank this step keep their ``.grad`` at ``None`` and are not stepped by the
        optimizer; their staged memory is dropped, so that their momentum does not advance either (as
        with DDP and SGD).
        """
        self._planned_this_step.clear()
        unused = None
        if check_unused:
            staged = self.memory.staged_names
            unused_names = {n for n in staged if n in self._params and self._params[n].grad is None}
            if staged and unused_names == staged:
                raise RuntimeError(
                    "ExchangeState.finish_step() found no gradient on any parameter the exchange updated: call it"
                    " after backward() and before the optimizer's zero_grad() (the strategies do this for you)."
                )
            unused = unused_names.__contains__
        finite = self.memory.finish_step(unused)
        if not finite:
            self.skipped_steps += 1
        with self._stats_lock:
            self.last_selection_ms = self._current.selection_ms
            self._last, self._current = self._current, StepStats()
        self._last_finite = finite
        self.step += 1
        return finite

    def compression_stats(self) -> dict[str, float | int | bool]:
        """What the last finished step sent, per rank (empty before the first step).

        ``bytes_sent`` counts the compressed part (indices, values or factors, padding, control) and
        the dense all-reduce; ``dense_bytes`` is what plain DDP would have sent; ``compression_ratio``
        is their quotient. ``link_bytes`` is what each worker's link carries with ring collectives (an
        all-gather forwards every rank's payload: DGC's grows with the ranks, DEFT's all-reduce does not).
        """
        s = self._last
        if s is None:
            return {}
        stats: dict[str, Any] = {
            "algorithm": self.algorithm.name,
            "bytes_sent": s.bytes_sent,
            "payload_bytes": s.payload_bytes,
            "dense_exchange_bytes": s.dense_exchange_bytes,
            "padding_bytes": s.padding_bytes,
            "dense_bytes": s.dense_bytes,
            "compression_ratio": s.dense_bytes / s.bytes_sent if s.bytes_sent else float("inf"),
            "link_bytes": s.link_bytes,
            "values_sent": s.values_sent,
            "numel": s.numel,
            "selection_ms": s.selection_ms,
            "control_bytes": s.control_bytes,
            "k": s.k_target,
            "rank_selected": s.rank_selected,
            "buckets": s.buckets,
            "step": self.step,
            "finite": self._last_finite,
        }
        if s.density is not None:
            stats["density"] = s.density
        if s.buildup_measured:
            stats["union_values"] = s.union_values
            stats["buildup_factor"] = s.union_values / s.k_target if s.k_target else 1.0
        if s.rank_selection_ms:
            stats["rank_selection_ms"] = list(s.rank_selection_ms)
            stats["max_rank_selection_ms"] = max(s.rank_selection_ms)
        return stats

    def residual_norm(self) -> float:
        """L2 norm of what the memory holds back (DGC's velocity, PowerSGD's error), for monitoring."""
        return self.memory.residual_norm(getattr(self.algorithm, "residual_kind", "velocity"))

    # -- checkpointing -----------------------------------------------------------------------------
    def state_dict(self, memory: bool = True) -> dict[str, Any]:
        """This rank's state: config, step, memory and generators, loadable with ``weights_only=True``.

        ``memory=False`` leaves the buffers out (a checkpoint gathers them tensor by tensor instead).
        """
        state = {
            "algorithm": self.algorithm.name,
            "config": asdict(self.config),
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "world_size": self.world_size,
            "rank": self.rank,
            "generator": self.generator.get_state(),
            "extra": self.algorithm.extra_state(),
        }
        return state | {"memory": self.memory.state_dict()} if memory else state

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Restore memory, step and generators. The density stays as configured (arguments and callbacks own it)."""
        self.step = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.memory.load_state_dict(state["memory"], device)
        if "generator" in state:
            self.generator.set_state(state["generator"])
        self.algorithm.load_extra_state(state.get("extra", {}))
        self.clear_plans()


def sparse_gradient_message(names: list[str]) -> str:
    """The error for parameters whose gradients are sparse tensors (``nn.Embedding(sparse=True)``)."""
    return (
        f"Parameter(s) {names} get sparse gradients (e.g. nn.Embedding(sparse=True) or nn.EmbeddingBag(sparse=True)),"
        " which the compressed exchange cannot take: it selects from dense gradient buckets. Create the module"
        " with sparse=False (the exchange already sends only the largest values), or train with"
        " strategy='ddp'."
    )


def state_for_rank(saved: dict[str, Any], world_size: int, rank: int) -> tuple[dict[str, Any], bool]:
    """This rank's state from a checkpoint entry ``{"world_size": N, "ranks": [state_0, ...]}``.

    Same world size: rank r gets exactly what rank r saved. Another world size M: every new rank
    gets the *mean* of the N saved buffers of every kind. For DGC the update still owed to the model,
    ``sum(v_r) / N``, is then preserved exactly (``M * mean / M``), while per-rank detail is lost; the
    sampling generator restarts from the seed. Returns ``(state, redistributed)``.
    """
    ranks = saved["ranks"]
    if int(saved["world_size"]) == world_size:
        return ranks[rank], False
    first = ranks[0]
    memory: dict[str, dict[str, Tensor]] = {
        kind: {name: torch.stack([r["memory"][kind][name] for r in ranks]).mean(0) for name in by_name}
        for kind, by_name in first["memory"].items()
    }
    merged = {k: v for k, v in first.items() if k not in ("memory", "generator", "rank")}
    merged["memory"] = memory
    return merged, True
