"""Lightning glue for DiLoCo on a sharded model: ``Trainer(strategy="diloco_hsdp")`` or
``Trainer(strategy=HSDPDiLoCoStrategy(sync_every=...))``.

:class:`HSDPDiLoCoStrategy` subclasses Lightning's :class:`~lightning.pytorch.strategies.ModelParallelStrategy`, with
the mesh and checks of :class:`~lightning_dgc.HSDPCompressionStrategy` (:mod:`lightning_dgc.front.sharding`): FSDP2
shards the model over each node's processes, and the outer step runs across the nodes on each process's shard
(:class:`lightning_dgc.local_steps.sharded.ShardedOuterStep`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterable
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dgc import comm
from lightning_dgc.algorithms import AlgorithmConfig
from lightning_dgc.algorithms.base import algorithm_for
from lightning_dgc.checkpoint import rank_files
from lightning_dgc.checkpoint.exchange import finish_save, read_rank_states
from lightning_dgc.checkpoint.files import rank_zero_warn
from lightning_dgc.checkpoint.rank_files import FileIO
from lightning_dgc.exchange.params import local_shard
from lightning_dgc.exchange.takeover import DEFAULT_MAX_CONSECUTIVE_SKIPS
from lightning_dgc.front import sharding
from lightning_dgc.front.registration import register_strategies
from lightning_dgc.local_steps.core import DILOCO_KEY, OuterAccess
from lightning_dgc.local_steps.outer import DENSE, check_same_everywhere
from lightning_dgc.local_steps.sharded import (
    ShardedOuterStep,
    load_plain_optimizer_state,
    momentum_dtensors,
    plain_optimizer_state,
)

__all__ = ["HSDPDiLoCoStrategy", "MOMENTUM_FOLDER", "OUTER_FILES"]

#: Each process's outer state inside a checkpoint folder: its rank files are in ``<folder>/lightning_dgc_diloco.exchange/``.
OUTER_FILES = "lightning_dgc_diloco"
#: The outer momentum inside a checkpoint folder, through ``torch.distributed.checkpoint`` (another layout reads it).
MOMENTUM_FOLDER = "lightning_dgc_diloco.momentum"
#: The counters every process holds alike, kept in the checkpoint's entry for a resume on another layout.
COUNTERS = ("optimizer_steps", "outer_steps", "skipped_outer_steps", "consecutive_skipped", "link_bytes_total")


class HSDPDiLoCoStrategy(OuterAccess, ModelParallelStrategy):
    """DiLoCo on a sharded model, the layout of INTELLECT-1: FSDP2 inside each node for the inner steps, and the
    outer step across the nodes on each process's parameter shard.

    * The processes of a node (``Trainer(devices=G)``) shard parameters, gradients and the inner optimizer's state
      as FSDP2 does (``ModelParallelStrategy``'s ``configure_model``); the nodes (``Trainer(num_nodes=N)``) each
      train their own copy of the model, and nothing crosses the nodes between outer steps.
    * Every ``sync_every`` optimizer steps each process takes DiLoCo's outer step on its shard, with the processes
      of the same local rank on the other nodes: pseudo-gradient (global shard - local shard), its mean across
      the nodes (``algorithm``: dense, or any registered algorithm, as for ``"diloco"``), outer Nesterov SGD on
      the global shard, local := global. Global weights, outer momentum and exchange memory are one shard per
      process: ``1/G`` of ``DiLoCoStrategy``'s. Floating-point buffers are averaged over every process.
    * An outer step is taken only if every shard's mean is finite; otherwise every process skips it and restarts
      the round from the global weights (``max_consecutive_skips`` in a row stop ``fit``).
    * When ``fit`` ends mid-round, a last outer step runs, so the nodes hold the same model once it returns.
    * Checkpoints: a folder, as ``ModelParallelStrategy`` writes it through ``torch.distributed.checkpoint``, whose
      model is the global weights (what inference or ``ModelParallelStrategy`` loads); each process's outer state
      (global shard, outer momentum, position in the round), local shard, inner optimizer state and exchange memory
      in its own file inside it (``lightning_dgc_diloco.exchange/``), and the outer momentum once more through
      ``torch.distributed.checkpoint`` (``lightning_dgc_diloco.momentum/``). A resume with the same nodes and
      processes per node continues exactly, mid-round too. On another layout the model, the outer momentum and
      the inner optimizer state (one node's, shard by shard) are resharded by ``torch.distributed.checkpoint``,
      a round starts from the global weights, and the exchange memory starts empty (a warning says so).

    The model is sharded by the ``LightningModule``'s ``configure_model`` (``fully_shard(block,
    mesh=self.device_mesh["data_parallel"])`` on each block, then on the module itself), as for
    ``ModelParallelStrategy``, or by the strategy (``sharded_modules``); the checks of
    :class:`~lightning_dgc.HSDPCompressionStrategy` apply (sharded over exactly the node's processes, no CPU
    offload, ranks numbered node by node, each node on one host).

    Args:
        sync_every, outer_lr, outer_momentum, outer_nesterov, algorithm, options, offload, max_consecutive_skips, fragments, overlap_steps, mixing, **kwargs: as for
            :class:`~lightning_dgc.DiLoCoStrategy`, on each process's shard (``offload``: the global shard and its
            momentum in host memory).
        sharded_modules: for a ``LightningModule`` without ``configure_model``: the module classes to shard (each
            instance, innermost first), then the module itself.
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` for the modules the strategy shards (``sharded_modules``).
        process_group_backend, timeout: ``ModelParallelStrategy``'s.
    """

    set_up_by = "`trainer.fit`"

    def __init__(
        self,
        sync_every: int = 500,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        outer_nesterov: bool = True,
        algorithm: str | AlgorithmConfig = DENSE,
        options: dict[str, Any] | None = None,
        offload: bool = False,
        max_consecutive_skips: int | None = DEFAULT_MAX_CONSECUTIVE_SKIPS,
        fragments: int = 1,
        overlap_steps: int = 0,
        mixing: float = 0.5,
        sharded_modules: Iterable[type[torch.nn.Module]] | None = None,
        mp_policy: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        self._init_outer(
            sync_every, outer_lr, outer_momentum, outer_nesterov, offload, max_consecutive_skips, algorithm, options,
            kwargs, ModelParallelStrategy, False, (fragments, overlap_steps, mixing),
        )  # fmt: skip
        super().__init__(
            data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=True,
            process_group_backend=process_group_backend, timeout=timeout,
        )  # fmt: skip
        self.sharded_modules = tuple(sharded_modules or ())
        self.mp_policy = mp_policy
        self._topology: comm.Topology | None = None
        self._trained: list[tuple[str, torch.Tensor]] = []  # (name, FSDP2's sharded parameter)

    # -- the processes, the mesh and the model ------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        """The process group, then the ``(replicate, data_parallel, tensor_parallel)`` mesh of the nodes, checked."""
        self._setup_distributed()
        comm.destroy_process_group_at_exit()
        owner = type(self).__name__
        self._device_mesh, self._topology = sharding.node_mesh(self, owner)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh
        exchange = algorithm_for(self._config).name if self._config is not None else DENSE
        rank_zero_info(
            f"{owner}: {self._topology.nodes} node(s) x {self._topology.per_node} process(es): FSDP2 inside the"
            f" node, DiLoCo ({exchange} outer exchange) across the nodes on each process's shard."
        )

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every process trains on its own part of the data (the node's processes too: each holds its own batch)."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Shard the model (its ``configure_model``, or ``sharded_modules``) and check it; for ``fit``, the outer
        state starts from node 0's weights, which every node takes."""
        assert self.model is not None and self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        owner = type(self).__name__
        sharding.not_sharded(self.model, self.lightning_module, self.sharded_modules, owner)
        self.model = sharding.shard_and_check(self.model, self.device_mesh, owner, self.sharded_modules, self.mp_policy)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            if not self.lightning_module.automatic_optimization:
                raise ValueError(
                    f"{owner} counts the optimizer steps Lightning takes, and manual optimization takes"
                    " its own: set `self.automatic_optimization = True` (the default), or use ModelParallelStrategy."
                )
            self.setup_optimizers(trainer)
            self._start_sharded_outer()
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _start_sharded_outer(self) -> None:
        """Every node takes node 0's shards and rank 0's buffers (FSDP2 broadcasts nothing), and the outer state
        starts from them, over the shards this process holds values of (all ranks call this)."""
        assert self.lightning_module is not None and self._topology is not None
        owner, topology, module = type(self).__name__, self._topology, self.lightning_module
        self._trained = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        with torch.no_grad():
            shards = [(n, local_shard(p)) for n, p in self._trained]
        across_group = getattr(topology.across, "group", None)
        comm.broadcast_([s for _, s in shards if s.numel()], src=topology.local_rank, group=across_group)
        comm.broadcast_([b.data for b in module.buffers()])
        named = [(n, s) for n, s in shards if s.numel()]
        if not all(comm.all_gather_object(bool(named))):
            raise ValueError(
                f"{owner}: a process holds no values of any trained parameter (each parameter's rows are shared among"
                f" the node's {topology.per_node} processes): start fewer processes per node."
            )
        self._outer = ShardedOuterStep(
            self.settings, self._config, named, module.named_buffers(), across=topology.across, node=topology.node
        )
        check_same_everywhere(self._outer, owner, names=[n for n, _ in self._trained])

    def _bind_shards(self) -> None:
        """Point the outer state at the sharded parameters' current local tensors (FSDP2 makes new ones when a
        parameter is re-padded or assigned: their values are the same)."""
        outer, params = self.outer, dict(self.lightning_module.named_parameters())  # type: ignore[union-attr]
        with torch.no_grad():
            current = [local_shard(params[name]) for name in outer.names]
        if any(c is not p for c, p in zip(current, outer.params, strict=True)):
            outer.params = current
            if outer.exchange_state is not None:
                outer.exchange_state.register_parameters(zip(outer.names, current, strict=True))

    # -- the step ----------------------------------------------------------------------------------------------
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: FSDP2 keeps the micro-steps' gradients unsharded, without its reduce-scatter; the
        step's last backward pass runs it once, on their sum."""
        with sharding.no_gradient_sync(self.model):
            yield None

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._bind_shards()
        self._count_step()
        return result

    @override
    def on_train_end(self) -> None:
        """A round cut short by the end of ``fit`` ends with an outer step: the nodes hold the same model."""
        super().on_train_end()
        self.finish()

    # -- checkpoints -------------------------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """``ModelParallelStrategy``'s sharded state dict of the *global* weights (the same on every node, so that
        ``torch.distributed.checkpoint`` keeps one copy of each shard); the local weights are left as they were."""
        if self._outer is None:
            return super().lightning_module_state_dict()
        outer = self.outer
        outer.settle()  # the exchanges in flight received and stepped
        with torch.no_grad():
            local = [p.detach().clone() for p in outer.params]
            for p, g in zip(outer.params, outer.global_params, strict=True):
                p.copy_(g)
            try:
                state = super().lightning_module_state_dict()  # (copies to the host, unless it is there already)
                held = {p.untyped_storage().data_ptr() for p in outer.params}
                for key, value in state.items():  # what is the parameters' own storage: copied before it changes back
                    if isinstance(value, torch.Tensor) and local_shard(value).untyped_storage().data_ptr() in held:
                        state[key] = value.clone()
                return state
            finally:
                for p, saved in zip(outer.params, local, strict=True):
                    p.copy_(saved)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """``ModelParallelStrategy``'s checkpoint folder (the global weights and the inner optimizer through
        ``torch.distributed.checkpoint``), with each process's file of outer state inside it and the outer momentum
        through ``torch.distributed.checkpoint`` (all ranks call this)."""
        if self._outer is None:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        from torch.distributed.checkpoint import save

        outer, topology = self.outer, self._topology
        assert topology is not None
        path = Path(self.broadcast(filepath))
        if self.is_global_zero:
            if path.is_file():
                path.unlink()
            path.mkdir(parents=True, exist_ok=True)
        self.barrier()
        outer.settle()
        io = FileIO(None)
        tag = comm.all_gather_object(f"{outer.optimizer_steps:08d}-{os.urandom(4).hex()}")[0]  # rank 0's
        mine = {
            "outer": outer.state_dict(),
            "local": {n: p.detach().cpu().clone() for n, p in zip(outer.names, outer.params, strict=True)},
            "inner_optimizers": [plain_optimizer_state(o) for o in self.optimizers],
            "exchange": outer.exchange_state.state_dict() if outer.exchange_state is not None else None,
        }
        folder = rank_files.folder_of(path / OUTER_FILES)
        record = io.save(mine, rank_files.join(folder, rank_files.rank_file_name(self.global_rank, str(tag))))
        momentum = self.settings.outer_momentum > 0
        if momentum:
            save({"outer_momentum": momentum_dtensors(outer, self._trained)}, checkpoint_id=path / MOMENTUM_FOLDER)
        records = comm.gather_object(record)
        entry = None
        if records is not None:  # rank 0: the manifest of the rank files, and what another layout needs
            entry = {
                "sharded": True, "algorithm": outer.algorithm, "nodes": topology.nodes, "per_node": topology.per_node,
                "folder": os.path.basename(folder), "files": records, "world_size": len(records), "momentum": momentum,
                "counters": {name: getattr(outer, name) for name in COUNTERS},
                "exchange_step": outer.exchange_state.step if outer.exchange_state is not None else 0,
            }  # fmt: skip
            checkpoint[DILOCO_KEY] = entry
        super().save_checkpoint(checkpoint, path, storage_options)
        if entry is not None:
            finish_save(path / OUTER_FILES, entry, io)
        self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """The model (the global weights) and the inner optimizer through ``torch.distributed.checkpoint``
        (resharded if the layout changed), then the outer state (see the class)."""
        path = Path(self.broadcast(checkpoint_path))
        checkpoint = super().load_checkpoint(path, weights_only)
        entry = checkpoint.pop(DILOCO_KEY, None)
        if self._outer is not None:
            self._restore_outer(entry, path)
        return checkpoint

    def _restore_outer(self, entry: dict[str, Any] | None, path: Path) -> None:
        """The outer state of a checkpoint whose model (the global weights) and inner optimizer are loaded."""
        assert self._topology is not None
        owner, outer, topology = type(self).__name__, self.outer, self._topology
        self._bind_shards()
        outer.reset_global()  # global := the checkpoint's weights, a new round: what stays if nothing else is saved
        if entry is None or not entry.get("sharded"):
            rank_zero_warn(
                f"{owner}: the checkpoint holds no sharded DiLoCo state (another strategy wrote it): a round starts"
                " from its weights, with empty outer momentum and exchange memory."
            )
            return
        if entry["algorithm"] != outer.algorithm:
            raise ValueError(
                f"{owner}: the checkpoint's outer exchange is {entry['algorithm']!r}, this run's {outer.algorithm!r}:"
                f" resume with algorithm={entry['algorithm']!r}."
            )
        if (entry["nodes"], entry["per_node"]) == (topology.nodes, topology.per_node):
            rank = self.global_rank
            state = read_rank_states(entry, [rank], path / OUTER_FILES, FileIO(None))[rank]
            outer.load_state_dict(state["outer"])
            with torch.no_grad():
                for name, p in zip(outer.names, outer.params, strict=True):
                    p.copy_(state["local"][name])
            for optimizer, saved in zip(self.optimizers, state["inner_optimizers"], strict=True):
                load_plain_optimizer_state(optimizer, saved, owner)
            if outer.exchange_state is not None and state["exchange"] is not None:
                outer.exchange_state.restore_rank_state(state["exchange"], self.root_device)
            return
        for name in COUNTERS:
            setattr(outer, name, type(getattr(outer, name))(entry["counters"][name]))
        if outer.exchange_state is not None:
            outer.exchange_state.step = int(entry["exchange_step"])
        if entry["momentum"] and self.settings.outer_momentum > 0:
            from torch.distributed.checkpoint import load

            loaded = {"outer_momentum": momentum_dtensors(outer, self._trained)}
            load(loaded, checkpoint_id=path / MOMENTUM_FOLDER)
            by_name = dict(zip(outer.names, outer.global_params, strict=True))
            with torch.no_grad():
                for name, value in loaded["outer_momentum"].items():
                    if name in by_name:
                        g = by_name[name]
                        outer.outer_optimizer.state[g]["momentum_buffer"] = local_shard(value).to(g.device, copy=True)
        rank_zero_warn(
            f"{owner}: the checkpoint was written by {entry['nodes']} node(s) x {entry['per_node']} process(es) and"
            f" is resumed by {topology.nodes} x {topology.per_node}: the global weights, the outer momentum and"
            " the inner optimizer state (one node's) are resharded, a round starts from the global weights, and"
            " the outer exchange starts with empty memory."
        )


# Importing this module first imports Lightning, whose import hook (``lightning_dgc/__init__.py``) finds this module
# still loading and leaves its name to this line.
register_strategies(__name__)
