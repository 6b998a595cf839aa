"""Lightning glue: one strategy keeps Lightning's DDP wrapper and swaps the gradient exchange.

:class:`CompressionStrategy` runs any registered algorithm (:mod:`lightning_dgc.algorithms`); every
algorithm is registered with Lightning under its name (``Trainer(strategy="dgc")``, ``"deft"``,
``"powersgd"``, plus ``"<name>_spawn"``). :class:`DGCStrategy` and :class:`DEFTStrategy` are thin
names with DGC's and DEFT's arguments spelled out (Lightning's CLI builds its schema from them).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple

import lightning.pytorch as pl
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_dgc import algorithms, comm
from lightning_dgc.algorithms import AlgorithmConfig
from lightning_dgc.algorithms.deft import DEFTConfig
from lightning_dgc.algorithms.dgc import DGCConfig, Selection, SelectionBackend, ValueDType
from lightning_dgc.checks import check_density
from lightning_dgc.hook import exchange_hook
from lightning_dgc.memory import bucket_order_flat, momentum_from_sgd, momentum_to_sgd
from lightning_dgc.state import ExchangeState, ParamSettings, sparse_gradient_message, state_for_rank

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


class CompressionStrategy(DDPStrategy):
    """Data-parallel training with a compressed gradient exchange (any registered algorithm).

    Subclasses Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` and keeps the DDP
    wrapper (overlap with backward, ``no_sync`` under gradient accumulation, unused parameters,
    buffer sync, the distributed sampler), but replaces DDP's dense all-reduce with the algorithm's
    exchange through one communication hook that is registered on every device type, CPU included
    (stock Lightning registers hooks on CUDA only and silently drops them elsewhere).

    Optimizer contract (momentum must not be applied twice), for algorithms that apply momentum in the
    exchange (DGC; DEFT with ``momentum_correction=True``):

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
            (``CompressionStrategy("powersgd", {"matrix_approximation_rank": 2})``).
        **kwargs: every argument of ``DDPStrategy`` (``find_unused_parameters``, ``static_graph``,
            ``process_group_backend``, ``timeout``, ``start_method``, ...).
    """

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
        if isinstance(algorithm, AlgorithmConfig):
            if options:
                raise ValueError("pass either a configuration object or `options`, not both")
            self._config = algorithm
        else:
            self._config = algorithms.get(algorithm).config_class(**(options or {}))
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
        self._state: ExchangeState | None = None
        self._checkpoint_entry: dict[str, Any] | None = None  # restored in setup(), once the state exists
        self._taken_over: list[_TakenOver] = []  # SGD groups whose momentum the exchange applies
        self._legacy_checkpoint = (
            False  # resuming a checkpoint whose optimizer state holds the take-over's zeros
        )
        self.hook_calls = 0  # incremented by the registered hook: proof that it runs
        self._finite: bool | None = None  # the verdict of a step finished at the end of backward()

    # -- public API ------------------------------------------------------------------------------
    @property
    def algorithm(self) -> str:
        """The algorithm's registered name (stored with the exchange state in checkpoints)."""
        return self.algorithm_class.name

    @property
    def algorithm_class(self) -> type[algorithms.Algorithm[Any, Any, Any]]:
        from lightning_dgc.state import algorithm_for

        return algorithm_for(self._config)

    @property
    def config(self) -> AlgorithmConfig:
        """The algorithm's settings in force (``density`` may change during training)."""
        return self._state.config if self._state is not None else self._config

    @property
    def exchange_state(self) -> ExchangeState:
        if self._state is None:
            raise RuntimeError(
                f"{type(self).__name__} has no exchange state before `trainer.fit` has set up the model."
            )
        return self._state

    @property
    def density(self) -> float | None:
        """The density in force, ``None`` for an algorithm without one (set it to change the sparsity
        during training, identically on all ranks: ``SparsityWarmup`` does)."""
        return getattr(self.config, "density", None)

    @density.setter
    def density(self, value: float) -> None:
        if not hasattr(self._config, "density"):
            raise AttributeError(f"the {self.algorithm} algorithm has no density")
        if self._state is not None:
            self._state.density = value
        else:
            self._config.density = check_density(value)  # type: ignore[attr-defined]

    def compression_stats(self) -> dict[str, float | int | bool]:
        """Statistics of the last optimizer step on this rank (see :meth:`ExchangeState.compression_stats`)."""
        return self._state.compression_stats() if self._state is not None else {}

    def request_buildup(self) -> None:
        """Measure the build-up factor (``compression_stats()["buildup_factor"]``) in the coming step."""
        if self._state is not None:
            self._state.request_buildup()

    def residual_norm(self) -> float | None:
        """L2 norm of what this rank's memory holds back (``None`` before ``fit`` set the exchange up)."""
        return self._state.residual_norm() if self._state is not None else None

    # -- setup -----------------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        comm.destroy_process_group_at_exit()  # gloo aborts at exit if its group is still alive

    def _hook(self) -> Callable[..., torch.futures.Future[torch.Tensor]]:
        strategy = self

        def counted_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations literally
            strategy.hook_calls += 1
            return exchange_hook(state, bucket)

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
        state = self._state
        if state is None or list(state.param_names.values()) != [n for n, _ in named]:
            state = self._state = ExchangeState(self._config)  # else a second fit: the memory carries on
        state.register_parameters(named)
        state.finish_writes_grads = True  # the averaged gradients are written after the memory's commit
        self.model.register_comm_hook(state, self._hook())
        log.debug("%s: registered the %s hook on %s", type(self).__name__, self.algorithm, self.root_device)

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
        """Move SGD momentum and weight decay into the hook; reject optimizers that would apply momentum twice.

        Called at setup and again after Lightning restored the optimizer state from a checkpoint (which
        brings back the checkpoint's hyper-parameters). The user's values are read from the optimizer
        (or, for a checkpoint written before they were kept, from the setup-time optimizer), recorded so
        that checkpoints and the optimizer after ``fit`` hold them, and set to 0 in the optimizer. An
        SGD ``momentum_buffer`` found in the optimizer state (a DDP checkpoint, or a previous ``fit``)
        becomes the exchange's momentum for parameters that have none yet, and is removed from SGD.
        """
        state = self.exchange_state
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
        state.clear_plans()
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
        cfg = self.exchange_state.config
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
        state = self.exchange_state
        if buffer is None or not settings.momentum or state.memory.has("momentum", name):
            return 0  # no buffer, no momentum, or the exchange has its own (checkpoint, earlier fit)
        flat = bucket_order_flat(buffer.detach()).to(self.root_device, torch.float32)
        momentum = momentum_from_sgd(flat, settings.momentum, settings.nesterov, state.is_dense(name))
        state.memory.buffer("momentum", name, flat.numel(), flat.device).copy_(momentum)
        return 1

    def _sgd_momentum(self, name: str, momentum: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The exchange's momentum of ``name`` (flat) as an SGD ``momentum_buffer`` shaped and laid out like ``like``."""
        settings = self.exchange_state.settings_for(name)
        flat = momentum_to_sgd(
            momentum, settings.momentum, settings.nesterov, self.exchange_state.is_dense(name)
        )
        buffer = torch.empty_like(like, device=flat.device)
        bucket_order_flat(buffer).copy_(flat)
        return buffer

    def _check_ranks_agree(self) -> None:
        """Fail fast, on every rank, if ranks were configured differently (instead of hanging later)."""
        state = self.exchange_state
        settings = sorted(
            (n, s.momentum, s.nesterov, s.weight_decay) for n, s in state.param_settings.items()
        )
        digest = hashlib.sha256(json.dumps(settings).encode()).hexdigest()[
            :16
        ]  # hash() is salted per process
        mine = (type(self).__name__, state.algorithm.name, state.config.fingerprint(), state.density, digest)
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
        """Lightning's backward, with the exchange's step finished right after the backward pass itself.

        So the parameters' ``.grad`` hold the averaged update (and the memory is committed, or left as it
        was) before ``on_after_backward`` and anything after it reads them, as under DDP.
        """
        if self._state is not None:
            scaler = getattr(self.precision_plugin, "scaler", None)
            self._state.grad_scale = (
                float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0
            )
        self.pre_backward(closure_loss)
        assert self.lightning_module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self.precision_plugin.backward(closure_loss, self.lightning_module, optimizer, *args, **kwargs)
        if self._state is not None and self._state.step_pending:  # the hook ran in this backward pass
            self._finite = self._state.finish_step()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

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
        finite, self._finite = self._finite, None
        if self._state is None:
            return
        if finite is None:  # no backward pass ran the hook since the last step (or it was finished there)
            finite = self._state.finish_step()
        if finite:
            return
        if getattr(self.precision_plugin, "scaler", None) is not None:
            return  # the GradScaler sees the non-finite gradients, skips the step and lowers its scale
        for group in getattr(optimizer, "param_groups", []):
            for p in group["params"]:
                p.grad = None
        rank_zero_warn(
            f"{type(self).__name__}: non-finite gradients at step {self._state.step - 1}; the optimizer step was"
            " skipped on every rank and the compression memory was left as it was before the step."
        )

    # -- checkpoints -------------------------------------------------------------------------------
    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Gather every rank's memory into the checkpoint that rank 0 writes (all ranks call this).

        The checkpoint also holds the user's SGD hyper-parameters and, as SGD's ``momentum_buffer``, the
        mean over ranks of the exchange's momentum, so that plain DDP (or any strategy) resumes it with
        momentum applied once and nothing lost. Memory: every buffer is gathered tensor by tensor into
        rank 0 (``2 x world_size`` model sizes there, plus one for the SGD buffers, as DDP's own
        checkpoint holds); rank 0's own buffers are not copied on the CPU; the other ranks send their
        buffers as they are, without copies.
        """
        if self._state is None:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        synchronous = (
            type(self.checkpoint_io) is TorchCheckpointIO and storage_options is None and _is_local(filepath)
        )
        entry = self._gather_exchange_state(copy_own=not synchronous)
        if entry is None:  # not rank 0: its buffers went to rank 0
            return
        checkpoint[CHECKPOINT_KEY] = entry
        if "optimizer_states" in checkpoint:
            self._write_user_optimizer_state(checkpoint["optimizer_states"], entry)
        if synchronous:
            _save_atomically(checkpoint, filepath)  # Lightning's buffers the whole file in memory first
        else:
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _gather_exchange_state(self, copy_own: bool = True) -> dict[str, Any] | None:
        state = self.exchange_state
        committed = state.memory.committed
        keys = sorted((kind, name) for kind, by_name in committed.items() for name in by_name)
        layout = [(kind, name, list(committed[kind][name].shape)) for kind, name in keys]
        digest = hashlib.sha256(json.dumps(layout).encode()).hexdigest()
        if len(set(comm.all_gather_object(digest))) != 1:
            raise RuntimeError(
                f"{type(self).__name__}: the ranks hold memory for different parameters and cannot write one"
                " checkpoint; every rank must train the same model."
            )
        metadata = comm.gather_object(state.state_dict(memory=False))
        gathered = comm.gather_tensors([committed[kind][name] for kind, name in keys], copy_own=copy_own)
        if metadata is None or gathered is None:
            return None
        ranks = []
        for r, meta in enumerate(metadata):
            memory: dict[str, dict[str, torch.Tensor]] = {kind: {} for kind in committed}
            for (kind, name), copies in zip(keys, gathered, strict=True):
                memory[kind][name] = copies[r]
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
        momenta = [r["memory"].get("momentum", {}) for r in entry["ranks"]]
        for taken in self._taken_over:
            packed = optimizer_states[taken.optimizer]
            group = packed["param_groups"][taken.group]
            taken.restore(group)
            if not taken.user.momentum:
                continue
            for index, name in zip(group["params"], taken.names, strict=True):
                if name not in momenta[0]:
                    continue
                mean = momenta[0][name].clone()  # summed rank by rank: one buffer, not world_size
                for m in momenta[1:]:
                    mean.add_(m[name])
                mean.div_(len(momenta))
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
        if self._state is None:
            return
        state = self.exchange_state
        for taken in self._taken_over:
            if not taken.user.momentum:
                continue
            opt = self.optimizers[taken.optimizer]
            opt = getattr(opt, "_optimizer", opt)
            for param, name in zip(opt.param_groups[taken.group]["params"], taken.names, strict=True):
                if state.memory.has("momentum", name):
                    mean = comm.average(state.memory.committed["momentum"][name].clone())
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
        self.exchange_state.load_state_dict(state, self.root_device)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register every algorithm under its name (and ``<name>_spawn``): DGC and DEFT as their thin
        classes, every other one as this class with ``algorithm=<name>``."""
        thin: dict[str, type[CompressionStrategy]] = {"dgc": DGCStrategy, "deft": DEFTStrategy}
        for name in algorithms.registered():
            strategy = thin.get(name, CompressionStrategy)
            fixed = {} if name in thin else {"algorithm": name}
            for registered, start_method in ((name, "popen"), (f"{name}_spawn", "spawn")):
                if registered not in strategy_registry:
                    strategy_registry.register(
                        registered, strategy, description=f"{strategy.__name__} ({name}), start_method"
                        f" '{start_method}'", start_method=start_method, **fixed,
                    )  # fmt: skip


class DGCStrategy(CompressionStrategy):
    """Data-parallel training with Deep Gradient Compression (Lin et al., ICLR 2018).

    ``CompressionStrategy(DGCConfig(...))`` with DGC's settings as arguments (each one is described
    in :class:`~lightning_dgc.algorithms.dgc.DGCConfig`), plus every ``DDPStrategy`` argument.
    """

    def __init__(
        self,
        density: float = DGCConfig.density,
        sample_ratio: float = DGCConfig.sample_ratio,
        selection: Selection = DGCConfig.selection,
        selection_backend: SelectionBackend = DGCConfig.selection_backend,
        min_compress_numel: int = DGCConfig.min_compress_numel,
        momentum: float = DGCConfig.momentum,
        nesterov: bool = DGCConfig.nesterov,
        momentum_masking: bool = DGCConfig.momentum_masking,
        local_clip_norm: float | None = DGCConfig.local_clip_norm,
        value_dtype: ValueDType = DGCConfig.value_dtype,
        seed: int = DGCConfig.seed,
        **kwargs: Any,
    ) -> None:
        options = {
            "density": density, "sample_ratio": sample_ratio, "selection": selection,
            "selection_backend": selection_backend,
            "min_compress_numel": min_compress_numel, "momentum": momentum, "nesterov": nesterov,
            "momentum_masking": momentum_masking, "local_clip_norm": local_clip_norm, "value_dtype": value_dtype,
            "seed": seed,
        }  # fmt: skip
        super().__init__(self.config_class(**options, **self._more_options()), **kwargs)

    #: The configuration the arguments fill.
    config_class: ClassVar[type[DGCConfig]] = DGCConfig

    def _more_options(self) -> dict[str, Any]:
        """Arguments a subclass adds to DGC's."""
        return {}


class DEFTStrategy(DGCStrategy):
    """Data-parallel training with DEFT's partitioned gradient selection (Yoon and Oh, ICPP 2023).

    ``CompressionStrategy(DEFTConfig(...))``: DGC's arguments plus ``momentum_correction`` and the
    switches of the method's parts (each described in :class:`~lightning_dgc.algorithms.deft.DEFTConfig`),
    plus every ``DDPStrategy`` argument. By default momentum follows DEFT's code: error feedback only in the exchange, and the
    optimizer's own momentum and weight decay applied to the averaged update (any optimizer works).
    """

    config_class = DEFTConfig

    def __init__(
        self,
        density: float = DEFTConfig.density,
        momentum_correction: bool = DEFTConfig.momentum_correction,
        k_allocation: Literal["norm", "size"] = DEFTConfig.k_allocation,
        fragmenting: bool = DEFTConfig.fragmenting,
        rotation: bool = DEFTConfig.rotation,
        union_values: Literal["all", "owner"] = DEFTConfig.union_values,
        selectors: Literal["owner", "all"] = DEFTConfig.selectors,
        budget: Literal["k", "dgc_link"] = DEFTConfig.budget,
        **kwargs: Any,
    ) -> None:
        self._deft_options = {
            "momentum_correction": momentum_correction, "k_allocation": k_allocation, "fragmenting": fragmenting,
            "rotation": rotation, "union_values": union_values, "selectors": selectors, "budget": budget,
        }  # fmt: skip
        super().__init__(density=density, **kwargs)

    def _more_options(self) -> dict[str, Any]:
        return dict(self._deft_options)


# Importing this module first imports Lightning, whose import hook (``lightning_dgc/__init__.py``)
# then finds this module half-made and leaves the names to be registered here.
CompressionStrategy.register_strategies(StrategyRegistry)
