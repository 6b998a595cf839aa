"""Fabric glue: ``Fabric(strategy="dgc" | "deft" | "powersgd" | FabricCompressionStrategy(...))``.

:class:`FabricCompressionStrategy` subclasses Fabric's
:class:`~lightning.fabric.strategies.DDPStrategy` and runs any registered algorithm
(:mod:`lightning_dgc.algorithms`) as the Trainer's :class:`~lightning_dgc.CompressionStrategy` does,
with the same optimizer take-over (:mod:`lightning_dgc.exchange.takeover`) and the same checkpoint entry
(:mod:`lightning_dgc.checkpoint.exchange`):

* ``fabric.setup(model, optimizer)`` wraps the model in DDP and registers the exchange's hook on every
  device type (Fabric's own DDP strategy registers none);
* ``fabric.backward(loss)`` runs the exchange, bucket by bucket, and closes its step (commit the memory,
  or keep it as it was when a gradient was not finite on some rank);
* ``optimizer.step()`` steps, or skips the step on every rank when a gradient was not finite;
* ``fabric.save(path, state)`` writes every rank's memory into its own file beside ``path`` and the user's SGD
  hyper-parameters and momentum into the optimizer's state; ``fabric.load(path, state)`` restores them.

Every algorithm is registered in Fabric's strategy registry under its name, with the forms Fabric has for DDP
(``"<name>_spawn"``, ``"<name>_notebook"``, ...; :mod:`lightning_dgc.front.registration`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dgc.algorithms import AlgorithmConfig
from lightning_dgc.checkpoint.exchange import (
    CHECKPOINT_KEY,
    check_entry,
    finish_save,
    mean_momentum,
    restore_exchange_state,
    save_exchange_state,
)
from lightning_dgc.checkpoint.files import read_checkpoint
from lightning_dgc.checkpoint.rank_files import FileIO
from lightning_dgc.exchange.agreement import DEFAULT_CHECK_RANKS_EVERY
from lightning_dgc.exchange.state import ExchangeState
from lightning_dgc.exchange.takeover import (
    DEFAULT_MAX_CONSECUTIVE_SKIPS,
    OptimizerTakeOver,
    check_ranks_agree,
)
from lightning_dgc.front.core import ExchangeAccess, check_model_first
from lightning_dgc.front.fabric_steps import FabricExchangeSteps
from lightning_dgc.front.registration import register_strategies

log = logging.getLogger(__name__)

class FabricCompressionStrategy(ExchangeAccess, FabricExchangeSteps, DDPStrategy):
    """Fabric's data-parallel strategy with a compressed gradient exchange (any registered algorithm).

    The optimizer contract is the Trainer strategy's (:class:`~lightning_dgc.CompressionStrategy`): for
    algorithms that apply momentum in the exchange (DGC; DEFT with ``momentum_correction=True``) SGD's
    ``momentum``, ``nesterov`` and ``weight_decay`` are taken over (set to 0 in the optimizer from
    ``fabric.setup`` on, applied by the exchange); other optimizers with momentum are rejected.
    ``fabric.save`` writes the user's values and the mean momentum into the optimizer's state, so that
    a checkpoint resumes under plain DDP too.

    One model per strategy: its exchange memory is keyed by the model's parameter names.

    Args:
        algorithm: a registered algorithm's name (``"dgc"``, ``"deft"``, ``"powersgd"``, ...) or its
            configuration object (``DGCConfig(density=0.01)``).
        options: the configuration's fields, with an algorithm given by name
            (``FabricCompressionStrategy("dgc", {"density": 0.01})``); they may be given as keyword
            arguments instead, as to the Trainer's strategies
            (``FabricCompressionStrategy("dgc", density=0.01)``).
        max_consecutive_skips: the stall detector, as the Trainer strategy's.
        check_ranks_every: compare a checksum of the ranks' parameters early (steps 1, 2, 4, ...), then every this
            many optimizer steps, as the Trainer strategy's (:class:`~lightning_dgc.CompressionStrategy`); ``None`` or 0 turns it off.
        save_exchange_state: write every rank's exchange memory beside each checkpoint, as the Trainer strategy's;
            ``False``: model and optimizer only (a resume starts the residuals from zero, with a warning).
        gradient_as_bucket_view: DDP's argument, ``True`` here (the parameters' ``.grad`` are views into
            DDP's buckets: one model size less); pass ``False`` for separate ``.grad`` tensors.
        **kwargs: the configuration's fields (with an algorithm given by name), and every other argument of
            Fabric's ``DDPStrategy`` and of DDP (``find_unused_parameters``, ``static_graph``, ...). Any other
            name is an error that lists the configuration's fields.
    """

    set_up_by = "`fabric.setup(model, ...)`"

    def __init__(
        self,
        algorithm: str | AlgorithmConfig = "dgc",
        options: dict[str, Any] | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        max_consecutive_skips: int | None = DEFAULT_MAX_CONSECUTIVE_SKIPS,
        check_ranks_every: int | None = DEFAULT_CHECK_RANKS_EVERY,
        gradient_as_bucket_view: bool = True,  # .grad and the bucket: one model size, not two
        save_exchange_state: bool = True,
        **kwargs: Any,
    ) -> None:
        self._take_arguments(
            algorithm, options, kwargs, DDPStrategy, save_exchange_state, max_consecutive_skips, check_ranks_every
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            gradient_as_bucket_view=gradient_as_bucket_view,
            **kwargs,
        )
        self._module: DistributedDataParallel | None = None
        self._optimizers: list[Optimizer] = []  # set up through this strategy, in order
        self._taken_over = OptimizerTakeOver(type(self).__name__, f"{type(self).__name__}({self.algorithm!r}, ")

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        """Wrap ``module`` in DDP and register the exchange's hook (on every device type, CPU included)."""
        if self._module is not None:
            raise ValueError(
                f"{type(self).__name__} compresses the gradients of one model, and one is set up already: set up"
                " the other models under another Fabric, or put them in one `nn.Module`."
            )
        self._refuse_sparse_gradients(module)
        ddp = super().setup_module(module)
        state = self._state = ExchangeState(self._config)
        state.register_parameters(list(ddp.module.named_parameters()))
        self._attach_auto_density(state)
        ddp.register_comm_hook(state, self._hook())
        self._module = ddp
        self._set_up_rank_checks()
        check_ranks_agree(state, type(self).__name__, self.max_consecutive_skips)
        log.debug("%s: registered the %s hook on %s", type(self).__name__, self.algorithm, self.root_device)
        return ddp

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Take over SGD's momentum and weight decay (for algorithms that apply momentum in the exchange)."""
        check_model_first(type(self).__name__, self._state)
        optimizer = super().setup_optimizer(optimizer)
        self._optimizers.append(optimizer)
        self._take_over()
        return optimizer

    def _take_over(self) -> None:
        state = self.exchange_state
        if not state.algorithm.takes_over_momentum:
            return
        assert self._module is not None
        self._taken_over.restore(self._optimizers)  # the live groups hold the user's values again
        self._taken_over.take_over(state, self._optimizers, self._module.module.named_parameters(), self.root_device)
        check_ranks_agree(state, type(self).__name__, self.max_consecutive_skips)

    def _checked_parameters(self) -> Any:
        return self._module.module.named_parameters() if self._module is not None else None

    # -- checkpoints -----------------------------------------------------------------------------
    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Write ``state``, and every rank's exchange memory into its own file beside ``path`` (all ranks call this;
        the layout of the Trainer strategy, :mod:`lightning_dgc.checkpoint.rank_files`).

        Each optimizer set up through this strategy is written with the user's SGD hyper-parameters and,
        as SGD's ``momentum_buffer``, the mean over ranks of the exchange's momentum (as the Trainer
        strategy does).
        """
        if self._state is None:
            super().save_checkpoint(path, state, storage_options, filter)
            return
        if CHECKPOINT_KEY in state:
            raise ValueError(
                f"`fabric.save(path, state)`: the key {CHECKPOINT_KEY!r} is where {type(self).__name__} stores"
                " the exchange state; rename that entry of `state`."
            )
        converted = self._convert_stateful_objects_in_state(state, filter=(filter or {}))
        io = FileIO(self.checkpoint_io, storage_options)
        manifest = save_exchange_state(
            self._state, self.algorithm, path, io, type(self).__name__, with_memory=self.save_exchange_state
        )
        optimizers = [key for key, obj in state.items() if any(obj is opt for opt in self._optimizers)]
        momenta = mean_momentum(self._state) if optimizers and self._taken_over.needs_momentum() else None
        if manifest is None:  # not rank 0: its own file is written
            return
        converted[CHECKPOINT_KEY] = manifest
        packed = {
            index: converted[key]
            for key, obj in state.items()
            for index, optimizer in enumerate(self._optimizers)
            if obj is optimizer and isinstance(converted.get(key), dict) and "param_groups" in converted[key]
        }
        assert self._module is not None
        params = dict(self._module.module.named_parameters())
        self._taken_over.write_user_optimizer_state(self._state, packed, momenta or {}, params)
        io.save(converted, path, record=False)  # local: straight to disk (Lightning's buffers the whole file first)
        finish_save(path, manifest, io)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state`` and this rank's exchange memory (the mean of all ranks' on another world size).

        The exchange memory is restored when ``state`` is a dictionary of objects to restore
        (``fabric.load(path, {"model": model, "optimizer": optimizer, ...})``); with no ``state`` the
        checkpoint is returned in full, its exchange entry under ``"lightning_dgc"`` included. A truncated file
        is an error naming it and the fix (:func:`~lightning_dgc.checkpoint.files.read_checkpoint`).
        """
        load = super().load_checkpoint
        if self._state is None or not isinstance(state, dict) or not state:
            return read_checkpoint(lambda: load(path, state, strict, weights_only), path)
        self._taken_over.restore(self._optimizers)  # as the checkpoint's optimizer state holds them
        try:
            remainder = read_checkpoint(lambda: load(path, state, strict, weights_only), path)
            entry = remainder.pop(CHECKPOINT_KEY, None)
            loads_optimizer = any(obj is opt for obj in state.values() for opt in self._optimizers)
            check_entry(entry, self.algorithm, type(self).__name__, loads_optimizer)
            if entry is not None:
                restore_exchange_state(self._state, entry, self.root_device, path, FileIO(self.checkpoint_io))
        finally:
            self._take_over()  # the loaded SGD hyper-parameters and momentum buffers, taken over again
        return remainder

    def release_optimizers(self) -> None:
        """End the take-over, as the Trainer strategy does when ``fit`` ends (all ranks call this).

        SGD gets its ``momentum``, ``nesterov`` and ``weight_decay`` back, and the mean over ranks of the
        exchange's momentum as its ``momentum_buffer``, so that the optimizer continues it when it is used
        again without this strategy. Call it after the loop; Fabric has no end-of-training hook to do it.
        """
        if self._state is not None:
            self._taken_over.hand_back_momentum(self._state, self._optimizers)
        self._taken_over.restore(self._optimizers)

    @override
    def teardown(self) -> None:
        """Give the optimizers their SGD hyper-parameters back."""
        self._taken_over.restore(self._optimizers)
        super().teardown()


# Importing this module first imports Lightning, whose import hook (``lightning_dgc/__init__.py``) finds this module
# still loading and leaves its names to this line.
register_strategies(__name__)
