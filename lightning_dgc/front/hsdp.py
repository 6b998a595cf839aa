"""Lightning glue for sharded models: ``Trainer(strategy="dgc_hsdp" | "deft_hsdp" | "powersgd_hsdp")``.

:class:`HSDPCompressionStrategy` subclasses Lightning's :class:`~lightning.pytorch.strategies.ModelParallelStrategy`:
FSDP2 shards parameters, gradients and optimizer state over the processes of each node, and across the nodes each
process's gradient shard goes through the algorithm in place of HSDP's dense all-reduce
(:mod:`lightning_dgc.exchange.sharded`). A ``LightningModule`` written for ``ModelParallelStrategy`` trains unchanged:
its ``configure_model`` shards itself with ``fully_shard(..., mesh=self.device_mesh["data_parallel"])``, and here
that dimension is the node's processes (:func:`lightning_dgc.comm.mesh.sharded_mesh`).
"""

from __future__ import annotations

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
from typing_extensions import override

from lightning_dgc.algorithms import AlgorithmConfig
from lightning_dgc.checkpoint.exchange import CHECKPOINT_KEY
from lightning_dgc.exchange.agreement import DEFAULT_CHECK_RANKS_EVERY
from lightning_dgc.exchange.takeover import DEFAULT_MAX_CONSECUTIVE_SKIPS
from lightning_dgc.front import sharding
from lightning_dgc.front.registration import register_strategies
from lightning_dgc.front.sharded_core import ShardedExchangeAccess
from lightning_dgc.front.trainer_steps import TrainerExchangeSteps

__all__ = ["HSDPCompressionStrategy"]


class HSDPCompressionStrategy(ShardedExchangeAccess, TrainerExchangeSteps, ModelParallelStrategy):
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
        self._take_sharded_arguments(
            algorithm, options, kwargs, ModelParallelStrategy, save_exchange_state, max_consecutive_skips,
            check_ranks_every, save_distributed_checkpoint, sharded_modules, mp_policy, resume_exchange_state,
        )  # fmt: skip
        super().__init__(
            data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend, timeout=timeout,
        )  # fmt: skip

    # -- the processes and the mesh ----------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        """The process group, then the ``(replicate, data_parallel, tensor_parallel)`` mesh of the nodes, checked."""
        self._setup_distributed()
        self._device_mesh = self._set_up_nodes()
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

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
        assert self.model is not None and self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        sharding.not_sharded(self.model, self.lightning_module, self.sharded_modules, type(self).__name__)
        self.model = self._shard_and_check(self.model, self.device_mesh)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._set_up_exchange(self.model, list(self.lightning_module.named_parameters()), self.optimizers)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: FSDP2 keeps the micro-steps' gradients unsharded, with neither its reduce-scatter
        nor the exchange; the step's last backward pass runs both once, on their sum."""
        with sharding.no_gradient_sync(self.model):
            yield None

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
        manifest = self._save_exchange_files(path)
        packed = dict(enumerate(checkpoint.get("optimizer_states", [])))
        if packed:  # the user's SGD hyper-parameters, and the exchange's momentum as SGD's (every rank: sharded)
            self._taken_over.write_user_optimizer_state(self._state, packed, {}, {})
            for (index, name), buffer in self._taken_over.sharded_momentum_buffers(self._state, self.optimizers).items():
                per_param = packed[index]["state"]  # a new dict: the packed one may be the optimizer's own
                per_param[name] = {**per_param.get(name, {}), "momentum_buffer": buffer.cpu()}
        if manifest is not None:
            checkpoint[CHECKPOINT_KEY] = manifest
        super().save_checkpoint(checkpoint, path, storage_options)
        self._finish_exchange_files(path, manifest)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """The model and optimizer (resharded by ``torch.distributed.checkpoint`` if the layout changed), then this
        process's exchange state (the same layout only: see :func:`~lightning_dgc.exchange.entry.state_for_topology`),
        and the optimizer taken over again."""
        path = Path(self.broadcast(checkpoint_path))
        self._taken_over.restore(self.optimizers)  # as the checkpoint's optimizer state holds them
        try:
            checkpoint = super().load_checkpoint(path, weights_only)
            self._restore_exchange_files(path, checkpoint.get(CHECKPOINT_KEY), bool(self.optimizers))
        finally:
            assert self.lightning_module is not None
            self._take_over(self.lightning_module.named_parameters(), self.optimizers)
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
