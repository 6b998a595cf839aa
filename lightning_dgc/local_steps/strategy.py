"""Lightning glue for DiLoCo: ``Trainer(strategy="diloco")`` or ``Trainer(strategy=DiLoCoStrategy(sync_every=...))``.

:class:`DiLoCoStrategy` subclasses Lightning's ``DDPStrategy`` for its process group, launcher and distributed
sampler, but does not wrap the model in ``DistributedDataParallel``: between outer steps nothing crosses processes
(no gradient all-reduce, no buffer broadcast, no gradient bucket in memory). The outer step itself is
:class:`lightning_dgc.local_steps.outer.OuterStep`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dgc.algorithms import AlgorithmConfig
from lightning_dgc.checkpoint.exchange import finish_save
from lightning_dgc.checkpoint.rank_files import FileIO
from lightning_dgc.exchange.takeover import DEFAULT_MAX_CONSECUTIVE_SKIPS
from lightning_dgc.front.core import RankFileCheckpoints
from lightning_dgc.front.registration import register_strategies
from lightning_dgc.local_steps.core import DILOCO_KEY, OuterAccess
from lightning_dgc.local_steps.outer import DENSE

__all__ = ["DILOCO_KEY", "DiLoCoStrategy"]


class DiLoCoStrategy(RankFileCheckpoints, OuterAccess, DDPStrategy):
    """DiLoCo (Douillard et al., 2023): every rank takes ``sync_every`` optimizer steps on its own copy of the
    model, then the ranks average their *pseudo-gradients* (global weights minus local weights) and an outer
    Nesterov SGD steps the global weights, which every rank then continues from.

    * The user's optimizer is the *inner* optimizer; its state (momentum, Adam's moments) is each rank's own and
      carries over from round to round. During the inner steps no gradient crosses processes: the model is not
      wrapped in DDP (there is nothing for its reducer to do), and Lightning's distributed sampler still gives
      each rank its own shard of the data.
    * Hierarchical (``hierarchical``; several devices on each of several nodes): the model is wrapped in DDP over
      the ranks of its node, whose all-reduce averages the gradients inside the node at every step, and DiLoCo
      runs across the nodes: the first rank of each node exchanges the pseudo-gradient with the other nodes' first
      ranks and hands the average to its node (one all-reduce inside it). No gradient crosses nodes between outer
      steps, and a node's link carries one exchange per outer step, whatever its number of devices.
    * The outer step runs right after every ``sync_every``-th optimizer step (optimizer steps, so
      ``accumulate_grad_batches`` counts as Lightning counts ``global_step``): 1. pseudo-gradient = global -
      local; 2. its mean over the ranks (``algorithm``); 3. outer SGD on the global weights; 4. local := global,
      and floating-point buffers (BatchNorm's statistics) averaged. The ranks are bit-identical after it.
    * Streaming (``fragments``, ``overlap_steps``): each fragment of the model takes this outer step on its own
      staggered round; with an overlap the answer is mixed into local weights that trained on meanwhile, so the
      ranks then differ until the end of ``fit`` (docs: Local steps, Streaming).
    * Validation mid-round sees each rank's local weights (no copy, no exchange).
    * When ``fit`` ends mid-round, a last outer step runs (over the shorter round), so every rank holds the same
      model once ``fit`` returns (callbacks' ``on_train_end`` still see the local weights).
    * A pseudo-gradient that is not finite on any rank skips the outer SGD step on every rank, local := global
      (the round is lost), and the outer exchange's memory stays as it was; after ``max_consecutive_skips`` such
      outer steps in a row ``fit`` raises on every rank.
    * Checkpoints hold the global weights as the model's ``state_dict`` (what inference or a plain DDP resume
      loads), the outer optimizer and the position in the round; every rank writes its local weights, inner
      optimizer state and outer exchange memory into its own file beside the checkpoint (``<path>.exchange/``),
      so a resume mid-round continues exactly. A checkpoint without that entry (plain DDP's) starts a round from
      its weights; one written by another number of ranks starts a round from its global weights.

    Args:
        sync_every: optimizer steps between outer steps (DiLoCo's ``H``; 500 in the paper).
        outer_lr: the outer SGD's learning rate.
        outer_momentum: the outer SGD's momentum.
        outer_nesterov: Nesterov momentum (torch's SGD semantics).
        algorithm: how the pseudo-gradients travel: ``"dense"`` (one fp32 all-reduce) or any registered
            compression algorithm's name (``"dgc"``, ``"powersgd"``, an outside one) or configuration object,
            which exchanges them through the same path as the gradient hook, with its error feedback carried from
            outer step to outer step. Its step counter counts outer steps (PowerSGD's ``start_iter`` too).
        options: the algorithm's settings, as a dict; they may be given as keyword arguments instead.
        offload: keep the global weights and the outer momentum in host memory (copied to the device at every
            outer step) instead of two fp32 model copies on the device.
        max_consecutive_skips: raise after this many outer steps in a row skipped for non-finite pseudo-gradients
            (``None`` or 0: never).
        hierarchical: ``"auto"`` (the default): DDP inside each node and DiLoCo across the nodes when there are
            several nodes of several devices, else every rank is a DiLoCo worker; ``True``: always the former
            (an error on one node); ``False``: always the latter.
        fragments: Streaming DiLoCo: the trained tensors split into this many fragments of about equal size, each
            with its own round of ``sync_every`` steps, the rounds staggered so that one fragment sends at a time
            and the largest message is about ``1 / fragments`` of the model (1: plain DiLoCo).
        overlap_steps: optimizer steps a fragment's exchange runs behind the inner steps before its answer is
            merged (0: wait at once; below ``sync_every``).
        mixing: with ``overlap_steps``, the merge ``local := mixing * local + (1 - mixing) * global``.
        find_unused_parameters: DDP's argument, for the DDP inside each node of a hierarchical run (a flat run wraps
            the model in no DDP, so a parameter may go unused anyway). It is what
            ``"diloco_find_unused_parameters_true"`` sets, as ``"ddp_find_unused_parameters_true"`` does for DDP.
        **kwargs: the algorithm's settings. DDP's other arguments are refused: the model is not wrapped in DDP, or
            only inside the node.
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
        hierarchical: Literal["auto"] | bool = "auto",
        fragments: int = 1,
        overlap_steps: int = 0,
        mixing: float = 0.5,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
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
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
            process_group_backend=process_group_backend, timeout=timeout, start_method=start_method,
            find_unused_parameters=find_unused_parameters,
        )  # fmt: skip
        self._entry: dict[str, Any] | None = None  # the checkpoint's DiLoCo entry, restored in setup()
        self._inner_optimizer_states: list[Any] | None = None  # this rank's, from its rank file

    # -- set-up ------------------------------------------------------------------------------------------------
    @override
    def configure_ddp(self) -> None:
        """Every rank starts from rank 0's weights and buffers (as DDP's would), and the outer state starts from
        them. Flat: no DDP wrapper. Hierarchical: DDP over the ranks of each node (its all-reduce every step)."""
        assert isinstance(self.model, pl.LightningModule)
        topology = self._start_outer(self.model)
        if topology is not None:
            self._ddp_kwargs["process_group"] = topology.node.group  # type: ignore[attr-defined]
            super().configure_ddp()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if not self.lightning_module.automatic_optimization:
            raise ValueError(
                f"{type(self).__name__} counts the optimizer steps Lightning takes, and manual optimization takes its"
                " own: set `self.automatic_optimization = True` (the default), or use strategy='ddp'."
            )
        entry, self._entry = self._entry, None
        if entry is not None:  # (without one, the outer state already starts from the checkpoint's weights)
            self._inner_optimizer_states = self._restore(entry, self._checkpoint_path, FileIO(self.checkpoint_io))

    # -- the step ----------------------------------------------------------------------------------------------
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._count_step()
        return result

    @override
    def on_train_end(self) -> None:
        """A round cut short by the end of ``fit`` ends with an outer step: every rank holds the same model."""
        super().on_train_end()
        self.finish()

    # -- checkpoints -------------------------------------------------------------------------------------------
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank writes its local weights, inner optimizer state and outer exchange memory into its own file
        beside ``filepath``; rank 0 then writes the checkpoint: the global weights as the model's ``state_dict``,
        the outer state and the manifest of the rank files (all ranks call this)."""
        if self._outer is None:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        io = FileIO(self.checkpoint_io, storage_options)
        entry = self._save_ranks(filepath, io, checkpoint.get("optimizer_states"))
        if entry is None:  # not rank 0: its own file is written
            return
        self._global_weights_into(checkpoint["state_dict"], entry)
        checkpoint[DILOCO_KEY] = entry
        io.save(checkpoint, filepath, record=False)
        finish_save(filepath, entry, io)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict)  # the global weights: setup() starts from them
        self._entry = checkpoint.get(DILOCO_KEY)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Lightning's restore (rank 0's inner optimizer state), then this rank's own from its rank file."""
        super().load_optimizer_state_dict(checkpoint)
        states, self._inner_optimizer_states = self._inner_optimizer_states, None
        if states is not None:
            for optimizer, state in zip(self.optimizers, states, strict=True):
                optimizer.load_state_dict(state)


# Importing this module first imports Lightning, whose import hook (``lightning_dgc/__init__.py``) finds this module
# still loading and leaves its name to this line.
register_strategies(__name__)
