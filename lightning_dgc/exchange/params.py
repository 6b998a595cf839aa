"""The parameters an exchange state knows, by name (:class:`RegisteredParameters`, a part of
:class:`~lightning_dgc.exchange.state.ExchangeState`): its memory is keyed by parameter name, never by bucket (DDP
rebuilds its buckets after the first step), and a sharded parameter (FSDP2's ``DTensor``) is held as its local
shard."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_dgc.algorithms import ParamSettings
from lightning_dgc.algorithms.topk_plan import small_every
from lightning_dgc.exchange import shards
from lightning_dgc.tensor_ops.memory import bucket_order_flat

__all__ = ["RegisteredParameters", "local_shard"]


def local_shard(param: Tensor) -> Tensor:
    """``param`` as this rank holds it: a ``DTensor``'s local shard (FSDP2 shards parameters as such), else itself."""
    to_local = getattr(param, "to_local", None)
    return to_local() if to_local is not None else param


class RegisteredParameters:
    """The parameters by name (:meth:`register_parameters`), their shards, and what the exchange applies to each.

    Set by :class:`~lightning_dgc.exchange.state.ExchangeState`: ``param_names`` (``id`` to name), ``_params`` (name to
    parameter), ``param_settings`` (name to the optimizer settings taken over), ``continuing`` and ``config``.
    """

    param_names: dict[int, str]
    _params: dict[str, Tensor]
    param_settings: dict[str, ParamSettings]
    continuing: frozenset[str]
    config: Any
    clear_plans: Any  # the state's: a new registration makes new plans

    def register_parameters(self, named_parameters: Any) -> None:
        """Remember parameter names (state is keyed by name; DDP re-buckets after step 1)."""
        named = list(named_parameters)
        self.param_names = {id(p): name for name, p in named}
        self._params = dict(named)
        self.clear_plans()

    def name_of(self, param: Tensor) -> str:
        name = self.param_names.get(id(param))
        if name is None:  # not registered: a stable positional fallback would break after re-bucketing
            raise RuntimeError(
                "ExchangeState received a parameter it does not know. Call `state.register_parameters("
                "model.named_parameters())` before training (the strategies do this for you)."
            )
        return name

    def param(self, name: str) -> Tensor:
        """The parameter ``name`` as this rank holds it: a sharded parameter's (FSDP2's ``DTensor``) local shard;
        for a piece ``"<param>[a:b]"`` of a two-level shard, its values ``a:b`` (bucket order) shaped as the piece."""
        piece = shards.parse_piece(name) if name not in self._params else None
        if piece is None:
            return local_shard(self._params[name])
        parent, a, b = piece
        param = self._params[parent]
        return bucket_order_flat(param)[a:b].view(shards.piece_shape(param.shape, a, b))

    def registered(self, name: str) -> Tensor:
        """The parameter object registered as ``name`` (a sharded one whole, as the optimizer holds it: its
        ``.grad`` is the one the optimizer reads)."""
        return self._params[name]

    def _parent(self, name: str) -> str:
        piece = shards.parse_piece(name) if name not in self._params else None
        return piece[0] if piece is not None else name

    def param_unused(self, name: str) -> bool:
        """Whether parameter ``name`` (or the parameter of a two-level piece) has no gradient this step."""
        return self._params[self._parent(name)].grad is None

    def _unused_in_step(self, name: str) -> bool:
        return self._parent(name) in self._params and self.param_unused(name)

    def continues(self, name: str) -> bool:
        """Whether parameter ``name`` (or the parameter of a piece) is in another backward pass of an optimizer
        step whose momentum an earlier pass applied (:attr:`continuing`; see
        :func:`lightning_dgc.tensor_ops.momentum.continuation_factors`)."""
        return bool(self.continuing) and self._parent(name) in self.continuing

    def is_dense(self, name: str) -> bool:
        """Whether parameter ``name`` is always averaged dense (DGC and DEFT: 1-D or small, unless DGC's
        ``small_every`` sends them from a residual of their own, as the compressed ones)."""
        param = self.param(name)
        averaged_dense = getattr(self.config, "averaged_dense", None)
        if averaged_dense is None:
            return True
        return averaged_dense(param.numel(), param.dim()) and small_every(self.config) == 1

    def settings_for(self, name: str) -> ParamSettings:
        cfg = self.config
        default = ParamSettings(
            getattr(cfg, "momentum", 0.0), getattr(cfg, "nesterov", False), getattr(cfg, "weight_decay", 0.0)
        )
        return self.param_settings.get(self._parent(name), default)

    def parameter_numels(self) -> dict[str, int]:
        """Every registered parameter's number of values on this rank (a sharded one's: its local shard's), by name."""
        return {name: local_shard(p).numel() for name, p in self._params.items()}

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every registered parameter's shape on this rank (a sharded one's: its local shard's), by name."""
        return {name: tuple(local_shard(p).shape) for name, p in self._params.items()}
