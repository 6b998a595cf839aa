"""DiLoCo's outer step (Douillard et al., 2023, "DiLoCo: Distributed Low-Communication Training of Language
Models"), without Lightning: what :class:`~lightning_dgc.DiLoCoStrategy` runs every ``sync_every`` optimizer steps.

Every rank trains its own copy of the model (the *local* weights) with the user's optimizer (the *inner*
optimizer) and exchanges nothing in between. Every ``sync_every`` optimizer steps, :meth:`OuterStep.step`:

1. **pseudo-gradient**: ``global - local``, per parameter, in fp32, flat in one buffer on the model's device;
2. **exchange**: its mean over the ranks: one all-reduce (``"dense"``), or any registered algorithm's exchange
   (:func:`lightning_dgc.hook.exchange`, the hook's own path) with its error feedback kept across outer steps in
   an :class:`~lightning_dgc.state.ExchangeState` of its own;
3. **outer step**: ``torch.optim.SGD(lr=outer_lr, momentum=outer_momentum, nesterov=outer_nesterov)`` on the
   global weights, the averaged pseudo-gradient as their gradient;
4. **local := global**; floating-point buffers (BatchNorm's statistics) are averaged too.

Every rank gets the same average, so the ranks hold bit-identical weights after every outer step. A
pseudo-gradient that is not finite on any rank skips step 3 on every rank (and the exchange's memory stays as it
was); step 4 still runs, so a round that diverged restarts from the last good global weights.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_dgc import comm
from lightning_dgc.algorithms import AlgorithmConfig
from lightning_dgc.algorithms.base import ring_allreduce_volume
from lightning_dgc.checks import flag, real_number, whole_number
from lightning_dgc.comm import Collectives, TorchCollectives
from lightning_dgc.hook import exchange
from lightning_dgc.state import ExchangeState

#: The algorithm name of the plain mean (one all-reduce of the pseudo-gradients).
DENSE = "dense"
#: Version of :meth:`OuterStep.state_dict`.
FORMAT = 1
#: The figures of ``compression_stats()`` that are one optimizer step's (0 inside a round): summed over the steps,
#: the run's.
STEP_KEYS = ("bytes_sent", "link_bytes", "inter_node_bytes", "payload_bytes", "selection_ms")


@dataclass
class OuterSettings:
    """DiLoCo's outer loop, validated on construction (a ``ValueError`` names the argument and the fix).

    Args:
        sync_every: optimizer steps of every rank between two outer steps (DiLoCo's ``H``; the paper uses 500).
        outer_lr: the outer SGD's learning rate (the paper: 0.7).
        outer_momentum: the outer SGD's momentum (the paper: 0.9).
        outer_nesterov: Nesterov momentum, with torch's SGD semantics (the paper: ``True``).
        offload: keep the global weights and the outer momentum in host memory (two model sizes in fp32 off the
            device), copied over at every outer step.
    """

    sync_every: int
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    offload: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int | float):
            raise ValueError(
                f"`sync_every` is the number of optimizer steps between outer steps and must be a whole number >= 1,"
                f" got {self.sync_every!r}: pass e.g. sync_every=500 (DiLoCo's H)."
            )
        self.sync_every = whole_number(self.sync_every, "sync_every")
        if self.sync_every < 1:
            raise ValueError(
                f"`sync_every` must be >= 1 (optimizer steps between outer steps), got {self.sync_every}: pass e.g."
                " sync_every=500 (DiLoCo's H); sync_every=1 exchanges after every step."
            )
        self.outer_lr = real_number(self.outer_lr, "outer_lr")
        if not (math.isfinite(self.outer_lr) and self.outer_lr > 0.0):
            raise ValueError(f"`outer_lr` must be a finite number > 0, got {self.outer_lr!r}: DiLoCo uses 0.7.")
        self.outer_momentum = real_number(self.outer_momentum, "outer_momentum")
        if not (math.isfinite(self.outer_momentum) and 0.0 <= self.outer_momentum < 1.0):
            raise ValueError(
                f"`outer_momentum` must be a finite number in [0, 1), got {self.outer_momentum!r}: DiLoCo uses 0.9."
            )
        self.outer_nesterov = flag(self.outer_nesterov, "outer_nesterov")
        if self.outer_nesterov and self.outer_momentum == 0.0:
            raise ValueError("`outer_nesterov=True` needs an `outer_momentum` > 0: pass outer_nesterov=False.")
        self.offload = flag(self.offload, "offload")


class OuterStep:
    """One run's global weights, outer optimizer, outer exchange and position in the round (see the module).

    Args:
        settings: the outer loop.
        config: the algorithm that exchanges the pseudo-gradients, ``None`` for the plain mean (``"dense"``).
        named_parameters: the model's (local) parameters; those that do not require a gradient are left out.
        named_buffers: the model's buffers; the floating-point ones are averaged at every outer step.
        collectives: the ranks' collectives (default: the process group's; :func:`lightning_dgc.comm.simulate`
            passes simulated ones). In a hierarchical run, those of the ranks across the nodes that share this
            rank's local rank (:attr:`lightning_dgc.comm.Topology.across`).
        node: in a hierarchical run, the collectives of this rank's node (:attr:`lightning_dgc.comm.Topology.node`).
            DDP averages the gradients inside the node at every inner step, so a node's ranks hold the same local
            weights: only the node's first rank exchanges the pseudo-gradient (and the buffers) across the nodes,
            and hands the average to the others with one all-reduce inside the node; every rank then takes the
            same outer step. ``None``: every rank is a node of its own.
    """

    def __init__(
        self,
        settings: OuterSettings,
        config: AlgorithmConfig | None,
        named_parameters: Iterable[tuple[str, Tensor]],
        named_buffers: Iterable[tuple[str, Tensor]] = (),
        collectives: Collectives | None = None,
        node: Collectives | None = None,
    ) -> None:
        self.settings = settings
        self.node = node
        #: Whether this rank exchanges across the nodes (the first of its node; every rank in a flat run).
        self.leader = node is None or node.rank == 0
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        if not named:
            raise ValueError("DiLoCo needs a model with at least one parameter that requires a gradient.")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.buffers = [b for _, b in named_buffers if b.is_floating_point()]
        self.device = self.params[0].device
        self.collectives = collectives if collectives is not None else TorchCollectives()
        self.world_size = self.collectives.world_size
        store = torch.device("cpu") if settings.offload else self.device
        pin = settings.offload and self.device.type == "cuda"
        #: The global weights, fp32 (on the host with ``offload``); their ``.grad`` is the averaged pseudo-gradient.
        self.global_params = [
            torch.empty(p.shape, dtype=torch.float32, device=store, pin_memory=pin) for p in self.params
        ]
        self.reset_global()
        self.outer_optimizer = torch.optim.SGD(
            self.global_params, lr=settings.outer_lr, momentum=settings.outer_momentum,
            nesterov=settings.outer_nesterov,
        )  # fmt: skip
        #: The outer exchange's state (``None``: the plain mean): its memory is keyed by parameter name.
        self.exchange_state: ExchangeState | None = None
        if config is not None:
            self.exchange_state = ExchangeState(config, collectives=self.collectives)
            self.exchange_state.register_parameters(named)
        self.inner_steps = 0  # optimizer steps since the last outer step (the position in the round)
        self.optimizer_steps = 0  # optimizer steps counted by this object (restored from checkpoints)
        self.outer_steps = 0
        self.skipped_outer_steps = 0
        self.consecutive_skipped = 0
        self.link_bytes_total = 0.0  # what this rank's link carried in every outer exchange so far
        self.last_exchange: dict[str, Any] = {}
        # what this optimizer step sent (0 inside a round; the outer exchange and the buffers at its end)
        self.exchanged_this_step = False
        self.step_bytes_sent = 0
        self.step_link_bytes = 0.0

    @property
    def algorithm(self) -> str:
        return self.exchange_state.algorithm.name if self.exchange_state is not None else DENSE

    @property
    def dense_bytes(self) -> int:
        """Bytes of one dense fp32 copy of the trained parameters: what DDP all-reduces per optimizer step."""
        return 4 * sum(p.numel() for p in self.params)

    def reset_global(self) -> None:
        """global := local (a new round from the model's weights: at setup, after a plain checkpoint's load)."""
        with torch.no_grad():
            for g, p in zip(self.global_params, self.params, strict=True):
                g.copy_(p.detach())
        self.inner_steps = 0

    def load_local(self) -> None:
        """local := global (every rank then holds the same weights)."""
        with torch.no_grad():
            for g, p in zip(self.global_params, self.params, strict=True):
                p.copy_(g, non_blocking=True)

    # -- the round -------------------------------------------------------------------------------------------
    def after_optimizer_step(self) -> bool | None:
        """Count one optimizer step; at the end of a round run the outer step. Returns its finiteness, or ``None``
        when no outer step ran."""
        self.optimizer_steps += 1
        self.inner_steps += 1
        self.exchanged_this_step, self.step_bytes_sent, self.step_link_bytes = False, 0, 0.0
        return self.step() if self.inner_steps >= self.settings.sync_every else None

    def step(self) -> bool:
        """The outer step (steps 1-4 of the module docstring), on every rank at once. Returns whether the averaged
        pseudo-gradient was finite (``False``: the outer optimizer did not step, on any rank)."""
        # Steps 1-2: the pseudo-gradient, global - local, fp32, flat on the model's device, and its mean over the
        # ranks; in a hierarchical run the first rank of each node does both, and hands the mean to its node.
        average: Tensor | None = None
        finite, sent, link = True, 0, 0.0
        if self.leader:
            average, finite, sent, link = self._average(self.pseudo_gradient())
        if self.node is not None:
            average, finite = self._from_leader(average, finite)
        assert average is not None
        # Step 3: the outer SGD step on the global weights.
        if finite:
            offset = 0
            for g in self.global_params:
                g.grad = average[offset : offset + g.numel()].view(g.shape).to(g.device)
                offset += g.numel()
            self.outer_optimizer.step()
            self.outer_optimizer.zero_grad(set_to_none=True)
            self.consecutive_skipped = 0
        else:
            self.skipped_outer_steps += 1
            self.consecutive_skipped += 1
        # Step 4: local := global; the buffers averaged.
        self.load_local()
        for buffer in self.buffers:
            if self.leader:
                self.collectives.all_reduce(buffer.data, "DiLoCo: the buffers").wait()
                buffer.data.div_(self.world_size)
            else:
                buffer.data.zero_()
            if self.node is not None:
                self.node.all_reduce(buffer.data, "DiLoCo: the buffers inside the node").wait()
        buffer_bytes = sum(b.numel() * b.element_size() for b in self.buffers) if self.leader else 0
        self.step_bytes_sent = sent + buffer_bytes
        self.step_link_bytes = link + ring_allreduce_volume(buffer_bytes, self.world_size)
        self.link_bytes_total += self.step_link_bytes
        self.exchanged_this_step = True
        self.inner_steps = 0
        self.outer_steps += 1
        return finite

    def _from_leader(self, average: Tensor | None, finite: bool) -> tuple[Tensor, bool]:
        """The node's first rank's ``average`` (``None`` on the others) and verdict, on every rank of the node: one
        all-reduce inside the node to which the other ranks bring zeros (the verdict travels as one more value)."""
        assert self.node is not None
        packed = torch.zeros(self.dense_bytes // 4 + 1, dtype=torch.float32, device=self.device)
        if average is not None:
            packed[:-1] = average
            packed[-1] = 0.0 if finite else 1.0
        packed = self.node.all_reduce(packed, "DiLoCo: the average inside the node").wait()
        return packed[:-1], bool(packed[-1] == 0.0)

    def pseudo_gradient(self) -> Tensor:
        """``global - local`` of every parameter, fp32, flat on the model's device."""
        with torch.no_grad():
            return torch.cat([
                (g.to(self.device, non_blocking=True) - p.detach().float()).reshape(-1)
                for g, p in zip(self.global_params, self.params, strict=True)
            ])  # fmt: skip

    def _average(self, flat: Tensor) -> tuple[Tensor, bool, int, float]:
        """The mean of ``flat`` over the ranks, whether it is finite (the same verdict on every rank), the bytes
        this rank sent and those its link carried."""
        state = self.exchange_state
        if state is None:  # a non-finite value on any rank makes the sum non-finite on every rank
            average = self.collectives.all_reduce(flat, "DiLoCo: the pseudo-gradients").wait().div_(self.world_size)
            finite = bool(torch.isfinite(average.sum()))
            sent = self.dense_bytes
            link = ring_allreduce_volume(sent, self.world_size)
            self.last_exchange = {
                "bytes_sent": sent, "dense_bytes": sent, "link_bytes": link, "payload_bytes": 0,
                "dense_exchange_bytes": sent, "finite": finite,
            }  # fmt: skip
        else:  # the hook's path: one bucket of every parameter, the memory committed only if finite everywhere
            average = exchange(state, self.params, flat).wait().clone()
            finite = state.finish_step(check_unused=False)
            self.last_exchange = state.compression_stats()
            sent = int(self.last_exchange.get("bytes_sent", 0))
            link = float(self.last_exchange.get("link_bytes", 0.0))
        return average, finite, sent, link

    # -- statistics and checkpoints ----------------------------------------------------------------------------
    def compression_stats(self) -> dict[str, Any]:
        """This optimizer step's bytes, the last outer exchange's figures and the run's averages (empty before the
        first optimizer step).

        ``bytes_sent``, ``link_bytes``, ``inter_node_bytes`` and ``selection_ms`` are this optimizer step's, as the
        gradient strategies report theirs: 0 inside a round, the outer exchange's (and the buffers' all-reduce) on
        the step that ends one, so that their sum over the steps is the run's. ``outer_bytes_sent``,
        ``outer_link_bytes`` (and the algorithm's own figures) are the last outer exchange's, and
        ``exchange_compression_ratio`` its ``dense_bytes / outer_bytes_sent``. ``dense_bytes`` is what DDP
        all-reduces per optimizer step; ``link_bytes_per_step`` is the link bytes of every outer exchange so far
        divided by the optimizer steps, ``ddp_link_bytes_per_step`` what DDP's ring all-reduce of the fp32
        gradients carries per optimizer step, and ``compression_ratio`` their quotient: what the run saves on the
        wire against DDP.
        """
        if not self.optimizer_steps:
            return {}
        exchange: dict[str, Any] = {"bytes_sent": 0, "link_bytes": 0.0, **self.last_exchange}
        stats = dict(exchange)
        for key in STEP_KEYS:  # the last exchange's under outer_*; this step's under the plain name
            if key in exchange:
                stats[f"outer_{key}"] = exchange[key]
                stats[key] = exchange[key] if self.exchanged_this_step else 0
        stats.update(bytes_sent=self.step_bytes_sent, link_bytes=self.step_link_bytes, dense_bytes=self.dense_bytes)
        sent = stats["outer_bytes_sent"]
        stats["exchange_compression_ratio"] = self.dense_bytes / sent if sent else float("inf")
        per_step = self.link_bytes_total / self.optimizer_steps
        ddp = ring_allreduce_volume(self.dense_bytes, self.world_size)
        stats.update(
            algorithm=self.algorithm, step=self.optimizer_steps, outer_steps=self.outer_steps,
            skipped_outer_steps=self.skipped_outer_steps, position_in_round=self.inner_steps,
            sync_every=self.settings.sync_every, link_bytes_per_step=per_step, ddp_link_bytes_per_step=ddp,
            compression_ratio=ddp / per_step if per_step else float("inf"),
        )  # fmt: skip
        return stats

    def state_dict(self) -> dict[str, Any]:
        """What every rank holds alike: the global weights (host copies), the outer optimizer, the position in
        the round and the counters (``torch.load(weights_only=True)``-loadable). The outer exchange's memory is
        each rank's own: :attr:`exchange_state`'s ``state_dict()``."""
        return {
            "format": FORMAT,
            "algorithm": self.algorithm,
            "settings": asdict(self.settings),
            "names": list(self.names),
            "global": {n: g.detach().cpu().clone() for n, g in zip(self.names, self.global_params, strict=True)},
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "inner_steps": self.inner_steps,
            "optimizer_steps": self.optimizer_steps,
            "outer_steps": self.outer_steps,
            "skipped_outer_steps": self.skipped_outer_steps,
            "consecutive_skipped": self.consecutive_skipped,
            "link_bytes_total": self.link_bytes_total,
            "last_exchange": {k: v for k, v in self.last_exchange.items() if isinstance(v, int | float | bool | str)},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the global weights, outer optimizer, position and counters); the local
        weights are the caller's. A ``ValueError`` names what does not fit this run."""
        if state.get("format") != FORMAT:
            raise ValueError(f"DiLoCo state of format {state.get('format')!r}, this version reads {FORMAT}.")
        if state["algorithm"] != self.algorithm:
            raise ValueError(
                f"the checkpoint's outer exchange is {state['algorithm']!r}, this run's {self.algorithm!r}: resume with"
                f" algorithm={state['algorithm']!r}, or load the weights into a new run without the DiLoCo state."
            )
        if list(state["names"]) != self.names:
            raise ValueError("the checkpoint's DiLoCo state is of a model with other parameters: load it into the same model.")
        with torch.no_grad():
            for name, g in zip(self.names, self.global_params, strict=True):
                saved = state["global"][name]
                if tuple(saved.shape) != tuple(g.shape):
                    raise ValueError(f"the checkpoint's global weight {name!r} has shape {tuple(saved.shape)}, the model {tuple(g.shape)}.")
                g.copy_(saved)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        for name in ("inner_steps", "optimizer_steps", "outer_steps", "skipped_outer_steps", "consecutive_skipped"):
            setattr(self, name, int(state[name]))
        self.link_bytes_total = float(state["link_bytes_total"])
        self.last_exchange = dict(state.get("last_exchange", {}))


def check_same_everywhere(outer: OuterStep, owner: str) -> None:
    """Raise on every rank if the ranks were given other outer settings (instead of hanging at the first outer step)."""
    config = outer.exchange_state.config.fingerprint(()) if outer.exchange_state is not None else None
    mine = (asdict(outer.settings), outer.algorithm, config, outer.names)
    everyone = comm.all_gather_object(mine)
    if any(other != mine for other in everyone):
        raise ValueError(
            f"{owner}: the ranks were configured differently ({everyone}): give every rank the same sync_every,"
            " outer_lr, outer_momentum, outer_nesterov, offload, algorithm and model."
        )
