"""What every front door shares: the Trainer's strategies (:mod:`lightning_dgc.front.strategy`,
:mod:`lightning_dgc.local_steps.strategy`) and Fabric's (:mod:`lightning_dgc.front.fabric`, :mod:`lightning_dgc.local_steps.fabric`) take
the algorithm's settings the same way (:func:`config_from_arguments`), tear their process group down at exit
(:class:`ProcessGroupAtExit`), and refuse an optimizer before its model (:func:`check_model_first`); the Trainer's
keep rank files beside their checkpoints (:class:`RankFileCheckpoints`); the compression front doors expose the
exchange the same way, through :class:`ExchangeAccess`."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from typing_extensions import override

from lightning_dgc import algorithms, comm
from lightning_dgc.algorithms import AlgorithmConfig, checks
from lightning_dgc.algorithms.base import algorithm_for
from lightning_dgc.checkpoint.exchange import remove_rank_files
from lightning_dgc.checkpoint.files import read_checkpoint
from lightning_dgc.checkpoint.rank_files import FileIO
from lightning_dgc.exchange import agreement
from lightning_dgc.exchange.hook import exchange_hook
from lightning_dgc.exchange.passthrough import enter_passthrough
from lightning_dgc.exchange.state import ExchangeState
from lightning_dgc.exchange.takeover import check_max_consecutive_skips, skip_non_finite_step
from lightning_dgc.front.carry import GradientCarry
from lightning_dgc.schedules.auto_density import AutoDensity


def config_from_arguments(
    owner: str,
    algorithm: str | AlgorithmConfig,
    options: dict[str, Any] | None,
    kwargs: dict[str, Any],
    base: type,
) -> AlgorithmConfig:
    """A front door's algorithm configuration, from its arguments; ``kwargs`` keeps DDP's arguments only.

    The algorithm's settings may come as keyword arguments (``density=0.01``), as ``options``
    (``{"density": 0.01}``) or in a configuration object (``DGCConfig(density=0.01)``; keyword arguments
    replace its fields), through the Trainer's strategy and Fabric's alike. The arguments of
    ``DistributedDataParallel`` and of the ``DDPStrategy`` ``base`` stay in ``kwargs`` (a name both take
    goes to DDP); any other name is an error that lists the settings and suggests the closest name.
    """
    ddp = _ddp_arguments(base)
    if isinstance(algorithm, AlgorithmConfig):
        config_class: type[AlgorithmConfig] = type(algorithm)
    else:
        config_class = algorithms.get(algorithm).config_class
    fields = [field.name for field in dataclasses.fields(config_class) if field.init]
    given = {name: kwargs.pop(name) for name in list(kwargs) if name in fields and name not in ddp}
    unknown = [name for name in kwargs if name not in ddp]
    if unknown:
        raise TypeError(_unknown_argument_message(owner, unknown[0], algorithm, config_class.__name__, fields, ddp))
    twice = sorted(set(given) & set(options or {}))
    if twice:
        raise ValueError(
            f"{owner}: {', '.join(f'`{name}`' for name in twice)} given both as a keyword argument and in"
            " `options`: give each setting once."
        )
    if isinstance(algorithm, AlgorithmConfig) and given:
        algorithm = dataclasses.replace(algorithm, **given)  # validated again
        given = {}
    return algorithms.config_of(algorithm, {**(options or {}), **given} if options or given else None)


def _unknown_argument_message(
    owner: str, name: str, algorithm: str | AlgorithmConfig, config_name: str, fields: list[str], ddp: set[str]
) -> str:
    """What a front door says of a keyword argument that is neither a configuration field nor DDP's."""
    close = difflib.get_close_matches(name, [*fields, *sorted(ddp)], n=1)
    message = f"{owner} got an unknown argument `{name}`" + (f" (did you mean `{close[0]}`?)" if close else "")
    message += (
        f": it is neither a setting of {config_name} ({', '.join(fields) or 'none'}) nor an argument of"
        " DistributedDataParallel."
    )
    example = close[0] if close and close[0] in fields else (fields[0] if fields else None)
    if example is not None:
        first = f"{algorithm!r}, " if isinstance(algorithm, str) else "..., "
        message += f" Pass the algorithm's settings as keyword arguments: {owner}({first}{example}=...)."
    return message


def _ddp_arguments(base: type) -> set[str]:
    """The keyword arguments a ``DDPStrategy`` ``base`` takes: its own and ``DistributedDataParallel``'s."""
    from torch.nn.parallel import DistributedDataParallel

    names = {*inspect.signature(DistributedDataParallel.__init__).parameters}
    names |= {*inspect.signature(base.__init__).parameters}
    return names - {"self", "module", "kwargs"}


def sparse_gradient_parameters(module: torch.nn.Module) -> list[str]:
    """Names of the trainable parameters of ``module`` whose gradients will be sparse tensors."""
    return [
        f"{prefix}.{name}" if prefix else name
        for prefix, m in module.named_modules()
        if getattr(m, "sparse", False) is True
        for name, p in m.named_parameters(recurse=False)
        if p.requires_grad
    ]


class ProcessGroupAtExit:
    """Mixin of a front door (before its ``DDPStrategy`` base): the process group is destroyed at exit (gloo
    aborts at exit if its group is still alive)."""

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        comm.destroy_process_group_at_exit()


class RankFileCheckpoints:
    """Mixin of a Trainer front door whose checkpoints have a folder of rank files beside them (before its
    ``DDPStrategy`` base): removing a checkpoint removes the folder (``ModelCheckpoint``'s rotation,
    ``last.ckpt``); a truncated file is an error that names it and the fix (:func:`read_checkpoint`); the path
    read is kept in ``_checkpoint_path``, for ``setup()`` to read the rank files beside it."""

    _checkpoint_path: Any = None

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)  # type: ignore[misc]
        if self.is_global_zero:  # type: ignore[attr-defined]
            remove_rank_files(filepath, FileIO(self.checkpoint_io))  # type: ignore[attr-defined]

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        load = super().load_checkpoint  # type: ignore[misc]
        self._checkpoint_path = checkpoint_path
        return read_checkpoint(lambda: load(checkpoint_path, *args, **kwargs), checkpoint_path)


def node_topology(strategy: Any, option: Any, owner: str) -> comm.Topology | None:
    """The process groups inside and across the nodes for ``hierarchical=option``, or ``None`` for a flat run; every
    rank calls it (``strategy``: a ``DDPStrategy`` of the Trainer or Fabric, its process group up)."""
    agreement.check_same_on_every_rank("hierarchical", option, owner)
    if not comm.resolve_hierarchical(option, strategy.num_nodes, strategy.world_size):
        return None
    ranks = comm.all_gather_object((strategy.global_rank, strategy.node_rank, strategy.local_rank))
    per_node = comm.check_node_layout(ranks, strategy.num_nodes)
    return comm.two_level_topology(strategy.num_nodes, per_node, strategy.global_rank)


def check_model_first(owner: str, module: Any) -> None:
    """Fabric's front doors: the error for an optimizer set up before its model (``module`` is ``None``)."""
    if module is None:
        raise RuntimeError(
            f"{owner} must know the model before its optimizer: call `fabric.setup(model, optimizer)`, or"
            " `fabric.setup_module(model)` before `fabric.setup_optimizers(optimizer)`."
        )


class ExchangeAccess(ProcessGroupAtExit):
    """Mixin of a compression strategy (before its ``DDPStrategy`` base): the algorithm, its settings, the
    exchange's state and statistics, and the hook that DDP runs, counted.

    The strategy calls :meth:`_take_arguments` first in its ``__init__`` (it sets ``_config``, ``_state``, which
    stays ``None`` until the model is set up, ``hook_calls``, ``check_ranks_every``, ``max_consecutive_skips`` and
    ``_carry``), :meth:`_set_up_rank_checks` on every rank when it sets the model up and
    :meth:`_after_optimizer_step` after every optimizer step.
    """

    _config: AlgorithmConfig
    _state: ExchangeState | None
    hook_calls: int
    #: Compare the ranks' parameters every this many optimizer steps (0: never).
    check_ranks_every: int
    _host_group: Any = None
    _rank_checks_set_up = False
    _optimizer_steps = 0
    _auto: AutoDensity | None = None
    #: What sets the model (and so the exchange state) up, named in the error before it has run.
    set_up_by: ClassVar[str] = "the strategy's setup"

    def _take_arguments(
        self,
        algorithm: str | AlgorithmConfig,
        options: dict[str, Any] | None,
        kwargs: dict[str, Any],
        base: type,
        save_exchange_state: bool,
        max_consecutive_skips: int | None,
        check_ranks_every: int | None,
    ) -> None:
        """The opening of a front door's ``__init__``, before its base's: every argument is checked, so that a bad
        value fails at construction, on the launching process; ``kwargs`` keeps the ``base``'s and DDP's."""
        #: Write every rank's exchange memory beside each checkpoint (``False``: model and optimizer only).
        self.save_exchange_state = bool(save_exchange_state)
        #: Raise after this many consecutive steps skipped for non-finite gradients (0: never).
        self.max_consecutive_skips = check_max_consecutive_skips(max_consecutive_skips)
        self.check_ranks_every = agreement.check_ranks_every_value(check_ranks_every)
        ddp = "Fabric's `DDPStrategy`" if base.__module__.startswith("lightning.fabric") else "`DDPStrategy`"
        checks.drop_foreign_hook_arguments(kwargs, type(self).__name__, ddp)
        self._config = config_from_arguments(type(self).__name__, algorithm, options, kwargs, base)
        self._state = None
        self.hook_calls = 0  # incremented by the registered hook: proof that it runs
        self._carry = GradientCarry()  # one momentum per optimizer step, however many backward passes

    @property
    def algorithm(self) -> str:
        """The algorithm's registered name (stored with the exchange state in checkpoints)."""
        return self.algorithm_class.name

    @property
    def algorithm_class(self) -> type[algorithms.Algorithm[Any, Any, Any]]:
        return algorithm_for(self._config)

    @property
    def config(self) -> AlgorithmConfig:
        """The algorithm's settings in force (``density`` may change during training)."""
        return self._state.config if self._state is not None else self._config

    @property
    def exchange_state(self) -> ExchangeState:
        if self._state is None:
            raise RuntimeError(
                f"{type(self).__name__} has no exchange state before {self.set_up_by} has set up the model."
            )
        return self._state

    @property
    def density(self) -> float | str | None:
        """The density in force, ``None`` for an algorithm without one (set it to change the sparsity
        during training, identically on all ranks: ``SparsityWarmup`` does). With ``density="auto"``: ``"auto"``
        until the model is set up, then the density in force; a density set is then a floor (the density in
        force is the larger of it and the link's, see :mod:`lightning_dgc.schedules.auto_density`)."""
        return self.config.density

    @density.setter
    def density(self, value: float) -> None:
        if self._config.density is None:
            raise AttributeError(
                f"the {self.algorithm} algorithm has no density: its configuration declares no `density` field;"
                " do not set one (e.g. drop SparsityWarmup)."
            )
        auto = self.auto_density
        if auto is not None:
            auto.set_floor(value, self._state)
        elif self._state is not None:
            self._state.density = value
        else:
            self._config.density = checks.check_density(value)

    @property
    def auto_density(self) -> AutoDensity | None:
        """The automatic density (``density="auto"``: :class:`~lightning_dgc.schedules.auto_density.AutoDensity`), else ``None``."""
        if self._auto is None and getattr(self._config, "density", None) == "auto":
            self._auto = AutoDensity(self._config, type(self).__name__)
        return self._auto

    def _attach_auto_density(self, state: ExchangeState) -> None:
        """With ``density="auto"``: time ``state``'s collectives and start measuring (every rank, at setup)."""
        auto = self.auto_density
        if auto is not None:
            auto.attach(state)

    def compression_stats(self) -> dict[str, float | int | bool]:
        """Statistics of the last optimizer step on this rank (see :meth:`ExchangeState.compression_stats`); with
        ``density="auto"`` also ``auto_density`` (the link's density; the one in force is ``density``),
        ``auto_measuring``, ``predicted_exchange_ms``, ``measured_exchange_ms``, ``compute_window_ms``,
        ``link_mbit_s``, ``link_latency_ms``, ``dense_step_ms`` and ``checked_step_ms`` (:meth:`AutoDensity.stats`).
        ``ddp_step``: whether the next step is DDP's own (:mod:`lightning_dgc.exchange.passthrough`)."""
        stats = self._state.compression_stats() if self._state is not None else {}
        if stats:  # (none before the first step)
            stats = {**stats, "ddp_step": self._state.passthrough, **(self._auto.stats() if self._auto else {})}  # type: ignore[union-attr]
        return stats

    def request_buildup(self) -> None:
        """Measure the build-up factor (``compression_stats()["buildup_factor"]``) in the coming step."""
        if self._state is not None:
            self._state.request_buildup()

    def residual_norm(self) -> float | None:
        """L2 norm of what this rank's memory holds back (``None`` before the model was set up)."""
        return self._state.residual_norm() if self._state is not None else None

    # -- the step: what both front doors run around a backward pass and an optimizer step -------------------
    #: Set by :meth:`_take_arguments`.
    _carry: GradientCarry
    max_consecutive_skips: int

    def _grad_scaler(self, enabled: bool = True) -> Any:
        """The precision's GradScaler (mixed precision; ``enabled``: only while it scales), or ``None``."""
        precision = getattr(self, "precision_plugin", None) or getattr(self, "precision", None)  # Trainer, Fabric
        scaler = getattr(precision, "scaler", None)
        return scaler if scaler is not None and (scaler.is_enabled() or not enabled) else None

    def _backward_pass(self, run: Callable[[], Any]) -> Any:
        """Run one backward pass (``run()``), then finish the exchange's step if the pass ran the hook, so that
        the parameters' ``.grad`` hold the averaged update (and the memory is committed, or left as it was)
        before anything after the backward pass reads them, as under DDP (at density 1: DDP's own step, if it can)."""
        state = self._state
        if state is None:
            return run()
        scaler = self._grad_scaler()
        state.grad_scale = float(scaler.get_scale()) if scaler is not None else 1.0
        if state.density == 1.0 and not state.passthrough:
            enter_passthrough(state)
        self._carry.before_backward(state, type(self).__name__)
        result = run()
        finite = None
        if state.step_pending:  # the hook ran in this backward pass
            finite = state.finish_step()
            if self._auto is not None:
                self._auto.exchange_done()
            self._after_exchange()
        self._carry.after_backward(state, finite)
        return result

    def _after_exchange(self) -> None:
        """What a front door does right after a backward pass's exchange was finished (nothing here)."""

    def _close_step(self, optimizer: Any) -> None:
        """Before ``optimizer`` steps: finish an exchange still open, and make the step a no-op on every rank if
        the gradients it would apply were not finite (:func:`~lightning_dgc.exchange.takeover.skip_non_finite_step`)."""
        state = self._state
        if state is None:
            return
        if state.step_pending:  # the hook ran outside the strategy's backward()
            self._carry.after_backward(state, state.finish_step())
        finite = self._carry.finite
        self._carry.stepped(state, optimizer)
        if not finite:
            skip_non_finite_step(
                state, optimizer, type(self).__name__, self.max_consecutive_skips,
                scaler=self._grad_scaler(enabled=False) is not None,
            )  # fmt: skip

    def _refuse_sparse_gradients(self, module: torch.nn.Module) -> None:
        """The error, at setup, for a model with parameters whose gradients are sparse tensors."""
        sparse = sparse_gradient_parameters(module)
        if sparse:
            raise ValueError(f"{type(self).__name__}: {checks.sparse_gradient_message(sparse)}")

    def _set_up_rank_checks(self) -> None:
        """The process group of the rank checks (on the host: they never wait for the device); every rank."""
        if not self._rank_checks_set_up:
            self._host_group = comm.host_group()
            self._rank_checks_set_up = True

    def _after_optimizer_step(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Early in the run and then every ``check_ranks_every`` optimizer steps (:func:`rank_check_due`): raise on
        every rank if their parameters differ, naming them."""
        self._optimizer_steps += 1
        if self._auto is not None and self._state is not None:
            self._auto.step_done(self._state, self._host_group)
        if agreement.rank_check_due(self._optimizer_steps, self.check_ranks_every):
            agreement.check_parameters_agree(named_params, type(self).__name__, self._optimizer_steps, self._host_group)

    def _hook(self) -> Callable[..., torch.futures.Future[torch.Tensor]]:
        # DDP's reducer holds the hook in C++, where the garbage collector cannot see it: a strong
        # reference to the strategy (which holds the wrapped model) would keep model, optimizer state and
        # exchange memory alive for the rest of the process, and tear them down only at interpreter exit.
        strategy = weakref.ref(self)

        def counted_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations literally
            counted = strategy()
            if counted is None:
                return exchange_hook(state, bucket)
            return counted._run_exchange(state, lambda: exchange_hook(state, bucket))

        return counted_hook

    def _run_exchange(self, state: ExchangeState, run: Callable[[], Any]) -> Any:
        """``run()`` (one bucket's or FSDP group's exchange), counted, after the check that every rank has the same
        settings (before a step's first one), timed for ``density="auto"``."""
        self.hook_calls += 1
        probe = None
        auto = self._auto  # below: DDP's step chosen by the link is 1 whatever a rank's floor sets
        if not state.step_pending and not (state.passthrough and auto is not None and not auto.measuring):
            start = time.perf_counter()
            agreement.check_settings_agree(state, type(self).__name__, self._host_group)
            probe = time.perf_counter() - start
        if auto is not None:
            auto.hooked(probe)
        result = run()
        if auto is not None:
            auto.hook_done()
        return result
