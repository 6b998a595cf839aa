"""Lightning glue: one strategy keeps Lightning's DDP wrapper and swaps the gradient exchange.

:class:`CompressionStrategy` runs any registered algorithm (:mod:`lightning_dgc.algorithms`); every algorithm is
registered with Lightning under its name (``Trainer(strategy="dgc")``, ``"deft"``, ``"powersgd"``, with the forms DDP
has: ``"dgc_spawn"``, ``"dgc_notebook"``, ...). :class:`DGCStrategy` and :class:`DEFTStrategy` are thin
names with DGC's and DEFT's arguments spelled out (Lightning's CLI builds its schema from them).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_dgc import comm
from lightning_dgc.algorithms import AlgorithmConfig
from lightning_dgc.algorithms.deft import DEFTConfig
from lightning_dgc.algorithms.dgc_config import DGCConfig, Selection, SelectionBackend, ValueDType
from lightning_dgc.checkpoint.exchange import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_KEY,
    check_entry,
    finish_save,
    mean_momentum,
    restore_exchange_state,
    save_exchange_state,
)
from lightning_dgc.checkpoint.rank_files import FileIO
from lightning_dgc.exchange.agreement import DEFAULT_CHECK_RANKS_EVERY
from lightning_dgc.exchange.state import ExchangeState
from lightning_dgc.exchange.takeover import (
    DEFAULT_MAX_CONSECUTIVE_SKIPS,
    OptimizerTakeOver,
    check_ranks_agree,
)
from lightning_dgc.front.core import (
    ExchangeAccess,
    RankFileCheckpoints,
    node_topology,
    sparse_gradient_parameters,
)
from lightning_dgc.front.registration import register_strategies
from lightning_dgc.front.trainer_steps import TrainerExchangeSteps

__all__ = [
    "CHECKPOINT_FORMAT", "CHECKPOINT_KEY", "CompressionStrategy", "DEFTStrategy", "DGCStrategy",
    "sparse_gradient_parameters",
]  # fmt: skip

log = logging.getLogger(__name__)


class CompressionStrategy(RankFileCheckpoints, ExchangeAccess, TrainerExchangeSteps, DDPStrategy):
    """Data-parallel training with a compressed gradient exchange (any registered algorithm).

    Subclasses Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` and keeps the DDP
    wrapper (overlap with backward, ``no_sync`` under gradient accumulation, unused parameters,
    buffer sync, the distributed sampler), but replaces DDP's dense all-reduce with the algorithm's
    exchange through one communication hook that is registered on every device type, CPU included
    (stock Lightning registers hooks on CUDA only and silently drops them elsewhere).

    Optimizer contract (momentum must not be applied twice), for algorithms that apply momentum in the
    exchange (DGC and DEFT with ``momentum_correction=True``, DGC's default):

    * ``torch.optim.SGD``: the exchange **takes over** its ``momentum``, ``nesterov`` and
      ``weight_decay`` per parameter group while ``fit`` runs (they are set to 0 in the optimizer and
      applied by the hook as momentum correction, with weight decay added to the local gradient
      before it). SGD then applies the averaged update with its learning rate only.
    * other optimizers whose parameter groups have ``momentum > 0`` (RMSprop, ...): rejected.
    * Adam-family optimizers (``betas``): allowed with ``momentum=0`` (plain error feedback); their
      own moments and weight decay stay in the optimizer.

    Other algorithms (DEFT by default, PowerSGD) leave momentum and weight decay to the optimizer.

    Args:
        algorithm: a registered algorithm's name (``"dgc"``, ``"deft"``, ``"powersgd"``, ...) or its
            configuration object (``DGCConfig(...)``, ``PowerSGDConfig(...)``).
        options: the configuration's fields, with an algorithm given by name
            (``CompressionStrategy("powersgd", {"matrix_approximation_rank": 2})``); they may be given as
            keyword arguments instead (``CompressionStrategy("powersgd", matrix_approximation_rank=2)``).
        max_consecutive_skips: the stall detector: after this many optimizer steps in a row that the strategy
            skipped for non-finite gradients (on any rank), ``fit`` raises on every rank instead of training
            on without moving the model. ``None`` or 0 turns it off. Steps a GradScaler skips (mixed
            precision backing its scale off) are the scaler's and are not counted.
        hierarchical: the two-level exchange across nodes of several devices (``"auto"``, ``True``,
            ``False``): a dense reduce-scatter inside each node, the algorithm across the nodes on each
            rank's shard, an all-gather inside the node (:func:`lightning_dgc.exchange.hook.exchange_two_level`).
            ``"auto"`` runs it when there is more than one node (``Trainer(num_nodes=...)``) and more than
            one device per node; ``True`` on one node is an error.
        check_ranks_every: compare a checksum of the ranks' parameters after optimizer steps 1, 2, 4, ... (the
            powers of two below this), then every this many steps, and raise on every rank, naming the parameters
            that differ, if they do (ranks that diverged, from any cause); ``None`` or 0 turns it off. Each check
            gathers 16 bytes per rank and reads the parameters once. The settings (``density``) are compared
            before every step's exchange in any case (16 bytes per rank), so a setting changed on one rank only
            raises on every rank instead of blocking the exchange.
        save_exchange_state: write every rank's exchange memory (momentum, residuals) beside each checkpoint, in
            its own file (``<checkpoint>.exchange/``), so that a resume continues it exactly. ``False``: the
            checkpoint holds the model and the optimizer only (with the mean momentum as SGD's buffers); a resume
            starts the residuals from zero, with a warning.
        gradient_as_bucket_view: DDP's argument, ``True`` here (``False`` under Lightning's ``DDPStrategy``),
            from Python and from the CLI alike: the parameters' ``.grad`` are views into DDP's buckets,
            into which the exchange writes the averaged update anyway, so the gradients take no memory of
            their own (one model size less). Pass ``False`` for separate ``.grad`` tensors (code that calls
            ``.grad.detach_()`` or ``.grad.requires_grad_()`` needs them).
        **kwargs: the configuration's fields (with an algorithm given by name), and every other argument of
            ``DDPStrategy`` and of DDP (``find_unused_parameters``, ``static_graph``, ...). Any other name
            is an error that lists the configuration's fields.
    """

    set_up_by = "`trainer.fit`"

    def __init__(
        self,
        algorithm: str | AlgorithmConfig = "dgc",
        options: dict[str, Any] | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        max_consecutive_skips: int | None = DEFAULT_MAX_CONSECUTIVE_SKIPS,
        hierarchical: Literal["auto"] | bool = "auto",
        check_ranks_every: int | None = DEFAULT_CHECK_RANKS_EVERY,
        gradient_as_bucket_view: bool = True,  # .grad and the bucket: one model size, not two
        save_exchange_state: bool = True,
        **kwargs: Any,
    ) -> None:
        self._hierarchical = comm.check_hierarchical(hierarchical)  # the nodes are known at setup
        self._take_arguments(
            algorithm, options, kwargs, DDPStrategy, save_exchange_state, max_consecutive_skips, check_ranks_every
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            gradient_as_bucket_view=gradient_as_bucket_view,
            **kwargs,
        )
        self._checkpoint_entry: dict[str, Any] | None = None  # restored in setup(), once the state exists
        # the SGD groups whose momentum the exchange applies
        self._taken_over = OptimizerTakeOver(type(self).__name__)
        self._legacy_checkpoint = (
            False  # resuming a checkpoint whose optimizer state holds the take-over's zeros
        )

    @override
    def _register_ddp_hooks(self) -> None:
        # Stock Lightning registers hooks on CUDA only; the hook is the point of this strategy, so it
        # is registered on every device type (gloo on CPU, NCCL on GPU).
        assert isinstance(self.model, DistributedDataParallel)
        self._refuse_sparse_gradients(self.model.module)
        named = list(self.model.module.named_parameters())
        state = self._state
        if state is None or list(state.param_names.values()) != [n for n, _ in named]:
            # else a second fit: the memory carries on
            state = self._state = ExchangeState(self._config, topology=self._two_level_topology())
        state.register_parameters(named)
        self._attach_auto_density(state)
        self._set_up_rank_checks()
        state.finish_writes_grads = True  # the averaged gradients are written after the memory's commit
        self.model.register_comm_hook(state, self._hook())
        log.debug("%s: registered the %s hook on %s", type(self).__name__, self.algorithm, self.root_device)

    def _two_level_topology(self) -> comm.Topology | None:
        """The process groups of the two-level exchange, or ``None`` for a flat one (``hierarchical``)."""
        topology = node_topology(self, self._hierarchical, type(self).__name__)
        if topology is not None:
            rank_zero_info(
                f"{type(self).__name__}: two-level exchange, {topology.nodes} nodes x {topology.per_node} devices:"
                f" dense inside the node, {self.algorithm} across the nodes on each device's shard."
            )
        return topology

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        if self.exchange_state.algorithm.takes_over_momentum:
            self._take_over_optimizers()
        self._check_ranks_agree()
        self._restore_exchange_state()

    def _take_over_optimizers(self, legacy_checkpoint: bool = False) -> None:
        """Move SGD momentum and weight decay into the hook (:meth:`OptimizerTakeOver.take_over`)."""
        self._taken_over.take_over(
            self.exchange_state,
            self.optimizers,
            self.lightning_module.named_parameters(),
            self.root_device,
            legacy_checkpoint,
        )

    def _check_ranks_agree(self) -> None:
        """Fail fast, on every rank, if ranks were configured differently (instead of hanging later)."""
        check_ranks_agree(self.exchange_state, type(self).__name__, self.max_consecutive_skips)

    @override
    def _after_exchange(self) -> None:
        self._rebuild_ddp_buckets()

    def _rebuild_ddp_buckets(self) -> None:
        """Let DDP rebuild its gradient buckets now, right after the first backward pass, not in the next forward.

        DDP runs its first iteration with one bucket for the whole model and rebuilds its real buckets once,
        at the start of the second forward (``Reducer._rebuild_buckets``, which its ``Join`` hook calls
        outside the forward too). With ``gradient_as_bucket_view=True`` the parameters' ``.grad`` are views
        into the old bucket until then, so old and new bucket are both alive for a moment: +1 model size.
        Here, before the optimizer's first step makes its state (SGD's momentum), that moment costs one
        model size less than in the second forward. The rebuild copies every ``.grad`` into the new bucket
        and makes ``.grad`` its view, as it would in the next forward: the same values, hence the same
        results. It runs on every rank (it broadcasts rank 0's bucket order), like ``finish_step``.
        """
        model = self.model
        if (
            isinstance(model, DistributedDataParallel)
            and not getattr(model, "_has_rebuilt_buckets", True)
            and model.reducer._rebuild_buckets()
        ):
            model._has_rebuilt_buckets = True

    # -- checkpoints -------------------------------------------------------------------------------
    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Every rank writes its exchange memory into its own file beside ``filepath``, then rank 0 writes the
        checkpoint with the manifest that names those files (all ranks call this; :mod:`lightning_dgc.checkpoint.rank_files`).

        The checkpoint also holds the user's SGD hyper-parameters and, as SGD's ``momentum_buffer``, the
        mean over ranks of the exchange's momentum (an all-reduce, parameter by parameter), so that plain DDP
        (or any strategy) resumes it with momentum applied once and nothing lost. Rank 0's file is DDP's size
        plus a few kB; no rank holds a copy of another rank's memory.
        """
        if self._state is None:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        io = FileIO(self.checkpoint_io, storage_options)
        state = self.exchange_state
        manifest = save_exchange_state(
            state, self.algorithm, filepath, io, type(self).__name__, with_memory=self.save_exchange_state
        )
        writes_momentum = "optimizer_states" in checkpoint and self._taken_over.needs_momentum()
        momenta = mean_momentum(state) if writes_momentum else None
        if manifest is None:  # not rank 0: its own file is written
            return
        checkpoint[CHECKPOINT_KEY] = manifest
        if "optimizer_states" in checkpoint:
            self._taken_over.write_user_optimizer_state(
                state, dict(enumerate(checkpoint["optimizer_states"])), momenta or {},
                dict(self.lightning_module.named_parameters()),
            )  # fmt: skip
        io.save(checkpoint, filepath, record=False)  # local: straight to disk (Lightning's buffers the whole file in memory)
        finish_save(filepath, manifest, io)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict)
        # Lightning restores the model before setup(); the exchange state is applied once it exists.
        self._checkpoint_entry = checkpoint.get(CHECKPOINT_KEY)
        self._legacy_checkpoint = check_entry(
            self._checkpoint_entry, self.algorithm, type(self).__name__, "optimizer_states" in checkpoint
        )

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Restore the optimizer, then take its (restored) SGD momentum over again: applied once, never lost."""
        super().load_optimizer_state_dict(checkpoint)
        if self._taken_over or self._legacy_checkpoint:
            self._take_over_optimizers(legacy_checkpoint=self._legacy_checkpoint)

    @override
    def on_train_end(self) -> None:
        """Hand the momentum back to SGD (mean over ranks), so that the optimizer object continues it if it
        is used again (a later ``fit`` with a new Trainer, or under another strategy)."""
        super().on_train_end()
        if self._state is None:
            return
        self._taken_over.hand_back_momentum(self.exchange_state, self.optimizers)

    @override
    def teardown(self) -> None:
        """Give the optimizer its SGD hyper-parameters back (the take-over ends with ``fit``)."""
        self._taken_over.restore(self.optimizers)
        super().teardown()

    def _restore_exchange_state(self) -> None:
        entry, self._checkpoint_entry = self._checkpoint_entry, None
        if entry is None:
            return
        restore_exchange_state(
            self.exchange_state, entry, self.root_device, self._checkpoint_path, FileIO(self.checkpoint_io)
        )


class DGCStrategy(CompressionStrategy):
    """Data-parallel training with Deep Gradient Compression (Lin et al., ICLR 2018).

    ``CompressionStrategy(DGCConfig(...))`` with DGC's settings as arguments (each one is described
    in :class:`~lightning_dgc.algorithms.dgc_config.DGCConfig`), ``max_consecutive_skips`` (the stall detector),
    ``hierarchical`` (the two-level exchange across nodes), ``check_ranks_every`` (the parameter check across
    ranks), ``gradient_as_bucket_view`` (``True``) and ``save_exchange_state`` (the exchange memory in
    checkpoints), all described in :class:`CompressionStrategy`, plus every ``DDPStrategy`` argument.
    """

    def __init__(
        self,
        density: float | Literal["auto"] = DGCConfig.density,
        sample_ratio: float = DGCConfig.sample_ratio,
        selection: Selection = DGCConfig.selection,
        selection_backend: SelectionBackend = DGCConfig.selection_backend,
        compile_selection: bool | Literal["auto"] = DGCConfig.compile_selection,
        min_compress_numel: int = DGCConfig.min_compress_numel,
        compress_vectors: bool = DGCConfig.compress_vectors,
        small_density: float | None = DGCConfig.small_density,
        small_every: int = DGCConfig.small_every,
        momentum_correction: bool = DGCConfig.momentum_correction,
        momentum: float = DGCConfig.momentum,
        nesterov: bool = DGCConfig.nesterov,
        momentum_masking: bool = DGCConfig.momentum_masking,
        local_clip_norm: float | None = DGCConfig.local_clip_norm,
        value_dtype: ValueDType = DGCConfig.value_dtype,
        seed: int = DGCConfig.seed,
        min_density: float = DGCConfig.min_density,
        auto_every: int = DGCConfig.auto_every,
        max_consecutive_skips: int | None = DEFAULT_MAX_CONSECUTIVE_SKIPS,
        hierarchical: Literal["auto"] | bool = "auto",
        check_ranks_every: int | None = DEFAULT_CHECK_RANKS_EVERY,
        gradient_as_bucket_view: bool = True,
        save_exchange_state: bool = True,
        **kwargs: Any,
    ) -> None:
        options = {
            "density": density, "sample_ratio": sample_ratio, "selection": selection,
            "selection_backend": selection_backend, "compile_selection": compile_selection,
            "min_compress_numel": min_compress_numel, "compress_vectors": compress_vectors,
            "small_density": small_density, "small_every": small_every,
            "momentum_correction": momentum_correction,
            "momentum": momentum, "nesterov": nesterov,
            "momentum_masking": momentum_masking, "local_clip_norm": local_clip_norm, "value_dtype": value_dtype,
            "seed": seed, "min_density": min_density, "auto_every": auto_every,
        }  # fmt: skip
        super().__init__(
            self.config_class(**options, **self._more_options()), max_consecutive_skips=max_consecutive_skips,
            hierarchical=hierarchical, check_ranks_every=check_ranks_every,
            gradient_as_bucket_view=gradient_as_bucket_view, save_exchange_state=save_exchange_state, **kwargs,
        )  # fmt: skip

    #: The configuration the arguments fill.
    config_class: ClassVar[type[DGCConfig]] = DGCConfig

    def _more_options(self) -> dict[str, Any]:
        """Arguments a subclass adds to DGC's."""
        return {}


class DEFTStrategy(DGCStrategy):
    """Data-parallel training with DEFT's partitioned gradient selection (Yoon and Oh, ICPP 2023).

    ``CompressionStrategy(DEFTConfig(...))``: DGC's arguments (``momentum_correction`` off by default) plus the
    switches of the method's parts (each described in :class:`~lightning_dgc.algorithms.deft.DEFTConfig`),
    plus every ``DDPStrategy`` argument. By default momentum follows DEFT's code: error feedback only in the exchange, and the
    optimizer's own momentum and weight decay applied to the averaged update (any optimizer works).
    """

    config_class = DEFTConfig

    def __init__(
        self,
        density: float | Literal["auto"] = DEFTConfig.density,
        momentum_correction: bool = DEFTConfig.momentum_correction,
        k_allocation: Literal["norm", "size"] = DEFTConfig.k_allocation,
        fragmenting: bool = DEFTConfig.fragmenting,
        rotation: bool = DEFTConfig.rotation,
        union_values: Literal["all", "owner"] = DEFTConfig.union_values,
        selectors: Literal["owner", "all"] = DEFTConfig.selectors,
        budget: Literal["k", "dgc_link"] = DEFTConfig.budget,
        wire: Literal["allreduce", "compact"] = DEFTConfig.wire,
        **kwargs: Any,
    ) -> None:
        self._deft_options = {
            "k_allocation": k_allocation, "fragmenting": fragmenting,
            "rotation": rotation, "union_values": union_values, "selectors": selectors, "budget": budget,
            "wire": wire,
        }  # fmt: skip
        super().__init__(density=density, momentum_correction=momentum_correction, **kwargs)

    def _more_options(self) -> dict[str, Any]:
        return dict(self._deft_options)


# Importing this module first imports Lightning, whose import hook (``lightning_dgc/__init__.py``) finds this module
# still loading and leaves its names to this line.
register_strategies(__name__)
