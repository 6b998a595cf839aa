"""The per-run state of the exchange: the algorithm and its settings, the memory, the step, statistics."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any

import torch
from torch import Tensor

from lightning_dgc import algorithms, comm
from lightning_dgc.algorithms import AlgorithmConfig, BucketWork, ParamSettings, WireCost
from lightning_dgc.algorithms.base import algorithm_for
from lightning_dgc.algorithms.checks import check_density, sparse_gradient_message
from lightning_dgc.comm import Collectives, Topology, TorchCollectives
from lightning_dgc.exchange.draws import RandomDraws
from lightning_dgc.exchange.entry import (
    check_checkpoint_entry,
    restore_error,
    state_for_topology,
    state_problems,
)
from lightning_dgc.exchange.params import RegisteredParameters
from lightning_dgc.exchange.stats import ExchangeStatistics
from lightning_dgc.exchange.two_level import TwoLevelPlan
from lightning_dgc.tensor_ops.memory import ResidualMemory


class ExchangeState(RegisteredParameters, RandomDraws):
    """One object per run: the algorithm, the memory keyed by parameter name, the step counter, statistics.

    Its algorithm sees it through :class:`~lightning_dgc.algorithms.context.ExchangeContext`, the members an
    algorithm may use; the rest is the hook's and the front doors'.

    Pass it as the ``state`` of :func:`lightning_dgc.exchange.hook.exchange_hook`. The algorithm is the one
    registered for the configuration's class (DGC's, :class:`~lightning_dgc.algorithms.dgc_config.DGCConfig`,
    by default); ``collectives`` defaults to the process group's (:class:`~lightning_dgc.comm.TorchCollectives`).
    After every backward pass that ran the hook, call :meth:`finish_step` once (the strategy does): it
    commits the memory only if the step was finite on every rank. If it is not called, the hook
    commits the previous step itself when the next one starts, with a warning.

    ``topology`` (:class:`~lightning_dgc.comm.Topology`): run the two-level exchange
    (:func:`lightning_dgc.exchange.hook.exchange_two_level`). The algorithm then exchanges across the nodes:
    ``world_size`` and ``rank`` (and ``collectives``) are those of the ranks that share this rank's
    local rank, and its bucket is this rank's shard (:mod:`lightning_dgc.exchange.shards`).

    ``sharded`` (a :class:`~lightning_dgc.comm.Topology` too): the model is sharded inside each node (FSDP2), and
    the state exchanges each group's shard across the nodes (:func:`lightning_dgc.exchange.sharded.exchange_shard`):
    ``collectives`` are the ranks across the nodes, the registered parameters are sharded (their local shards are
    what the memory holds, :meth:`param`).
    """

    def __init__(
        self,
        config: AlgorithmConfig | None = None,
        process_group: Any = None,
        collectives: Collectives | None = None,
        grad_scale: float = 1.0,
        measure_buildup: bool = False,
        topology: Topology | None = None,
        finish_writes_grads: bool = False,
        sharded: Topology | None = None,
    ) -> None:
        # A copy: schedules change the density of this run, never the caller's configuration object.
        self.config = replace(config) if config is not None else algorithms.get("dgc").config_class()
        #: The two levels (inside the node, across nodes) of a two-level exchange; ``None``: flat.
        self.topology = topology
        if topology is not None and sharded is not None:
            raise ValueError("ExchangeState: a sharded model's exchange is not two-level; pass `topology` or `sharded`.")
        #: The nodes of a sharded model (FSDP inside each, this state across them); ``None``: a replicated model.
        self.sharded = sharded
        if collectives is None:
            levels = topology or sharded
            collectives = levels.across if levels is not None else TorchCollectives(process_group)
        self.collectives = collectives
        self.world_size, self.rank = self.collectives.world_size, self.collectives.rank
        #: Multiplier the incoming gradients carry (a GradScaler's scale); divided out before they enter memory.
        self.grad_scale = grad_scale
        self._finish_writes_grads = finish_writes_grads
        #: What each step sent (``measure_buildup``: count the distinct indices of all ranks' selections, the
        #: build-up factor, in every step; it costs a host synchronisation per bucket, so otherwise only in
        #: steps :meth:`request_buildup` asks for).
        self.stats = ExchangeStatistics(measure_buildup)
        self.generator = torch.Generator().manual_seed(int(self.config.seed) * 1_000_003 + self.rank)
        self._draw_generators: dict[torch.device, tuple[torch.Generator, int]] = {}
        self._tensor_generators: dict[torch.device, torch.Generator] = {}
        self.memory = ResidualMemory()
        self.param_names: dict[int, str] = {}
        self._params: dict[str, Tensor] = {}
        self.param_settings: dict[str, ParamSettings] = {}
        self.step = 0
        self.skipped_steps = 0
        #: Non-finite steps in a row (reset by a finite one): what the strategies' stall detector reads.
        self.consecutive_skipped_steps = 0
        #: Parameters whose gradient in this backward pass adds to an optimizer step that an earlier pass
        #: already exchanged (several backward passes before one step): the exchange applies no momentum or
        #: weight decay to them again. Set by the front doors (:class:`lightning_dgc.front.core.GradientCarry`).
        self.continuing: frozenset[str] = frozenset()
        self._plans: dict[tuple[Any, ...], Any] = {}
        self._planned_this_step: set[tuple[Any, ...]] = set()
        #: Whether the hook runs DDP's own step (:mod:`lightning_dgc.exchange.passthrough`); cleared by any other exchange.
        self.passthrough = False
        self.algorithm = algorithm_for(self.config)(self.config, self)

    @property
    def finish_writes_grads(self) -> bool:
        """Whether the future the hook returns holds the bucket as it is, :meth:`finish_step` then writing the
        averaged update into the parameters' ``.grad`` (see :mod:`lightning_dgc.exchange.hook`): the memory's commit
        reads the local gradient where DDP holds it, which saves a model-sized copy. For DDP models whose
        ``.grad`` the caller reads only after ``finish_step()`` (the strategies ask for it). Never in a
        two-level exchange, whatever was asked: there the algorithm's local gradient is this rank's shard of
        the node's sum, not the bucket, and its decode runs before the all-gather inside the node."""
        return self._finish_writes_grads and self.topology is None

    @property
    def nodes(self) -> Topology | None:
        """The nodes the exchange runs across, whether two-level (:attr:`topology`) or sharded (:attr:`sharded`);
        ``None`` for a flat run."""
        return self.topology or self.sharded

    @property
    def hook_waits(self) -> bool:
        """Whether the hook waits for its collectives before it returns (two levels, a sharded model): the time
        it holds the host is the exchange's, not compute."""
        return self.nodes is not None

    @finish_writes_grads.setter
    def finish_writes_grads(self, value: bool) -> None:
        self._finish_writes_grads = bool(value)

    @property
    def density(self) -> float | None:
        """The density in force, or ``None`` for an algorithm without one."""
        return self.config.density

    @density.setter
    def density(self, value: float) -> None:
        if self.config.density is None:
            raise AttributeError(
                f"the {self.algorithm.name} algorithm has no density: its configuration"
                f" {type(self.config).__name__} declares no `density` field; do not set one (e.g. drop SparsityWarmup)."
            )
        value = check_density(value)
        if value != self.config.density:  # type: ignore[attr-defined]
            self.config.density = value  # type: ignore[attr-defined]
            self.clear_plans()  # plans (and their payload buffers) are per density
            self.passthrough = False

    # -- the bucket's plan -----------------------------------------------------------------------------
    def plan(self, params: list[Tensor], buffer: Tensor) -> Any:
        """The plan for a bucket of ``params`` (made once per layout and :meth:`Algorithm.plan_key`), with every
        decision the hook takes from the state: a :class:`~lightning_dgc.exchange.two_level.TwoLevelPlan` in a
        two-level exchange, else the algorithm's; and whether DDP's own step goes on (:attr:`passthrough`)."""
        if self.passthrough and (bool(self.continuing) or buffer.dtype != torch.float32):
            self.passthrough = False  # the algorithm's step moves each rank's momentum on its own
        key = (tuple(id(p) for p in params), self.algorithm.plan_key())
        if key not in self._plans:
            names = [self.name_of(p) for p in params]
            if buffer.is_sparse:
                raise ValueError(sparse_gradient_message(names))
            layout = algorithms.layout_of(names, [tuple(p.shape) for p in params])
            numel = sum(s.numel for s in layout)
            if numel != buffer.numel():
                raise RuntimeError(f"DDP bucket holds {buffer.numel()} values but its parameters {numel}.")
        else:
            layout = []
        return self.plan_layout(key, layout, buffer)

    def plan_layout(self, key: tuple[Any, ...], layout: list[algorithms.TensorSpec], buffer: Tensor) -> Any:
        """The plan of a bucket of tensors ``layout`` (made once per ``key``, which ends with the algorithm's
        :meth:`~lightning_dgc.algorithms.Algorithm.plan_key`), its step noted for :meth:`finish_step`: what
        :meth:`plan` returns for a DDP bucket, and the sharded exchange's for an FSDP group's shard."""
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
        plan = self._plans[key] = self._make_plan(layout, buffer)
        return plan

    def _make_plan(self, layout: list[algorithms.TensorSpec], buffer: Tensor) -> Any:
        if self.topology is None:
            return self.algorithm_plan(layout, buffer)
        return TwoLevelPlan.make(self, layout, buffer)

    def algorithm_plan(self, layout: list[algorithms.TensorSpec], buffer: Tensor) -> Any:
        """The algorithm's plan of ``layout``, checked for what the hook and the statistics read."""
        plan = self.algorithm.plan(layout, buffer)
        if not (hasattr(plan, "layout") and hasattr(plan, "dense_bytes")):
            raise TypeError(
                f"{type(self.algorithm).__name__}.plan() returned a {type(plan).__name__} without `layout` and"
                " `dense_bytes` attributes, which the hook and the statistics read: subclass"
                " lightning_dgc.algorithms.BucketPlan, or give the plan both fields."
            )
        return plan

    @property
    def global_rank(self) -> int:
        """This rank in the whole process group (``rank`` is its rank among the ranks it exchanges with)."""
        nodes = self.nodes
        if nodes is None:
            return self.rank
        return nodes.node_rank * nodes.per_node + nodes.local_rank

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
        self.stats.request_buildup(self.step)

    @property
    def measures_buildup(self) -> bool:
        """Whether this step counts the union of all ranks' selections (see :meth:`request_buildup`)."""
        return self.stats.measures_buildup(self.step)

    def record(
        self, cost: WireCost | None, work: BucketWork | None, selection_s: float, pending: list[comm.Pending],
        finish: Callable[[], Tensor], device: torch.device, keep: Sequence[Tensor] = (),
        deliver: Callable[[bool], None] | None = None, node_link_bytes: float = 0.0,
    ) -> torch.futures.Future[Tensor]:  # fmt: skip
        """The end of one bucket's exchange: its wire cost and measured figures into this step's statistics (none
        for ``cost=None``; ``node_link_bytes``: what a two-level exchange moves inside the node besides), its
        future (``finish()`` once ``pending`` are done, :func:`lightning_dgc.comm.when_all`, keeping ``keep``)
        noted for :meth:`finish_step`, and ``deliver``, which ``finish_step()`` runs after the memory's commit."""
        if cost is not None and work is not None:
            self.stats.record(cost, work, selection_s, self.world_size, self.density, self.measures_buildup,
                              node_link_bytes)  # fmt: skip
        future = comm.when_all(pending, finish, device, keep=keep)
        self.memory.note_bucket(future)
        if deliver is not None:
            self.memory.note_delivery(deliver)
        return future

    def add_union_values(self, count: int) -> None:
        """Add to this step's union size (called from decode callbacks, which may run concurrently)."""
        self.stats.add_union_values(count)

    @property
    def last_selection_ms(self) -> float:
        """This rank's selection time in the previous step (DEFT shares it)."""
        return self.stats.last_selection_ms

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
        planned, self._planned_this_step = self._planned_this_step, set()
        if planned:  # a layout no bucket had this step is gone (DDP rebuilds its buckets after the first
            # step, and its first holds the whole model): its plan and the plan's buffers go with it
            for key in [key for key in self._plans if key not in planned]:
                del self._plans[key]
        unused = None
        self.memory.wait_buckets()  # a failed exchange is the error to raise, before any other
        if check_unused:
            staged = self.memory.staged_names
            # a piece "<param>[a:b]" of a two-level shard is unused when its parameter is
            unused_names = {n for n in staged if self._unused_in_step(n)}
            if staged and unused_names == staged:
                raise RuntimeError(
                    "ExchangeState.finish_step() found no gradient on any parameter the exchange updated: call it"
                    " after backward() and before the optimizer's zero_grad() (the strategies do this for you)."
                )
            unused = self._unused_in_step
        finite = self.memory.finish_step(unused, trim=not self.passthrough)  # DDP's step: no temporaries to hand back
        if not finite:
            self.skipped_steps += 1
        self.consecutive_skipped_steps = 0 if finite else self.consecutive_skipped_steps + 1
        self.stats.close_step(finite)
        self.step += 1
        return finite

    def compression_stats(self) -> dict[str, float | int | bool]:
        """What the last finished step sent, per rank (empty before the first step).

        ``bytes_sent`` counts the compressed part (indices, values or factors, padding, control) and
        the dense all-reduce; ``dense_bytes`` is what plain DDP would have sent; ``compression_ratio``
        is their quotient. ``link_bytes`` is what each worker's link carries with ring collectives (an
        all-gather forwards every rank's payload: DGC's grows with the ranks, DEFT's all-reduce does not).
        ``inter_node_bytes`` is the part of it that crosses nodes: all of it on a flat run. In a two-level
        exchange the other figures describe this rank's shard, exchanged across the nodes (``dense_bytes``:
        the shard's), and ``link_bytes`` adds the reduce-scatter and all-gather inside the node.
        """
        return self.stats.report(self.algorithm.name, self.step)

    def residual_norm(self) -> float | None:
        """L2 norm of what the memory holds back (DGC's velocity, PowerSGD's error), for monitoring;
        ``None`` for an algorithm that holds nothing back (``Algorithm.residual_kind is None``)."""
        kind = self.algorithm.residual_kind
        return self.memory.residual_norm(kind) if kind is not None else None

    @property
    def topology_signature(self) -> dict[str, Any]:
        """Where this run's memory lives: flat, or ``nodes`` x ``per_node`` shards (checkpoints record it)."""
        if self.topology is not None:
            return self.topology.signature
        if self.sharded is not None:
            return {"hierarchical": False, "sharded": True, "nodes": self.sharded.nodes, "per_node": self.sharded.per_node}
        return {"hierarchical": False, "nodes": self.world_size, "per_node": 1}

    # -- checkpointing -----------------------------------------------------------------------------
    def state_dict(self, memory: bool = True, copy: bool = True) -> dict[str, Any]:
        """This rank's state: config, step, memory and generators, loadable with ``weights_only=True``.

        ``copy=False``: the memory's CPU buffers as they are, for a state written out at once
        (:meth:`ResidualMemory.state_dict`).

        ``"buffers"`` lists the buffers the memory holds (``{kind: [parameter name, ...]}``), so that a state
        that lost one on its way to the resume is refused (:func:`missing_buffers`) rather than restarted
        from zeros. ``memory=False`` leaves the buffers themselves out (a checkpoint gathers them tensor by
        tensor instead).
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
            "topology": self.topology_signature,
            "buffers": {kind: sorted(by_name) for kind, by_name in self.memory.committed.items()},
        }
        return state | {"memory": self.memory.state_dict(copy)} if memory else state

    def check_state_dict(self, state: dict[str, Any]) -> list[str]:
        """What in a rank's saved state (:meth:`state_dict`) this run cannot take, one line per problem.

        Every buffer is checked against what the run keeps for its parameter (the algorithm's
        :meth:`~lightning_dgc.algorithms.Algorithm.memory_shape`): a tensor, fp32, of that shape, finite;
        and the saved settings that shape the memory (``Algorithm.state_settings``) against the run's.
        Call :meth:`register_parameters` first. Empty: it loads.
        """
        return state_problems(self, state)

    def restore(self, entry: dict[str, Any], device: torch.device | None = None) -> bool:
        """Load this rank's state from a checkpoint entry (:func:`state_for_rank`), checked first on every
        rank (:meth:`check_state_dict`): any rank's problem is raised on every rank, before the first step.

        Call it on every rank of the process group at once (it is a collective). Returns whether the
        state was redistributed (another world size, or another topology: :func:`state_for_topology`).
        """
        state, redistributed = state_for_topology(entry, self.topology_signature, self.global_rank, self.parameter_shapes())
        self.restore_rank_state(state, device)
        return redistributed

    def restore_rank_state(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Load this rank's saved state (:meth:`state_dict`, e.g. from its own rank file), checked first on every
        rank (:meth:`check_state_dict`, a collective): any rank's problem is raised on every rank."""
        rank = self.global_rank
        try:
            check_checkpoint_entry({"algorithm": self.algorithm.name, "world_size": 1, "ranks": [state]})
            problems = [f"rank {rank}: {p}" for p in self.check_state_dict(state)]
        except ValueError as error:
            problems = [f"rank {rank}: {error}"]
        everyone = [p for rank_problems in comm.all_gather_object(problems) for p in rank_problems]  # type: ignore[union-attr]
        if everyone:
            raise ValueError(restore_error(everyone))
        self._load(state, device)

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        """Restore memory, step and generators, checked by :meth:`check_state_dict` (a ``ValueError`` names what
        this run cannot take). The density stays as configured (arguments and callbacks own it)."""
        problems = self.check_state_dict(state)
        if problems:
            raise ValueError(restore_error(problems))
        self._load(state, device)

    def _load(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        self.step = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.memory.load_state_dict(state["memory"], device)
        if "generator" in state:
            self.generator.set_state(state["generator"])
        self.algorithm.load_extra_state(state.get("extra", {}))
        self.clear_plans()
