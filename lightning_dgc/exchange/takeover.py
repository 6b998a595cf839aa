"""The optimizer take-over: SGD's momentum and weight decay applied once, by the exchange.

For algorithms that apply momentum in the exchange (DGC; DEFT with ``momentum_correction=True``), the
optimizer must not apply it a second time. :class:`OptimizerTakeOver` moves SGD's ``momentum``,
``nesterov`` and ``weight_decay`` into the exchange state (and sets them to 0 in the optimizer),
rejects optimizers that would apply momentum twice, and gives the user's values back: into
checkpoints, to the optimizer when training ends. Shared by the Trainer strategy
(:mod:`lightning_dgc.front.strategy`) and the Fabric strategy (:mod:`lightning_dgc.front.fabric`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.optim import Optimizer

from lightning_dgc import comm
from lightning_dgc.algorithms.checks import whole_number
from lightning_dgc.exchange import shards
from lightning_dgc.exchange.params import local_shard
from lightning_dgc.exchange.state import ExchangeState, ParamSettings
from lightning_dgc.tensor_ops.memory import bucket_order_flat
from lightning_dgc.tensor_ops.momentum import momentum_from_sgd, momentum_to_sgd


class _Hyperparameters(NamedTuple):
    """The user's SGD hyper-parameters of one parameter group, before the take-over set them to 0."""

    momentum: float
    nesterov: bool
    weight_decay: float


@dataclass
class _TakenOver:
    """One SGD parameter group whose momentum and weight decay the exchange applies."""

    optimizer: int  # index into the strategy's optimizers
    group: int  # index into its ``param_groups``
    user: _Hyperparameters
    names: list[str]  # the group's parameter names, in group order ("" for parameters outside the module)

    def restore(self, group: dict[str, Any]) -> None:
        """Put the user's values back into ``group`` (a live group or a checkpoint's copy)."""
        group["momentum"], group["nesterov"], group["weight_decay"] = self.user


def _unwrapped(optimizer: Any) -> Optimizer:
    """The torch optimizer inside Lightning's and Fabric's optimizer wrappers."""
    return getattr(optimizer, "_optimizer", optimizer)


class OptimizerTakeOver:
    """The SGD parameter groups whose momentum and weight decay one strategy's exchange applies.

    ``owner`` is the strategy's class name, used in messages; ``call`` is how a call of the strategy begins,
    before the setting a message's fix names (default: ``"Owner("``, for ``Owner(momentum=...)``). Both are
    strings, not functions, so that the take-over pickles with its strategy (Lightning's spawn launcher
    pickles the strategy into every process it starts).
    """

    def __init__(self, owner: str, call: str | None = None) -> None:
        self.owner = owner
        self.call = call or f"{owner}("
        self.groups: list[_TakenOver] = []

    def spell(self, name: str, value: str) -> str:
        """How the strategy is given ``name=value``, for the fix a message suggests."""
        return f"{self.call}{name}={value})"

    def __bool__(self) -> bool:
        return bool(self.groups)

    def take_over(
        self,
        state: ExchangeState,
        optimizers: Sequence[Optimizer],
        named_parameters: Iterable[tuple[str, torch.Tensor]],
        device: torch.device,
        legacy_checkpoint: bool = False,
    ) -> None:
        """Move SGD momentum and weight decay into the hook; reject optimizers that would apply momentum twice.

        Called at setup and again after Lightning restored the optimizer state from a checkpoint (which
        brings back the checkpoint's hyper-parameters). The user's values are read from the optimizer
        (or, for a checkpoint written before they were kept, from the setup-time optimizer), recorded so
        that checkpoints and the optimizer after ``fit`` hold them, and set to 0 in the optimizer. An
        SGD ``momentum_buffer`` found in the optimizer state (a DDP checkpoint, or a previous ``fit``)
        becomes the exchange's momentum for parameters that have none yet, and is removed from SGD.
        """
        cfg = state.config
        names = {id(p): n for n, p in named_parameters}
        before = {(t.optimizer, t.group): t for t in self.groups}
        self.groups = []
        taken, carried = 0, 0
        for oi, optimizer in enumerate(optimizers):
            opt = _unwrapped(optimizer)
            for gi, group in enumerate(opt.param_groups):
                momentum = float(group.get("momentum", 0.0) or 0.0)
                if isinstance(opt, torch.optim.SGD):
                    user = _Hyperparameters(
                        momentum, bool(group.get("nesterov", False)), float(group.get("weight_decay", 0.0))
                    )
                    if legacy_checkpoint and (oi, gi) in before:
                        user = before[oi, gi].user
                    self.check_sgd(state, user.momentum, group)
                    settings = ParamSettings(
                        momentum=user.momentum if user.momentum > 0 else cfg.momentum,
                        nesterov=user.nesterov or cfg.nesterov,
                        weight_decay=user.weight_decay + cfg.weight_decay,
                    )
                    group["momentum"], group["nesterov"], group["weight_decay"] = 0.0, False, 0.0
                    group_names = [names.get(id(p), "") for p in group["params"]]
                    self.groups.append(_TakenOver(oi, gi, user, group_names))
                    for p, name in zip(group["params"], group_names, strict=True):
                        if not name:
                            continue
                        state.param_settings[name] = settings
                        carried += self.carry_sgd_momentum(state, opt, p, name, settings, device)
                    taken += int(user.momentum > 0 or settings.weight_decay > 0)
                elif momentum > 0:
                    raise ValueError(
                        f"{type(opt).__name__} applies its own momentum ({momentum}), and DGC's momentum"
                        " correction would apply it a second time. Use torch.optim.SGD (DGC takes its momentum"
                        f" over), or set the optimizer's momentum to 0 and pass {self.spell('momentum', '...')}."
                    )
                elif "betas" in group and cfg.momentum > 0:
                    raise ValueError(
                        f"{type(opt).__name__} keeps its own first moment (betas={group['betas']}); with DGC's"
                        f" momentum correction (momentum={cfg.momentum}) momentum would be applied twice."
                        f" Use {self.spell('momentum', '0')} with Adam-family optimizers."
                    )
        state.clear_plans()
        if taken and not before:
            rank_zero_info(
                f"{self.owner}: took over SGD momentum/weight decay of {taken} parameter group(s);"
                " they are applied by momentum correction inside the gradient exchange."
            )
        if carried:
            rank_zero_info(
                f"{self.owner}: continued SGD's momentum buffers of {carried} parameter(s) as the"
                " exchange's momentum."
            )

    def check_sgd(self, state: ExchangeState, momentum: float, group: dict[str, Any]) -> None:
        cfg = state.config
        if momentum > 0 and cfg.momentum > 0:
            raise ValueError(
                f"Momentum would be applied twice: the SGD optimizer has momentum={momentum} and"
                f" {self.owner} has momentum={cfg.momentum}. Set only one: DGC takes the"
                " SGD momentum over by itself, so leave the strategy's `momentum` at 0."
            )
        if group.get("dampening", 0.0):
            raise ValueError("DGC's momentum correction has no dampening; create SGD with `dampening=0`.")
        if group.get("maximize", False):
            raise ValueError("SGD(maximize=True) is not supported by DGC; negate the loss instead.")

    @staticmethod
    def carry_sgd_momentum(
        state: ExchangeState,
        opt: Optimizer,
        param: torch.Tensor,
        name: str,
        settings: ParamSettings,
        device: torch.device,
    ) -> int:
        """Move SGD's ``momentum_buffer`` of ``param`` (if any) into the exchange's momentum; 1 if carried."""
        buffer = opt.state.get(param, {}).pop("momentum_buffer", None)
        if buffer is None or not settings.momentum or state.memory.has("momentum", name):
            return 0  # no buffer, no momentum, or the exchange has its own (checkpoint, earlier fit)
        flat = bucket_order_flat(local_shard(buffer.detach())).to(device, torch.float32)  # a sharded model's: its shard
        topology = state.topology
        if topology is not None:  # a two-level exchange keeps this rank's pieces only
            pieces = shards.pieces_of(name, param.shape, topology.per_node, topology.local_rank)
            if any(state.memory.has("momentum", piece) for piece, _, _ in pieces):
                return 0
            for piece, a, b in pieces:
                momentum = momentum_from_sgd(flat[a:b], settings.momentum, settings.nesterov, state.is_dense(piece))
                state.memory.buffer("momentum", piece, b - a, flat.device).copy_(momentum)
            return 1
        momentum = momentum_from_sgd(flat, settings.momentum, settings.nesterov, state.is_dense(name))
        state.memory.buffer("momentum", name, flat.numel(), flat.device).copy_(momentum)
        return 1

    def write_user_optimizer_state(
        self,
        state: ExchangeState,
        optimizer_states: Mapping[int, dict[str, Any]],
        momenta: Mapping[str, torch.Tensor],
        params: Mapping[str, torch.Tensor],
    ) -> None:
        """The user's hyper-parameters and the mean momentum as SGD buffers, into the checkpoint's copy.

        ``optimizer_states``: the packed ``state_dict()`` of each optimizer, by its index; ``momenta``: the mean
        over ranks of the exchange's momentum by parameter name, flat
        (:func:`lightning_dgc.checkpoint.exchange.mean_momentum`).
        """
        for taken in self.groups:
            packed = optimizer_states.get(taken.optimizer)
            if packed is None:
                continue
            group = packed["param_groups"][taken.group]
            taken.restore(group)
            if not taken.user.momentum:
                continue
            for index, name in zip(group["params"], taken.names, strict=True):
                if name not in momenta:
                    continue
                buffer = sgd_momentum(state, name, momenta[name], params[name].detach().cpu()).to(params[name].dtype)
                # A new dict: the packed state's values are the optimizer's live per-parameter dicts.
                packed["state"][index] = {**packed["state"].get(index, {}), "momentum_buffer": buffer}

    def needs_momentum(self) -> bool:
        """Whether a checkpoint's optimizer state gets the exchange's momentum (some group has the user's)."""
        return any(taken.user.momentum for taken in self.groups)

    def hand_back_momentum(self, state: ExchangeState, optimizers: Sequence[Optimizer]) -> None:
        """Give SGD the mean over ranks of the exchange's momentum as its ``momentum_buffer`` (all ranks call
        this), so that the optimizer object continues it if it is used again.

        In a two-level exchange every rank holds pieces of the parameters: the pieces of every rank are
        gathered (blocking, once) and put together per node first.
        """
        if state.topology is not None:
            self._hand_back_two_level_momentum(state, optimizers)
            return
        for taken in self.groups:
            if not taken.user.momentum:
                continue
            opt = _unwrapped(optimizers[taken.optimizer])
            for param, name in zip(opt.param_groups[taken.group]["params"], taken.names, strict=True):
                if state.memory.has("momentum", name):
                    mean = comm.average(state.memory.committed["momentum"][name].clone())
                    opt.state[param]["momentum_buffer"] = sgd_momentum(state, name, mean, param.detach()).to(
                        param.dtype
                    )

    def hand_back_sharded_momentum(self, state: ExchangeState, optimizers: Sequence[Optimizer]) -> None:
        """:meth:`hand_back_momentum` for a sharded model (:meth:`sharded_momentum_buffers`; every rank calls it)."""
        for (oi, name), buffer in self.sharded_momentum_buffers(state, optimizers).items():
            opt = _unwrapped(optimizers[oi])
            param = next(p for g in opt.param_groups for p in g["params"] if id(p) in state.param_names
                         and state.param_names[id(p)] == name)  # fmt: skip
            opt.state[param]["momentum_buffer"] = buffer

    def sharded_momentum_buffers(
        self, state: ExchangeState, optimizers: Sequence[Optimizer]
    ) -> dict[tuple[int, str], torch.Tensor]:
        """A sharded model's SGD ``momentum_buffer`` of every parameter whose momentum the exchange took over, by
        ``(optimizer index, parameter name)``: each shard's momentum averaged over its replicas across the nodes
        (zeros before the first step), as a ``DTensor`` laid out as its parameter (every rank calls it: an
        all-reduce per parameter across the nodes)."""
        from torch.distributed.tensor import DTensor

        out = {}
        for taken in self.groups:
            if not taken.user.momentum:
                continue
            opt = _unwrapped(optimizers[taken.optimizer])
            for param, name in zip(opt.param_groups[taken.group]["params"], taken.names, strict=True):
                if not name:
                    continue
                local = local_shard(param.detach())
                held = state.memory.committed.get("momentum", {}).get(name)
                mine = held.clone() if held is not None else torch.zeros(local.numel(), device=local.device)
                summed = state.collectives.unwrapped.all_reduce(mine, "all-reduce of the momentum across the nodes").wait()
                buffer = sgd_momentum(state, name, summed / state.world_size, local).to(param.dtype)
                out[taken.optimizer, name] = DTensor.from_local(
                    buffer, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                    stride=param.stride(),
                )  # fmt: skip
        return out

    def _hand_back_two_level_momentum(self, state: ExchangeState, optimizers: Sequence[Optimizer]) -> None:
        mine = {n: t.detach().cpu() for n, t in state.memory.committed.get("momentum", {}).items()}
        everyone = comm.all_gather_object({"memory": {"momentum": mine}})
        numels = state.parameter_numels()
        momenta = momenta_by_unit(everyone, state.topology_signature, numels)  # type: ignore[arg-type]
        for taken in self.groups:
            if not taken.user.momentum:
                continue
            opt = _unwrapped(optimizers[taken.optimizer])
            for param, name in zip(opt.param_groups[taken.group]["params"], taken.names, strict=True):
                if name in momenta[0]:
                    mean = torch.stack([m[name] for m in momenta]).mean(0).to(param.device)
                    opt.state[param]["momentum_buffer"] = sgd_momentum(state, name, mean, param.detach()).to(
                        param.dtype
                    )

    def restore(self, optimizers: Sequence[Optimizer]) -> None:
        """Give the optimizers their SGD hyper-parameters back and end the take-over."""
        for taken in self.groups:
            if taken.optimizer < len(optimizers):
                taken.restore(_unwrapped(optimizers[taken.optimizer]).param_groups[taken.group])
        self.groups = []


def sgd_momentum(
    state: ExchangeState, name: str, momentum: torch.Tensor, like: torch.Tensor
) -> torch.Tensor:
    """The exchange's momentum of ``name`` (flat) as an SGD ``momentum_buffer`` shaped and laid out like ``like``."""
    settings = state.settings_for(name)
    flat = momentum_to_sgd(momentum, settings.momentum, settings.nesterov, state.is_dense(name))
    buffer = torch.empty_like(like, device=flat.device)
    bucket_order_flat(buffer).copy_(flat)
    return buffer


def momenta_by_unit(
    ranks: list[dict[str, Any]], topology: dict[str, Any] | None, numels: Mapping[str, int]
) -> list[dict[str, torch.Tensor]]:
    """The saved momentum of every rank (flat) or every node (two-level: its ranks' pieces put together),
    by whole parameter name. ``numels``: every parameter's number of values."""
    if not topology or not topology["hierarchical"]:
        return [r["memory"].get("momentum", {}) for r in ranks]
    g = int(topology["per_node"])
    return [
        shards.assemble([{"momentum": r["memory"].get("momentum", {})} for r in ranks[n * g : (n + 1) * g]],
                        numels).get("momentum", {})
        for n in range(int(topology["nodes"]))
    ]  # fmt: skip


def check_ranks_agree(state: ExchangeState, owner: str, max_consecutive_skips: int = 0) -> None:
    """Fail fast, on every rank, if ranks were configured differently (instead of hanging later)."""
    settings = sorted((n, s.momentum, s.nesterov, s.weight_decay) for n, s in state.param_settings.items())
    digest = hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]  # hash() is salted per process
    mine = (owner, state.algorithm.name, state.config.fingerprint(), state.density, digest, max_consecutive_skips)
    everyone = comm.all_gather_object(mine)
    if any(other != mine for other in everyone):
        raise RuntimeError(
            f"{owner} settings differ between ranks: {everyone}. Every rank must construct the"
            " strategy and optimizer with identical arguments (check per-rank config files or environment)."
        )


#: Consecutive optimizer steps skipped for non-finite gradients after which training stops with an error.
DEFAULT_MAX_CONSECUTIVE_SKIPS = 25


def check_max_consecutive_skips(value: int | None) -> int:
    """The stall detector's limit, validated: a whole number >= 0 (``None`` or 0: no detector)."""
    if value is not None and whole_number(value, "max_consecutive_skips") < 0:
        raise ValueError(f"`max_consecutive_skips` must be >= 0 (0 or None: no stall detector), got {value}.")
    return int(value or 0)


def skip_non_finite_step(
    state: ExchangeState, optimizer: Any, owner: str, max_consecutive_skips: int, scaler: bool
) -> None:
    """After a step whose exchanged gradients were not finite (on any rank): make the optimizer step a no-op.

    Under a GradScaler nothing is done: the scaler sees the non-finite gradients, skips the step and lowers
    its scale (mixed precision backing off, not a stall). Otherwise the gradients are dropped and, after
    ``max_consecutive_skips`` such steps in a row (0: never), training stops with an error: the count is
    identical on every rank (the verdict is), so every rank raises at the same step.
    """
    if scaler:
        return
    for group in getattr(optimizer, "param_groups", []):
        for p in group["params"]:
            p.grad = None
    rank_zero_warn(
        f"{owner}: non-finite gradients at step {state.step - 1}; the optimizer step was"
        " skipped on every rank and the compression memory was left as it was before the step."
    )
    skipped = state.consecutive_skipped_steps
    if max_consecutive_skips and skipped >= max_consecutive_skips:
        raise RuntimeError(
            f"{owner}: the last {skipped} optimizer steps (up to step {state.step - 1}) were all"
            " skipped because the gradients exchanged were not finite (inf/NaN on at least one rank), so the"
            " model has stopped training. Check the loss for inf/NaN (data, learning rate; gradient"
            " clipping), or raise `max_consecutive_skips` (None turns this check off)."
        )
