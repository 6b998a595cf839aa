"""Fabric glue for sharded models: ``Fabric(strategy=FabricHSDPCompressionStrategy("dgc", parallelize_fn=...))``.

:class:`FabricHSDPCompressionStrategy` subclasses Fabric's :class:`~lightning.fabric.strategies.ModelParallelStrategy`
and runs the Trainer door's sharded exchange (:mod:`lightning_dgc.front.hsdp`):

* ``fabric.setup(model, optimizer)`` shards the model over each node's processes (the ``parallelize_fn(model,
  device_mesh)`` written for ``ModelParallelStrategy``, with ``device_mesh["data_parallel"]`` the node's processes;
  or ``sharded_modules``), checks it, hooks the exchange into every FSDP group and takes SGD's momentum over;
* ``fabric.backward(loss)`` runs FSDP's reduce-scatter inside the node and the exchange across nodes, and closes
  the exchange's step; ``fabric.no_backward_sync(model)`` accumulates with neither;
* ``optimizer.step()`` steps on the shard, or skips the step on every rank when a gradient was not finite;
* ``fabric.save(path, state)`` writes ``torch.distributed.checkpoint``'s folder with each process's exchange state
  inside it; ``fabric.load(path, state)`` restores both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ModelParallelStrategy
from lightning.fabric.utilities.init import _materialize_distributed_module
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dgc.algorithms import AlgorithmConfig
from lightning_dgc.checkpoint.exchange import CHECKPOINT_KEY
from lightning_dgc.exchange.agreement import DEFAULT_CHECK_RANKS_EVERY
from lightning_dgc.exchange.takeover import DEFAULT_MAX_CONSECUTIVE_SKIPS
from lightning_dgc.front.core import check_model_first
from lightning_dgc.front.fabric_steps import FabricExchangeSteps
from lightning_dgc.front.sharded_core import ShardedExchangeAccess

__all__ = ["FabricHSDPCompressionStrategy"]


def _as_it_is(module: Module, mesh: Any) -> Module:
    """Fabric's ``parallelize_fn`` when the strategy shards ``sharded_modules`` itself."""
    return module


class FabricHSDPCompressionStrategy(ShardedExchangeAccess, FabricExchangeSteps, ModelParallelStrategy):
    """Fabric's door to :class:`~lightning_dgc.HSDPCompressionStrategy`: FSDP2 inside each node, the algorithm
    across the nodes on each process's gradient shard. Arguments as the Trainer door's, and ``parallelize_fn``
    (Fabric's ``ModelParallelStrategy``'s: ``parallelize_fn(module, device_mesh) -> module``, sharding over
    ``device_mesh["data_parallel"]``), or ``sharded_modules``.

    One model per strategy (its exchange state); set up its optimizers through the same Fabric. Call
    :meth:`release_optimizers` after the loop to give SGD its momentum back.
    """

    set_up_by = "`fabric.setup`"

    def __init__(
        self,
        algorithm: str | AlgorithmConfig = "dgc",
        options: dict[str, Any] | None = None,
        parallelize_fn: Callable[[Module, Any], Module] | None = None,
        sharded_modules: Iterable[type[Module]] | None = None,
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
        if parallelize_fn is None and not self.sharded_modules:
            raise ValueError(
                f"{type(self).__name__} shards the model with FSDP2 over each node's processes: pass"
                " `parallelize_fn=fn` (fn(model, device_mesh) applies `fully_shard(block,"
                ' mesh=device_mesh["data_parallel"])` to each block and to the model, and returns it), or'
                " `sharded_modules={YourBlock}`."
            )
        super().__init__(
            parallelize_fn or _as_it_is, data_parallel_size="auto", tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint, process_group_backend=process_group_backend,
            timeout=timeout,
        )  # fmt: skip
        self._user_parallelize = parallelize_fn
        self._module: Module | None = None
        self._optimizers: list[Optimizer] = []

    @override
    def setup_environment(self) -> None:
        """The process group, then the ``(replicate, data_parallel, tensor_parallel)`` mesh of the nodes, checked."""
        super(ModelParallelStrategy, self).setup_environment()  # the accelerator (not ModelParallelStrategy's mesh)
        self._setup_distributed()
        self._device_mesh = self._set_up_nodes()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Every process trains on its own part of the data (the node's processes too: each holds its own batch)."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def setup_module(self, module: Module) -> Module:
        """Shard ``module`` over each node's processes, check it, and hook the exchange into every FSDP group."""
        if self._module is not None:
            raise ValueError(
                f"{type(self).__name__} compresses the gradients of one model, and one is set up already: set up the"
                " other models under another Fabric, or put them in one `nn.Module`."
            )
        module = self._shard_and_check(module, self.device_mesh, self._user_parallelize)
        _materialize_distributed_module(module, self.root_device)
        self._module = module
        self._set_up_exchange(module, list(module.named_parameters()), [])
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Take over SGD's momentum and weight decay (for algorithms that apply momentum in the exchange)."""
        check_model_first(type(self).__name__, self._state)
        optimizer = super().setup_optimizer(optimizer)
        self._optimizers.append(optimizer)
        self._retake()
        return optimizer

    def _retake(self) -> None:
        assert self._module is not None
        self._taken_over.restore(self._optimizers)  # the live groups hold the user's values again
        self._take_over(self._module.named_parameters(), self._optimizers)

    def _checked_parameters(self) -> Any:
        return self._module.named_parameters() if self._module is not None else None

    # -- checkpoints -------------------------------------------------------------------------------------------
    @override
    def save_checkpoint(
        self, path: Any, state: dict[str, Module | Optimizer | Any], storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:  # fmt: skip
        """``ModelParallelStrategy``'s folder, with each process's exchange state inside it; the optimizers saved with
        the user's SGD hyper-parameters and the exchange's momentum as SGD's buffers (all ranks call this)."""
        if self._state is None or not self._save_distributed_checkpoint:
            super().save_checkpoint(path, state, storage_options, filter)
            return
        if CHECKPOINT_KEY in state:
            raise ValueError(
                f"`fabric.save(path, state)`: the key {CHECKPOINT_KEY!r} is where {type(self).__name__} stores the"
                " exchange state; rename that entry of `state`."
            )
        path = Path(self.broadcast(path))
        manifest = self._save_exchange_files(path)
        self._taken_over.hand_back_sharded_momentum(self._state, self._optimizers)
        self._taken_over.restore(self._optimizers)
        try:
            super().save_checkpoint(path, {**state, CHECKPOINT_KEY: manifest}, storage_options, filter)
        finally:
            self._retake()
        self._finish_exchange_files(path, manifest)

    @override
    def load_checkpoint(
        self, path: Any, state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True, weights_only: bool | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Restore ``state`` (resharded by ``torch.distributed.checkpoint`` if the layout changed) and this process's
        exchange state (the same layout only, unless ``resume_exchange_state=False``)."""
        if self._state is None or not isinstance(state, dict):
            return super().load_checkpoint(path, state, strict, weights_only)
        path = Path(self.broadcast(path))
        self._taken_over.restore(self._optimizers)  # as the checkpoint's optimizer state holds them
        try:
            remainder = super().load_checkpoint(path, state, strict, weights_only)
            entry = remainder.pop(CHECKPOINT_KEY, None)
            loads_optimizer = any(obj is opt for obj in state.values() for opt in self._optimizers)
            self._restore_exchange_files(path, entry, loads_optimizer)
        finally:
            self._retake()
        return remainder

    def release_optimizers(self) -> None:
        """End the take-over (all ranks call this, after the loop): SGD gets its hyper-parameters back, and the
        exchange's momentum (the replicas' mean) as its ``momentum_buffer``."""
        if self._state is not None:
            self._taken_over.hand_back_sharded_momentum(self._state, self._optimizers)
        self._taken_over.restore(self._optimizers)

    @override
    def teardown(self) -> None:
        """Give the optimizers their SGD hyper-parameters back."""
        self._taken_over.restore(self._optimizers)
        super().teardown()
