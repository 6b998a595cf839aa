"""What both front doors offer: the Trainer's strategy (:mod:`lightning_dgc.strategy`) and Fabric's
(:mod:`lightning_dgc.fabric`) expose the exchange the same way, through :class:`ExchangeAccess`."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from typing_extensions import override

from lightning_dgc import algorithms, comm
from lightning_dgc.agreement import check_parameters_agree, check_settings_agree
from lightning_dgc.algorithms import AlgorithmConfig
from lightning_dgc.checks import check_density
from lightning_dgc.hook import exchange_hook
from lightning_dgc.state import ExchangeState, algorithm_for


class ExchangeAccess:
    """Mixin of a compression strategy (before its ``DDPStrategy`` base): the algorithm, its settings, the
    exchange's state and statistics, and the hook that DDP runs, counted.

    The strategy sets ``_config`` (the configuration it was given), ``_state`` (the :class:`ExchangeState`,
    ``None`` until the model is set up), ``hook_calls = 0`` and ``check_ranks_every`` in its ``__init__``, calls
    :meth:`_set_up_rank_checks` on every rank when it sets the model up and :meth:`_after_optimizer_step` after
    every optimizer step.
    """

    _config: AlgorithmConfig
    _state: ExchangeState | None
    hook_calls: int
    #: Compare the ranks' parameters every this many optimizer steps (0: never).
    check_ranks_every: int
    _host_group: Any = None
    _rank_checks_set_up = False
    _optimizer_steps = 0
    #: What sets the model (and so the exchange state) up, named in the error before it has run.
    set_up_by: ClassVar[str] = "the strategy's setup"

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
    def density(self) -> float | None:
        """The density in force, ``None`` for an algorithm without one (set it to change the sparsity
        during training, identically on all ranks: ``SparsityWarmup`` does)."""
        return self.config.density

    @density.setter
    def density(self, value: float) -> None:
        if self._config.density is None:
            raise AttributeError(
                f"the {self.algorithm} algorithm has no density: its configuration declares no `density` field;"
                " do not set one (e.g. drop SparsityWarmup)."
            )
        if self._state is not None:
            self._state.density = value
        else:
            self._config.density = check_density(value)

    def compression_stats(self) -> dict[str, float | int | bool]:
        """Statistics of the last optimizer step on this rank (see :meth:`ExchangeState.compression_stats`)."""
        return self._state.compression_stats() if self._state is not None else {}

    def request_buildup(self) -> None:
        """Measure the build-up factor (``compression_stats()["buildup_factor"]``) in the coming step."""
        if self._state is not None:
            self._state.request_buildup()

    def residual_norm(self) -> float | None:
        """L2 norm of what this rank's memory holds back (``None`` before the model was set up)."""
        return self._state.residual_norm() if self._state is not None else None

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        comm.destroy_process_group_at_exit()  # gloo aborts at exit if its group is still alive

    def _set_up_rank_checks(self) -> None:
        """The process group of the rank checks (on the host: they never wait for the device); every rank."""
        if not self._rank_checks_set_up:
            self._host_group = comm.host_group()
            self._rank_checks_set_up = True

    def _after_optimizer_step(self, params: Iterable[torch.Tensor]) -> None:
        """Every ``check_ranks_every`` optimizer steps: raise on every rank if their parameters differ."""
        self._optimizer_steps += 1
        every = self.check_ranks_every
        if every and self._optimizer_steps % every == 0:
            check_parameters_agree(params, type(self).__name__, self._optimizer_steps, self._host_group)

    def _hook(self) -> Callable[..., torch.futures.Future[torch.Tensor]]:
        # DDP's reducer holds the hook in C++, where the garbage collector cannot see it: a strong
        # reference to the strategy (which holds the wrapped model) would keep model, optimizer state and
        # exchange memory alive for the rest of the process, and tear them down only at interpreter exit.
        strategy = weakref.ref(self)

        def counted_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations literally
            counted = strategy()
            if counted is not None:
                counted.hook_calls += 1
                if not state.step_pending:  # the step's first bucket: the settings must agree before it is sent
                    check_settings_agree(state, type(counted).__name__, counted._host_group)
            return exchange_hook(state, bucket)

        return counted_hook
