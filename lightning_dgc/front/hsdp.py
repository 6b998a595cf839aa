"""Lightning glue for sharded models: ``Trainer(strategy="dgc_hsdp" | "deft_hsdp" | "powersgd_hsdp")``.

:class:`HSDPCompressionStrategy` subclasses Lightning's :class:`~lightning.pytorch.strategies.ModelParallelStrategy`:
FSDP2 shards parameters, gradients and optimizer state over the processes of each node, and across the nodes each
process's gradient shard goes through the algorithm in place of HSDP's dense all-reduce
(:mod:`lightning_dgc.exchange.sharded`). A ``LightningModule`` written for ``ModelParallelStrategy`` trains unchanged:
its ``configure_model`` shards itself with ``fully_shard(..., mesh=self.device_mesh["data_parallel"])``, and here
that dimension is the node's processes (:func:`lightning_dgc.comm.mesh.sharded_mesh`).
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Iterable
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
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_dgc import comm
from lightning_dgc.algorithms import AlgorithmConfig
from lightning_dgc.checkpoint.exchange import (
    CHECKPOINT_KEY,
    check_entry,
    finish_save,
    restore_exchange_state,
    save_exchange_state,
)
from lightning_dgc.checkpoint.rank_files import FileIO
from lightning_dgc.comm.mesh import across_host_group, mesh_topology, shard_group_ranks, sharded_mesh
from lightning_dgc.exchange import agreement
from lightning_dgc.exchange.agreement import DEFAULT_CHECK_RANKS_EVERY
from lightning_dgc.exchange.sharded import exchange_shard
from lightning_dgc.exchange.state import ExchangeState, local_shard
from lightning_dgc.exchange.takeover import (
    DEFAULT_MAX_CONSECUTIVE_SKIPS,
    OptimizerTakeOver,
    check_ranks_agree,
)
from lightning_dgc.front import sharding
from lightning_dgc.front.core import ExchangeAccess
from lightning_dgc.front.registration import register_strategies
from lightning_dgc.front.strategy import TrainerExchangeSteps

__all__ = ["EXCHANGE_FILES", "HSDPCompressionStrategy"]

#: The exchange state's name inside a checkpoint folder: its rank files are in ``<folder>/lightning_dgc.exchange/``.
EXCHANGE_FILES = "lightning_dgc"

log = logging.getLogger(__name__)


class HSDPCompressionStrategy(ExchangeAccess, TrainerExchangeSteps, ModelParallelStrategy):
    """A sharded model (FSDP2 inside each node) with a compressed exchange across the nodes (any registered algorithm).

    The processes of a node (``Trainer(devices=G)``) shard parameters, gradients and optimizer state among them;
    the nodes (``Trainer(num_nodes=N)``) each hold the whole model once. In every step FSDP reduce-scatters the
    gradients inside the node, and each process's shard of the node's mean gradient goes through the algorithm
    across the nodes (the ``N`` processes of the same local rank), where HSDP would all-reduce it dense. The
    optimizer steps on the shard. The exchange's memory is one shard's: ``1/G`` of what a replicated model's costs.

    The model is sharded by the ``LightningModule``'s ``configure_model`` (``fully_shard(block,
    mesh=self.device_mesh["data_parallel"])`` on each block, then on the module itself), as for Lightning's
    ``ModelParallelStrategy``; or, for a module without ``configure_model``, by the strategy: ``sharded_modules``
    names the classes to shard (a transformer's block), and the module itself is sharded last.

    Optimizer contract and arguments as :class:`~lightning_dgc.CompressionStrategy`'s (DGC takes SGD's momentum
    over; Adam-family optimizers use plain error feedback), and:

    Args:
        algorithm, options, **kwargs: the algorithm and its settings, as for ``CompressionStrategy``.
        sharded_modules: for a ``LightningModule`` without ``configure_model``: the module classes to shard (each
            instance, innermost first), then the module itself.
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` for the modules the strategy shards (``sharded_modules``); a
            ``configure_model`` passes its own to ``fully_shard``. The exchange's memory stays fp32 either way.
        max_consecutive_skips, check_ranks_every, save_exchange_state: as for ``CompressionStrategy``; the rank
            check compares the replicas of each shard across the nodes.
        resume_exchange_state: ``False``: a resume loads the model and the optimizer (resharded to this run's
            nodes and processes if they changed) and starts the exchange with empty buffers. By default it resumes
            each process's buffers too, which needs the layout that saved them (a clear error otherwise).
        save_distributed_checkpoint, process_group_backend, timeout: ``ModelParallelStrategy``'s.
    """

    set_up_by = "`trainer.fit`"

    def __init__(
        self,
        algorithm: str | AlgorithmConfig = "dgc",
        options: dict[str, Any] | None = None,
        sharded_modules: Iterable[type[torch.nn.Module]] | None = None,
        mp_policy: Any = None,
        max_consecutive_skips: int | None = DEFAULT_MAX_CONSECUTIVE_SKIPS,
        check_ranks_every: int | None = DEFAULT_CHECK_RANKS_EVERY,
        save_exchange_state: bool = True,
        resume_exchange_state: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        self._take_arguments(
            algorithm, options, kwargs, ModelParallelStrategy, save_exchange_state, max_consecutive_skips,
            check_ranks_every,
        )  # fmt: skip
        if kwargs:
            raise TypeError(
                f"{type(self).__name__} got unexpected arguments {sorted(kwargs)}: a sharded model has no DDP wrapper,"
                " so DDP's arguments do not apply; the algorithm's settings and ModelParallelStrategy's"
                " (save_distributed_checkpoint, process_group_backend, timeout) do."
            )
        if not save_distributed_checkpoint and save_exchange_state:
            raise ValueError(
                f"{type(self).__name__}(save_distributed_checkpoint=False) gathers the model into one file, which"
                " holds no process's exchange state: keep save_distributed_checkpoint=True (the default), or pass"
                " save_exchange_state=False as well to save the model and the optimizer only."
            )
        super().__init__(
            data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend, timeout=timeout,
        )  # fmt: skip
        self.sharded_modules = tuple(sharded_modules or ())
        self.mp_policy = mp_policy
        self.resume_exchange_state = bool(resume_exchange_state)
        self._taken_over = OptimizerTakeOver(type(self).__name__)
        self._topology: comm.Topology | None = None
        self._across_host_group: Any = None

    # -- the processes and the mesh ----------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        """The process group, then the ``(replicate, data_parallel, tensor_parallel)`` mesh of the nodes, checked."""
        self._setup_distributed()
        comm.destroy_process_group_at_exit()
        owner, nodes = type(self).__name__, self.num_nodes
        ranks = comm.all_gather_object((self.global_rank, self.node_rank, self.local_rank))
        per_node = comm.check_node_layout(ranks, nodes, f"{owner} (FSDP2 inside each node)", "")  # type: ignore[arg-type]
        sharding.check_nodes_on_hosts(comm.all_gather_object(comm.host_key()), per_node, owner)  # type: ignore[arg-type]
        self._device_mesh = sharded_mesh(nodes, per_node, self.root_device.type)
        self._topology = mesh_topology(self._device_mesh)
        self._across_host_group = across_host_group(self._topology, self.global_rank)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh
        rank_zero_info(
            f"{owner}: {nodes} node(s) x {per_node} process(es): FSDP2 inside the node, {self.algorithm} across the"
            " nodes on each process's shard."
        )

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every process trains on its own part of the data (the node's processes too: each holds its own batch)."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # -- the model ---------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Shard the model (its ``configure_model``, or ``sharded_modules``), check it, and hook the exchange into
        every FSDP group's all-reduce."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        assert self.model is not None and self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        owner, mesh = type(self).__name__, self.device_mesh["data_parallel"]
        if not sharding.fsdp_modules(self.model):
            if is_overridden("configure_model", self.lightning_module) or not self.sharded_modules:
                raise TypeError(
                    f"{owner} shards the model over each node's processes with FSDP2, but"
                    f" {type(self.lightning_module).__name__} was not sharded: add to it\n{sharding.CONFIGURE_MODEL_LINES}\n"
                    f"or pass the classes to shard: {owner}(..., sharded_modules={{YourBlock}})."
                )
            kwargs = {"mp_policy": self.mp_policy} if self.mp_policy is not None else {}
            sharding.shard_modules(self.model, self.sharded_modules, mesh, **kwargs)
        if any(isinstance(m, FullyShardedDataParallel) for m in self.model.modules()):
            raise TypeError(f"{owner} shards with FSDP2 (`fully_shard`); the model holds FSDP1 modules.")
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        sharding.check_sharded(self.model, shard_group_ranks(mesh.get_group()), owner)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._set_up_exchange()
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _set_up_exchange(self) -> None:
        """The exchange state over the sharded parameters, its hook on every FSDP group, the optimizer taken over."""
        assert self.lightning_module is not None and self.model is not None and self._topology is not None
        named = list(self.lightning_module.named_parameters())
        state = self._state
        if state is None or list(state.param_names.values()) != [n for n, _ in named]:
            state = self._state = ExchangeState(self._config, sharded=self._topology)
        state.register_parameters(named)
        self._attach_auto_density(state)
        self._set_up_rank_checks()
        for fsdp_module, group in sharding.hooked_groups(self.model):
            fsdp_module.set_all_reduce_hook(self._shard_hook(state, group))
        if state.algorithm.takes_over_momentum:
            self._taken_over.take_over(state, self.optimizers, named, self.root_device)
        check_ranks_agree(state, type(self).__name__, self.max_consecutive_skips)
        log.debug("%s: hooked the %s exchange into the FSDP groups", type(self).__name__, self.algorithm)

    def _shard_hook(self, state: ExchangeState, group: Any) -> Any:
        """The all-reduce hook of one FSDP parameter group: the exchange of this rank's shard across the nodes."""

        def hook(shard: torch.Tensor) -> None:
            layout = sharding.group_shard(group, state.name_of)
            self._run_exchange(state, lambda: exchange_shard(state, layout, shard))

        return hook

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: FSDP2 keeps the micro-steps' gradients unsharded, with neither its reduce-scatter
        nor the exchange; the step's last backward pass runs both once, on their sum."""
        if self.model is None or not sharding.fsdp_modules(self.model):
            yield None
            return
        sharding.set_gradient_sync(self.model, False)
        try:
            yield None
        finally:
            sharding.set_gradient_sync(self.model, True)

    @override
    def _after_optimizer_step(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The rank check compares the replicas of each shard: this process's local shards, across the nodes."""
        self._optimizer_steps += 1
        if self._auto is not None and self._state is not None:
            self._auto.step_done(self._state, self._host_group)
        if agreement.rank_check_due(self._optimizer_steps, self.check_ranks_every):
            local = [(name, local_shard(p)) for name, p in named_params]
            agreement.check_parameters_agree(local, type(self).__name__, self._optimizer_steps, self._across_host_group)

    # -- checkpoints ---------------------------------------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """``ModelParallelStrategy``'s checkpoint (model and optimizer through ``torch.distributed.checkpoint``: a
        folder, each process writing its shards), with each process's exchange state in a file of its own inside
        it (``<folder>/lightning_dgc.exchange/``), named with its digest by the manifest in ``meta.pt``; the
        optimizer's state holds the user's SGD hyper-parameters (all ranks call this)."""
        if self._state is None or not self._save_distributed_checkpoint:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        path = Path(self.broadcast(filepath))
        if self.is_global_zero:
            if path.is_file():
                path.unlink()
            path.mkdir(parents=True, exist_ok=True)
        self.barrier()
        io = FileIO(None)
        manifest = save_exchange_state(
            self._state, self.algorithm, path / EXCHANGE_FILES, io, type(self).__name__, with_memory=self.save_exchange_state
        )
        packed = dict(enumerate(checkpoint.get("optimizer_states", [])))
        if packed:  # the user's SGD hyper-parameters, and the exchange's momentum as SGD's (every rank: sharded)
            self._taken_over.write_user_optimizer_state(self._state, packed, {}, {})
            for (index, name), buffer in self._taken_over.sharded_momentum_buffers(self._state, self.optimizers).items():
                per_param = packed[index]["state"]  # a new dict: the packed one may be the optimizer's own
                per_param[name] = {**per_param.get(name, {}), "momentum_buffer": buffer.cpu()}
        if manifest is not None:
            checkpoint[CHECKPOINT_KEY] = manifest
        super().save_checkpoint(checkpoint, path, storage_options)
        if manifest is not None:
            finish_save(path / EXCHANGE_FILES, manifest, io)
        self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """The model and optimizer (resharded by ``torch.distributed.checkpoint`` if the layout changed), then this
        process's exchange state (the same layout only: see :func:`~lightning_dgc.exchange.entry.state_for_topology`),
        and the optimizer taken over again."""
        path = Path(self.broadcast(checkpoint_path))
        self._taken_over.restore(self.optimizers)  # as the checkpoint's optimizer state holds them
        try:
            checkpoint = super().load_checkpoint(path, weights_only)
            entry = checkpoint.get(CHECKPOINT_KEY)
            check_entry(entry, self.algorithm, type(self).__name__, "optimizer_states" in checkpoint or bool(self.optimizers))
            if entry is not None and self._state is not None:
                if self.resume_exchange_state:
                    restore_exchange_state(self._state, entry, self.root_device, path / EXCHANGE_FILES, FileIO(None))
                else:
                    self._state.step = int(entry.get("step", 0))
                    rank_zero_warn(
                        f"{type(self).__name__}(resume_exchange_state=False): the exchange starts with empty buffers;"
                        " the update they held when the checkpoint was saved is dropped."
                    )
        finally:
            if self._state is not None and self._state.algorithm.takes_over_momentum:
                assert self.lightning_module is not None
                self._taken_over.take_over(
                    self._state, self.optimizers, self.lightning_module.named_parameters(), self.root_device
                )
        return checkpoint

    @override
    def on_train_end(self) -> None:
        """Hand the momentum back to SGD (the replicas' mean, as each process's shard of the buffer)."""
        super().on_train_end()
        if self._state is not None and self._taken_over:
            self._taken_over.hand_back_sharded_momentum(self._state, self.optimizers)

    @override
    def teardown(self) -> None:
        """Give the optimizer its SGD hyper-parameters back (the take-over ends with ``fit``)."""
        self._taken_over.restore(self.optimizers)
        super().teardown()


# Importing this module first imports Lightning, whose import hook (``lightning_dgc/__init__.py``) finds this module
# still loading and leaves its names to this line.
register_strategies(__name__)
