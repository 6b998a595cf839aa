"""Lightning glue: ``DGCStrategy`` keeps Lightning's DDP wrapper and swaps the gradient exchange."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, NamedTuple

import lightning.pytorch as pl
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dgc import comm
from lightning_dgc.hook import deft_hook, dgc_hook, sparse_gradient_message
from lightning_dgc.memory import bucket_order_flat, momentum_from_sgd, momentum_to_sgd
from lightning_dgc.state import (
    DGCConfig,
    DGCState,
    ParamSettings,
    Selection,
    ValueDType,
    check_density,
    real_number,
    state_for_rank,
)

log = logging.getLogger(__name__)

#: Key of the per-rank exchange state in Lightning checkpoints.
CHECKPOINT_KEY = "lightning_dgc"
#: Version of that entry. 2: the checkpoint's optimizer state holds the user's SGD hyper-parameters and
#: momentum (absent: written before, with the take-over's zeros there).
CHECKPOINT_FORMAT = 2


def _is_local(path: Any) -> bool:
    return isinstance(get_filesystem(path), LocalFileSystem)


def _save_atomically(checkpoint: dict[str, Any], filepath: Any) -> None:
    """``torch.save`` straight into a temporary file beside ``filepath``, then renamed over it.

    As atomic as Lightning's ``TorchCheckpointIO`` (a crash leaves the previous file or none), but
    without serialising the whole checkpoint into memory first: the exchange's memory makes a
    checkpoint ``2 x world_size`` model sizes larger than DDP's, and that buffer would double it.
    """
    path = Path(filepath)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        torch.save(checkpoint, partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


class _Hyperparameters(NamedTuple):
    """The user's SGD hyper-parameters of one parameter group, before the take-over set them to 0."""

    momentum: float
    nesterov: bool
    weight_decay: float


@dataclass
class _TakenOver:
    """One SGD parameter group whose momentum and weight decay the exchange applies."""

    optimizer: int  # index into ``strategy.optimizers``
    group: int  # index into its ``param_groups``
    user: _Hyperparameters
    names: list[str]  # the group's parameter names, in group order ("" for parameters outside the module)

    def restore(self, group: dict[str, Any]) -> None:
        """Put the user's values back into ``group`` (a live group or a checkpoint's copy)."""
        group["momentum"], group["nesterov"], group["weight_decay"] = self.user


def sparse_gradient_parameters(module: torch.nn.Module) -> list[str]:
    """Names of the trainable parameters of ``module`` whose gradients will be sparse tensors."""
    return [
        f"{prefix}.{name}" if prefix else name
        for prefix, m in module.named_modules()
        if getattr(m, "sparse", False) is True
        for name, p in m.named_parameters(recurse=False)
        if p.requires_grad
    ]


class DGCStrategy(DDPStrategy):
    """Data-parallel training with Deep Gradient Compression (Lin et al., ICLR 2018).

    Subclasses Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` and keeps the DDP
    wrapper (overlap with backward, ``no_sync`` under gradient accumulation, unused parameters,
    buffer sync, the distributed sampler), but replaces DDP's dense all-reduce with DGC's sparse
    exchange through a communication hook that is registered on every device type, CPU included.

    Optimizer contract (momentum must not be applied twice):

    * ``torch.optim.SGD``: DGC **takes over** its ``momentum``, ``nesterov`` and ``weight_decay``
      per parameter group (they are set to 0 in the optimizer and applied by the hook as momentum
      correction, with weight decay added to the local gradient before it). SGD then applies the
      averaged sparse update with its learning rate only.
    * other optimizers whose parameter groups have ``momentum > 0`` (RMSprop, ...): rejected.
    * Adam-family optimizers (``betas``): allowed with ``momentum=0`` (plain error feedback); their
      own moments and weight decay stay in the optimizer.

    Args:
        density: fraction of each compressed tensor sent per step, in (0, 1] (paper: 0.001).
        sample_ratio: fraction sampled to estimate the top-k threshold, in (0, 1].
        selection: ``"sampled"`` (DGC's threshold sampling) or ``"exact"`` (``torch.topk``).
        min_compress_numel: smaller tensors and all 1-D tensors are averaged dense.
        momentum: momentum correction for parameters whose optimizer has none (SGD with momentum 0,
            or no optimizer). Giving both this and an SGD momentum raises an error.
        nesterov: Nesterov momentum correction (with ``momentum``).
        momentum_masking: clear sent coordinates from the momentum as well (paper default: on).
        local_clip_norm: local per-tensor gradient clipping before accumulation, scaled by
            ``world_size ** -0.5``; ``None`` (default) disables it.
        value_dtype: ``"fp32"`` or ``"fp16"`` values on the wire.
        seed: seed of the per-rank sampling generator.
    """

    strategy_name = "dgc"

    def __init__(
        self,
        density: float = 0.001,
        sample_ratio: float = 0.01,
        selection: Selection = "sampled",
        min_compress_numel: int = 1024,
        momentum: float = 0.0,
        nesterov: bool = False,
        momentum_masking: bool = True,
        local_clip_norm: float | None = None,
        value_dtype: ValueDType = "fp32",
        seed: int = 0,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        for forbidden in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period"):
            if kwargs.get(forbidden) is not None:
                raise ValueError(
                    f"{type(self).__name__} installs its own DDP communication hook; `{forbidden}` cannot be"
                    " combined with it. Use `DDPStrategy` for other hooks."
                )
            kwargs.pop(forbidden, None)
        # Validate before anything else, so a bad value fails at construction, on the launching process.
        self._dgc_config = DGCConfig(
            density=density,
            sample_ratio=sample_ratio,
            selection=selection,
            min_compress_numel=min_compress_numel,
            momentum=momentum,
            nesterov=nesterov,
            momentum_masking=momentum_masking,
            local_clip_norm=local_clip_norm,
            value_dtype=value_dtype,
            seed=seed,
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
            **kwargs,
        )
        self._dgc_state: DGCState | None = None
        self._checkpoint_entry: dict[str, Any] | None = None  # restored in setup(), once the state exists
        self._taken_over: list[_TakenOver] = []  # SGD groups whose momentum the exchange applies
        self._legacy_checkpoint = (
            False  # resuming a checkpoint whose optimizer state holds the take-over's zeros
        )
        self.hook_calls = 0  # incremented by the registered hook: proof that it runs

    # -- public API ------------------------------------------------------------------------------
    @property
    def dgc_state(self) -> DGCState:
        if self._dgc_state is None:
            raise RuntimeError(
                f"{type(self).__name__} has no exchange state before `trainer.fit` has set up the model."
            )
        return self._dgc_state

    @property
    def density(self) -> float:
        """The density in force (set it to change sparsity during training, identically on all ranks)."""
        return self._dgc_state.density if self._dgc_state is not None else self._dgc_config.density

    @density.setter
    def density(self, value: float) -> None:
        if self._dgc_state is not None:
            self._dgc_state.density = value
        else:
            self._dgc_config.density = check_density(value)

    def compression_stats(self) -> dict[str, float | int | bool]:
        """Statistics of the last optimizer step on this rank (see :meth:`DGCState.compression_stats`)."""
        return self._dgc_state.compression_stats() if self._dgc_state is not None else {}

    # -- setup -----------------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        comm.destroy_process_group_at_exit()  # gloo aborts at exit if its group is still alive

    def _make_state(self) -> DGCState:
        return DGCState(config=self._dgc_config)

    #: The DDP communication hook that implements the algorithm.
    exchange_hook = staticmethod(dgc_hook)

    def _hook(self) -> Callable[..., torch.futures.Future[torch.Tensor]]:
        strategy = self

        def counted_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations literally
            strategy.hook_calls += 1
            return strategy.exchange_hook(state, bucket)

        return counted_hook

    @override
    def _register_ddp_hooks(self) -> None:
        # Stock Lightning registers hooks on CUDA only; the hook is the point of this strategy, so it
        # is registered on every device type (gloo on CPU, NCCL on GPU).
        assert isinstance(self.model, DistributedDataParallel)
        sparse = sparse_gradient_parameters(self.model.module)
        if sparse:
            raise ValueError(f"{type(self).__name__}: {sparse_gradient_message(sparse)}")
        named = list(self.model.module.named_parameters())
        state = self._dgc_state
        if state is None or list(state.param_names.values()) != [n for n, _ in named]:
            state = self._dgc_state = self._make_state()  # else a second fit: the memory carries on
        state.register_parameters(named)
        self.model.register_comm_hook(state, self._hook())
        log.debug("%s: registered the compression hook on %s", type(self).__name__, self.root_device)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self._take_over_optimizers()
        self._check_ranks_agree()
        self._restore_exchange_state()

    def _take_over_optimizers(self, legacy_checkpoint: bool = False) -> None:
        """Move SGD momentum and weight decay into the hook; reject optimizers that would apply momentum twice.

        Called at setup and again after Lightning restored the optimizer state from a checkpoint (which
        brings back the checkpoint's hyper-parameters). The user's values are read from the optimizer
        (or, for a checkpoint written before they were kept, from the setup-time optimizer), recorded so
        that checkpoints and the optimizer after ``fit`` hold them, and set to 0 in the optimizer. An
        SGD ``momentum_buffer`` found in the optimizer state (a DDP checkpoint, or a previous ``fit``)
        becomes the exchange's momentum for parameters that have none yet, and is removed from SGD.
        """
        state = self.dgc_state
        cfg = state.config
        names = {id(p): n for n, p in self.lightning_module.named_parameters()}
        before = {(t.optimizer, t.group): t for t in self._taken_over}
        self._taken_over = []
        taken, carried = 0, 0
        for oi, optimizer in enumerate(self.optimizers):
            opt = getattr(optimizer, "_optimizer", optimizer)
            for gi, group in enumerate(opt.param_groups):
                momentum = float(group.get("momentum", 0.0) or 0.0)
                if isinstance(opt, torch.optim.SGD):
                    user = _Hyperparameters(
                        momentum, bool(group.get("nesterov", False)), float(group.get("weight_decay", 0.0))
                    )
                    if legacy_checkpoint and (oi, gi) in before:
                        user = before[oi, gi].user
                    self._check_sgd(user.momentum, group)
                    settings = ParamSettings(
                        momentum=user.momentum if user.momentum > 0 else cfg.momentum,
                        nesterov=user.nesterov or cfg.nesterov,
                        weight_decay=user.weight_decay + cfg.weight_decay,
                    )
                    group["momentum"], group["nesterov"], group["weight_decay"] = 0.0, False, 0.0
                    group_names = [names.get(id(p), "") for p in group["params"]]
                    self._taken_over.append(_TakenOver(oi, gi, user, group_names))
                    for p, name in zip(group["params"], group_names, strict=True):
                        if not name:
                            continue
                        state.param_settings[name] = settings
                        carried += self._carry_sgd_momentum(opt, p, name, settings)
                    taken += int(user.momentum > 0 or settings.weight_decay > 0)
                elif momentum > 0:
                    raise ValueError(
                        f"{type(opt).__name__} applies its own momentum ({momentum}), and DGC's momentum"
                        " correction would apply it a second time. Use torch.optim.SGD (DGC takes its momentum"
                        f" over), or set the optimizer's momentum to 0 and pass {type(self).__name__}(momentum=...)."
                    )
                elif "betas" in group and cfg.momentum > 0:
                    raise ValueError(
                        f"{type(opt).__name__} keeps its own first moment (betas={group['betas']}); with DGC's"
                        f" momentum correction (momentum={cfg.momentum}) momentum would be applied twice."
                        f" Use {type(self).__name__}(momentum=0) with Adam-family optimizers."
                    )
        state._plans.clear()
        if taken and not before:
            rank_zero_info(
                f"{type(self).__name__}: took over SGD momentum/weight decay of {taken} parameter group(s);"
                " they are applied by momentum correction inside the gradient exchange."
            )
        if carried:
            rank_zero_info(
                f"{type(self).__name__}: continued SGD's momentum buffers of {carried} parameter(s) as the"
                " exchange's momentum."
            )

    def _check_sgd(self, momentum: float, group: dict[str, Any]) -> None:
        cfg = self.dgc_state.config
        if momentum > 0 and cfg.momentum > 0:
            raise ValueError(
                f"Momentum would be applied twice: the SGD optimizer has momentum={momentum} and"
                f" {type(self).__name__} has momentum={cfg.momentum}. Set only one: DGC takes the"
                " SGD momentum over by itself, so leave the strategy's `momentum` at 0."
            )
        if group.get("dampening", 0.0):
            raise ValueError("DGC's momentum correction has no dampening; create SGD with `dampening=0`.")
        if group.get("maximize", False):
            raise ValueError("SGD(maximize=True) is not supported by DGC; negate the loss instead.")

    def _carry_sgd_momentum(
        self, opt: Optimizer, param: torch.Tensor, name: str, settings: ParamSettings
    ) -> int:
        """Move SGD's ``momentum_buffer`` of ``param`` (if any) into the exchange's momentum; 1 if carried."""
        buffer = opt.state.get(param, {}).pop("momentum_buffer", None)
        state = self.dgc_state
        if buffer is None or not settings.momentum or name in state.memory.buffers:
            return 0  # no buffer, no momentum, or the exchange has its own (checkpoint, earlier fit)
        flat = bucket_order_flat(buffer.detach()).to(self.root_device, torch.float32)
        state.memory.set_momentum(
            name, momentum_from_sgd(flat, settings.momentum, settings.nesterov, state.is_dense(name))
        )
        return 1

    def _sgd_momentum(self, name: str, momentum: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The exchange's momentum of ``name`` (flat) as an SGD ``momentum_buffer`` shaped and laid out like ``like``."""
        settings = self.dgc_state.settings_for(name)
        flat = momentum_to_sgd(momentum, settings.momentum, settings.nesterov, self.dgc_state.is_dense(name))
        buffer = torch.empty_like(like, device=flat.device)
        bucket_order_flat(buffer).copy_(flat)
        return buffer

    def _check_ranks_agree(self) -> None:
        """Fail fast, on every rank, if ranks were configured differently (instead of hanging later)."""
        state = self.dgc_state
        settings = sorted(
            (n, s.momentum, s.nesterov, s.weight_decay) for n, s in state.param_settings.items()
        )
        digest = hashlib.sha256(json.dumps(settings).encode()).hexdigest()[
            :16
        ]  # hash() is salted per process
        mine = (type(self).__name__, state.config.fingerprint(), state.config.density, digest)
        everyone = comm.all_gather_object(mine)
        if any(other != mine for other in everyone):
            raise RuntimeError(
                f"{type(self).__name__} settings differ between ranks: {everyone}. Every rank must construct the"
                " strategy and optimizer with identical arguments (check per-rank config files or environment)."
            )

    # -- the step --------------------------------------------------------------------------------
    @override
    def backward(
        self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        if self._dgc_state is not None:
            scaler = getattr(self.precision_plugin, "scaler", None)
            self._dgc_state.grad_scale = (
                float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0
            )
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        def closure_then_finish() -> Any:
            result = closure()
            self._finish_step(optimizer)
            return result

        return super().optimizer_step(optimizer, closure_then_finish, model, **kwargs)

    def _finish_step(self, optimizer: Optimizer) -> None:
        if self._dgc_state is None or self._dgc_state.finish_step():
            return
        if getattr(self.precision_plugin, "scaler", None) is not None:
            return  # the GradScaler sees the non-finite gradients, skips the step and lowers its scale
        for group in getattr(optimizer, "param_groups", []):
            for p in group["params"]:
                p.grad = None
        rank_zero_warn(
            f"{type(self).__name__}: non-finite gradients at step {self._dgc_state.step - 1}; the optimizer step was"
            " skipped on every rank and the compression memory was left as it was before the step."
        )

    # -- checkpoints -------------------------------------------------------------------------------
    @property
    def algorithm(self) -> str:
        """Name stored with the exchange state in checkpoints (a checkpoint of another algorithm is refused)."""
        return self.strategy_name

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Gather every rank's memory into the checkpoint that rank 0 writes (all ranks call this).

        The checkpoint also holds the user's SGD hyper-parameters and, as SGD's ``momentum_buffer``, the
        mean over ranks of the exchange's momentum, so that plain DDP (or any strategy) resumes it with
        momentum applied once and nothing lost. Memory: every buffer is gathered tensor by tensor into
        rank 0 (``2 x world_size`` model sizes there, plus one for the SGD buffers, as DDP's own
        checkpoint holds); the other ranks send their buffers as they are, without copies.
        """
        if self._dgc_state is None:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        entry = self._gather_exchange_state()
        if entry is None:  # not rank 0: its buffers went to rank 0
            return
        checkpoint[CHECKPOINT_KEY] = entry
        if "optimizer_states" in checkpoint:
            self._write_user_optimizer_state(checkpoint["optimizer_states"], entry)
        if type(self.checkpoint_io) is TorchCheckpointIO and storage_options is None and _is_local(filepath):
            _save_atomically(checkpoint, filepath)  # Lightning's buffers the whole file in memory first
        else:
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _gather_exchange_state(self) -> dict[str, Any] | None:
        state = self.dgc_state
        names = sorted(state.memory.buffers)
        numels = [state.memory.buffers[n].momentum.numel() for n in names]
        layout = hashlib.sha256(json.dumps([names, numels]).encode()).hexdigest()
        if len(set(comm.all_gather_object(layout))) != 1:
            raise RuntimeError(
                f"{type(self).__name__}: the ranks hold memory for different parameters and cannot write one"
                " checkpoint; every rank must train the same model."
            )
        metadata = comm.gather_object(state.state_dict(memory=False))
        tensors = [getattr(state.memory.buffers[n], kind) for n in names for kind in ("momentum", "velocity")]
        gathered = comm.gather_tensors(tensors)
        if metadata is None or gathered is None:
            return None
        ranks = []
        for r, meta in enumerate(metadata):
            memory: dict[str, dict[str, torch.Tensor]] = {"momentum": {}, "velocity": {}}
            for i, name in enumerate(names):
                memory["momentum"][name] = gathered[2 * i][r]
                memory["velocity"][name] = gathered[2 * i + 1][r]
            ranks.append({**meta, "memory": memory})  # type: ignore[dict-item]
        return {
            "algorithm": self.algorithm,
            "format": CHECKPOINT_FORMAT,
            "world_size": self.world_size,
            "ranks": ranks,
        }

    def _write_user_optimizer_state(
        self, optimizer_states: list[dict[str, Any]], entry: dict[str, Any]
    ) -> None:
        """The user's hyper-parameters and the mean momentum as SGD buffers, into the checkpoint's copy."""
        params = dict(self.lightning_module.named_parameters())
        momenta = [r["memory"]["momentum"] for r in entry["ranks"]]
        for taken in self._taken_over:
            packed = optimizer_states[taken.optimizer]
            group = packed["param_groups"][taken.group]
            taken.restore(group)
            if not taken.user.momentum:
                continue
            for index, name in zip(group["params"], taken.names, strict=True):
                if name not in momenta[0]:
                    continue
                mean = torch.stack([m[name] for m in momenta]).mean(0)
                buffer = self._sgd_momentum(name, mean, params[name].detach().cpu()).to(params[name].dtype)
                # A new dict: the packed state's values are the optimizer's live per-parameter dicts.
                packed["state"][index] = {**packed["state"].get(index, {}), "momentum_buffer": buffer}

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict)
        # Lightning restores the model before setup(); the exchange state is applied once it exists.
        self._checkpoint_entry = checkpoint.get(CHECKPOINT_KEY)
        self._legacy_checkpoint = False
        if self._checkpoint_entry is None and "optimizer_states" in checkpoint:
            rank_zero_warn(
                f"The checkpoint holds no {type(self).__name__} state (it was written by another strategy):"
                " its SGD momentum buffers continue as the exchange's momentum, and the residuals start empty."
            )
        elif self._checkpoint_entry is not None and self._checkpoint_entry.get("algorithm") != self.algorithm:
            found = self._checkpoint_entry.get("algorithm")
            raise ValueError(
                f"This checkpoint holds the exchange state of {found!r}, not {self.algorithm!r}: its residuals mean"
                f" something else here. Resume with strategy={found!r}, or delete the checkpoint's"
                f" {CHECKPOINT_KEY!r} entry to start {self.algorithm!r} with empty buffers."
            )
        elif self._checkpoint_entry is not None and "format" not in self._checkpoint_entry:
            self._legacy_checkpoint = True
            rank_zero_warn(
                "This checkpoint was written by an earlier lightning-dgc, whose optimizer state holds 0 for the SGD"
                " momentum and weight decay that the exchange applied: they are taken from configure_optimizers()."
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
        if self._dgc_state is None:
            return
        state = self.dgc_state
        for taken in self._taken_over:
            if not taken.user.momentum:
                continue
            opt = self.optimizers[taken.optimizer]
            opt = getattr(opt, "_optimizer", opt)
            for param, name in zip(opt.param_groups[taken.group]["params"], taken.names, strict=True):
                if name in state.memory.buffers:
                    mean = comm.average(state.memory.buffers[name].momentum.clone())
                    opt.state[param]["momentum_buffer"] = self._sgd_momentum(name, mean, param.detach()).to(
                        param.dtype
                    )

    @override
    def teardown(self) -> None:
        """Give the optimizer its SGD hyper-parameters back (the take-over ends with ``fit``)."""
        for taken in self._taken_over:
            if taken.optimizer < len(self.optimizers):
                opt = self.optimizers[taken.optimizer]
                taken.restore(getattr(opt, "_optimizer", opt).param_groups[taken.group])
        self._taken_over = []
        super().teardown()

    def _restore_exchange_state(self) -> None:
        entry, self._checkpoint_entry = self._checkpoint_entry, None
        if entry is None:
            return
        state, redistributed = state_for_rank(entry, self.world_size, self.global_rank)
        if redistributed:
            rank_zero_warn(
                f"The checkpoint was written by {entry['world_size']} ranks and is resumed by {self.world_size}:"
                " every rank starts from the mean of the saved momentum and residual buffers, which keeps the"
                " pending update of the whole group and drops per-rank detail."
            )
        self.dgc_state.load_state_dict(state, self.root_device)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in ((cls.strategy_name, "popen"), (f"{cls.strategy_name}_spawn", "spawn")):
            if name in strategy_registry:
                continue
            strategy_registry.register(
                name,
                cls,
                description=f"{cls.__name__} with start_method '{start_method}'",
                start_method=start_method,
            )


class DEFTStrategy(DGCStrategy):
    """Data-parallel training with DEFT's partitioned gradient selection (Yoon and Oh, ICPP 2023).

    Same exchange layer, statistics, callbacks and checkpoints as :class:`DGCStrategy`, but each rank
    selects top-k only inside the layers (fragments) assigned to it: the fragments' k is shared in
    proportion to their gradient norms, they are packed onto ranks by LPT bin-packing on
    ``n_l log2 k_l`` (rotated every step), and since the ranks' selections never intersect, the
    exchanged volume stays about k whatever the number of ranks (no gradient build-up). Every rank
    derives the identical plan from all-reduced fragment norms (one small all-reduce per bucket):
    no leader, no broadcast, and nothing to disagree about.

    Momentum follows DEFT's code by default: error feedback only in the exchange, and the optimizer's
    own momentum and weight decay applied to the averaged sparse gradient (any optimizer works).
    ``momentum_correction=True`` uses DGC's momentum correction instead, with DGC's optimizer contract
    (SGD momentum taken over, other momentum optimizers rejected).

    Args:
        density: fraction of the compressed values sent per step, in (0, 1] (shared among fragments).
        momentum_correction: DGC's momentum correction instead of DEFT's plain error feedback.
        momentum: momentum correction (only with ``momentum_correction=True``).
        **kwargs: every other argument of :class:`DGCStrategy` (and so of ``DDPStrategy``).
    """

    strategy_name = "deft"
    exchange_hook = staticmethod(deft_hook)

    def __init__(
        self,
        density: float = 0.001,
        momentum_correction: bool = False,
        momentum: float = 0.0,
        **kwargs: Any,
    ) -> None:
        momentum = real_number(momentum, "momentum")
        if momentum and not momentum_correction:
            raise ValueError(
                "DEFTStrategy applies no momentum in the exchange unless `momentum_correction=True`; leave"
                " momentum to the optimizer, or pass `DEFTStrategy(momentum_correction=True, momentum=...)`."
            )
        self.momentum_correction = momentum_correction
        super().__init__(density=density, momentum=momentum, **kwargs)

    @override
    def _take_over_optimizers(self) -> None:
        if self.momentum_correction:
            super()._take_over_optimizers()
