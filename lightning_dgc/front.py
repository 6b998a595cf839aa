"""What both front doors offer: the Trainer's strategy (:mod:`lightning_dgc.strategy`) and Fabric's
(:mod:`lightning_dgc.fabric`) take the algorithm's settings the same way (:func:`config_from_arguments`)
and expose the exchange the same way, through :class:`ExchangeAccess`."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from typing_extensions import override

from lightning_dgc import algorithms, comm
from lightning_dgc.algorithms import AlgorithmConfig
from lightning_dgc.checks import check_density
from lightning_dgc.hook import exchange_hook
from lightning_dgc.state import ExchangeState, algorithm_for


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


class ExchangeAccess:
    """Mixin of a compression strategy (before its ``DDPStrategy`` base): the algorithm, its settings, the
    exchange's state and statistics, and the hook that DDP runs, counted.

    The strategy sets ``_config`` (the configuration it was given), ``_state`` (the :class:`ExchangeState`,
    ``None`` until the model is set up) and ``hook_calls = 0`` in its ``__init__``.
    """

    _config: AlgorithmConfig
    _state: ExchangeState | None
    hook_calls: int
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

    def _hook(self) -> Callable[..., torch.futures.Future[torch.Tensor]]:
        # DDP's reducer holds the hook in C++, where the garbage collector cannot see it: a strong
        # reference to the strategy (which holds the wrapped model) would keep model, optimizer state and
        # exchange memory alive for the rest of the process, and tear them down only at interpreter exit.
        strategy = weakref.ref(self)

        def counted_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations literally
            counted = strategy()
            if counted is not None:
                counted.hook_calls += 1
            return exchange_hook(state, bucket)

        return counted_hook
