"""Fabric glue for DiLoCo: ``Fabric(strategy="diloco")`` or ``Fabric(strategy=FabricDiLoCoStrategy(sync_every=...))``.

:class:`FabricDiLoCoStrategy` is the Fabric front door of the Trainer's :class:`~lightning_dgc.DiLoCoStrategy`:
the same arguments, the same outer step (:class:`lightning_dgc.local_steps.outer.OuterStep`), the same checkpoint layout
(:mod:`lightning_dgc.local_steps.core`). It subclasses Fabric's ``DDPStrategy`` for its process group, launcher and
distributed sampler, and does not wrap the model in ``DistributedDataParallel``:

* ``fabric.setup(model, optimizer)``: every rank takes rank 0's weights and buffers; the global weights start
  from them;
* ``optimizer.step()`` (the optimizer ``fabric.setup`` returned): the inner step; after every ``sync_every``-th
  one, the outer step;
* ``fabric.strategy.finish()`` after the loop: the last outer step when the last round was cut short;
* ``fabric.save(path, state)`` / ``fabric.load(path, state)``: the global weights as the model's state, the outer
  state in the checkpoint, every rank's local weights, inner optimizer state and outer memory in its own file.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.ddp import _DDPBackwardSyncControl
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.types import Optimizable
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dgc.algorithms import AlgorithmConfig
from lightning_dgc.checkpoint.exchange import finish_save
from lightning_dgc.checkpoint.files import read_checkpoint
from lightning_dgc.checkpoint.rank_files import FileIO
from lightning_dgc.exchange.takeover import DEFAULT_MAX_CONSECUTIVE_SKIPS
from lightning_dgc.front.core import check_model_first
from lightning_dgc.front.registration import register_strategies
from lightning_dgc.local_steps.core import DILOCO_KEY, OuterAccess
from lightning_dgc.local_steps.outer import DENSE

__all__ = ["FabricDiLoCoStrategy"]


class _NothingToSync(_BackwardSyncControl):
    """``fabric.no_backward_sync``: a backward pass exchanges nothing under DiLoCo, so there is nothing to skip."""

    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return nullcontext()


class FabricDiLoCoStrategy(OuterAccess, DDPStrategy):
    """DiLoCo (Douillard et al., 2023) under Fabric: every rank takes ``sync_every`` optimizer steps on its own copy
    of the model, then the ranks average their pseudo-gradients (global minus local weights) and an outer Nesterov
    SGD steps the global weights, which every rank continues from. What it does, costs and refuses is the Trainer
    strategy's (:class:`~lightning_dgc.DiLoCoStrategy`, ``docs/diloco.md``); here:

    * the optimizer steps counted are the ``step()`` calls of the optimizers ``fabric.setup`` returned (every one
      of them, as the Trainer counts each optimizer's step); stepping the unwrapped optimizer is not counted;
    * Fabric has no end-of-training hook: call ``fabric.strategy.finish()`` after the loop, on every rank, to end a
      round cut short with an outer step (nothing to do when the last step ended a round);
    * ``fabric.save(path, {"model": model, "optimizer": optimizer, ...})`` writes the global weights as the model's
      state and the outer state; every rank writes its local weights, the inner optimizers' state and the outer
      exchange memory into its own file beside ``path`` (``<path>.exchange/``). ``fabric.load(path, state)`` with
      the model in ``state`` restores all of it (mid-round exactly); a checkpoint without the DiLoCo entry starts a
      round from its weights;
    * ``fabric.no_backward_sync`` has nothing to skip and does nothing (hierarchical: it skips DDP's all-reduce
      inside the node, as under DDP).

    One model per strategy. Arguments: those of :class:`~lightning_dgc.DiLoCoStrategy` (``sync_every``,
    ``outer_lr``, ``outer_momentum``, ``outer_nesterov``, ``algorithm``, ``options`` or the algorithm's settings as
    keyword arguments, ``offload``, ``max_consecutive_skips``, ``hierarchical``, ``fragments``,
    ``overlap_steps``, ``mixing``, ``find_unused_parameters``) and those of Fabric's ``DDPStrategy`` but DDP's
    other arguments.
    """

    set_up_by = "`fabric.setup(model, ...)`"

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
        hierarchical: Literal["auto"] | bool = "auto",
        fragments: int = 1,
        overlap_steps: int = 0,
        mixing: float = 0.5,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        find_unused_parameters: bool = False,
        **kwargs: Any,
    ) -> None:
        # Validated before anything else, so that a bad value fails at construction, on the launching process.
        self._init_outer(
            sync_every, outer_lr, outer_momentum, outer_nesterov, offload, max_consecutive_skips, algorithm, options,
            kwargs, DDPStrategy, hierarchical, (fragments, overlap_steps, mixing),
        )  # fmt: skip
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision=precision, process_group_backend=process_group_backend,
            timeout=timeout, start_method=start_method, find_unused_parameters=find_unused_parameters,
        )  # fmt: skip
        self._backward_sync_control = _NothingToSync()
        self._module: Module | None = None
        self._optimizers: list[Optimizer] = []  # set up through this strategy, in order

    @override
    def setup_module(self, module: Module) -> Module:
        """Every rank takes rank 0's weights and buffers, and the outer state starts from them. Flat: no DDP wrapper.
        Hierarchical: DDP over the ranks of each node (its all-reduce every step, ``fabric.no_backward_sync`` as
        under DDP)."""
        if self._module is not None:
            raise ValueError(
                f"{type(self).__name__} keeps the global weights of one model, and one is set up already: set up the"
                " other models under another Fabric, or put them in one `nn.Module`."
            )
        topology = self._start_outer(module)
        if topology is not None:
            self._ddp_kwargs["process_group"] = topology.node.group  # type: ignore[attr-defined]
            self._backward_sync_control = _DDPBackwardSyncControl()
            module = super().setup_module(module)
        self._module = module
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        check_model_first(type(self).__name__, self._module)
        optimizer = super().setup_optimizer(optimizer)
        self._optimizers.append(optimizer)
        return optimizer

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        """The inner step, then the outer step at the end of a round."""
        result = super().optimizer_step(optimizer, **kwargs)
        self._count_step()
        return result

    # -- checkpoints -------------------------------------------------------------------------------------------
    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Module | Optimizer | Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Every rank writes its local weights, the inner optimizers' state and its outer exchange memory into its
        own file beside ``path``; rank 0 then writes ``state`` with the global weights as the model's state, and
        the outer state (all ranks call this)."""
        if self._outer is None:
            super().save_checkpoint(path, state, storage_options, filter)
            return
        if DILOCO_KEY in state:
            raise ValueError(
                f"`fabric.save(path, state)`: the key {DILOCO_KEY!r} is where {type(self).__name__} stores the outer"
                " state; rename that entry of `state`."
            )
        converted = self._convert_stateful_objects_in_state(state, filter=(filter or {}))
        inner = {key: converted[key] for key, obj in state.items() if any(obj is o for o in self._optimizers)}
        io = FileIO(self.checkpoint_io, storage_options)
        entry = self._save_ranks(path, io, inner)
        if entry is None:  # not rank 0: its own file is written
            return
        for key, obj in state.items():
            if obj is self._module:
                self._global_weights_into(converted[key], entry)
        converted[DILOCO_KEY] = entry
        io.save(converted, path, record=False)
        finish_save(path, entry, io)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Module | Optimizer | dict[str, Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore ``state``; with the model in it, the outer state and this rank's local weights, inner optimizer
        state and outer exchange memory too (all ranks call this). With no ``state`` the checkpoint is returned in
        full, its DiLoCo entry under ``"lightning_dgc_diloco"`` included."""
        load = super().load_checkpoint
        remainder = read_checkpoint(lambda: load(path, state, strict, weights_only), path)
        if self._outer is None or not isinstance(state, dict) or not state:
            return remainder
        entry = remainder.pop(DILOCO_KEY, None)
        if not any(obj is self._module for obj in state.values()):
            return remainder  # the outer state goes with the weights it belongs to
        inner = self._restore(entry, path, FileIO(self.checkpoint_io))
        for key, obj in state.items():
            if inner is not None and key in inner and any(obj is o for o in self._optimizers):
                obj.load_state_dict(inner[key])
        return remainder


# Importing this module first imports Lightning, whose import hook (``lightning_dgc/__init__.py``) finds this module
# still loading and leaves its name to this line.
register_strategies(__name__)
