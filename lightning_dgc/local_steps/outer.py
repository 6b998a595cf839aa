"""DiLoCo's outer step (Douillard et al., 2023, "DiLoCo: Distributed Low-Communication Training of Language
Models"), without Lightning: what :class:`~lightning_dgc.DiLoCoStrategy` runs every ``sync_every`` optimizer steps.

Every rank trains its own copy of the model (the *local* weights) with the user's optimizer (the *inner*
optimizer) and exchanges nothing in between. Every ``sync_every`` optimizer steps
(:meth:`OuterStep.after_optimizer_step`; :meth:`OuterStep.step` at the end of ``fit``):

1. **pseudo-gradient**: ``global - local``, per parameter, in fp32, flat in one buffer on the model's device;
2. **exchange**: its mean over the ranks: one all-reduce (``"dense"``), or any registered algorithm's exchange
   (:func:`lightning_dgc.exchange.hook.exchange`, the hook's own path) with its error feedback kept across outer steps in
   an :class:`~lightning_dgc.exchange.state.ExchangeState` of its own;
3. **outer step**: ``torch.optim.SGD(lr=outer_lr, momentum=outer_momentum, nesterov=outer_nesterov)`` on the
   global weights, the averaged pseudo-gradient as their gradient;
4. **local := global**; floating-point buffers (BatchNorm's statistics) are averaged too.

Streaming DiLoCo (``fragments``, ``overlap_steps``; :mod:`lightning_dgc.local_steps.rounds`) runs these steps for one fragment
of the tensors at a time, on staggered rounds, and may merge an exchange's answer some inner steps after it started.

Every rank gets the same average, so the ranks hold bit-identical weights after every outer step (with an overlap,
once ``fit`` ends). A
pseudo-gradient that is not finite on any rank skips step 3 on every rank (and the exchange's memory stays as it
was); step 4 still runs, so a round that diverged restarts from the last good global weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor

from lightning_dgc import comm
from lightning_dgc.algorithms import AlgorithmConfig
from lightning_dgc.algorithms.base import ring_allreduce_volume
from lightning_dgc.comm import Collectives, TorchCollectives
from lightning_dgc.exchange.hook import exchange
from lightning_dgc.exchange.state import ExchangeState
from lightning_dgc.local_steps.rounds import (
    STREAMING_DEFAULTS,
    InFlight,
    OuterSettings,
    first_round,
    split_fragments,
)

#: The algorithm name of the plain mean (one all-reduce of the pseudo-gradients).
DENSE = "dense"
#: Version of :meth:`OuterStep.state_dict` (1: before fragments; still read).
FORMAT = 2
#: The figures of ``compression_stats()`` that are one optimizer step's (0 inside a round): summed over the steps,
#: the run's.
STEP_KEYS = ("bytes_sent", "link_bytes", "inter_node_bytes", "payload_bytes", "selection_ms")


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
        named = [(n, p) for n, p in named_parameters if self.trains(p)]
        if not named:
            raise ValueError("DiLoCo needs a model with at least one parameter that requires a gradient.")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.buffers = [b for _, b in named_buffers if b.is_floating_point()]
        self.device = self.params[0].device
        self.collectives = collectives if collectives is not None else TorchCollectives()
        self.world_size = self.collectives.world_size
        #: The tensors (indices into :attr:`params`) of each fragment; one fragment of all of them in plain DiLoCo.
        self.fragments = split_fragments([p.numel() for p in self.params], settings.fragments)
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

    @staticmethod
    def trains(param: Tensor) -> bool:
        """Whether ``param`` (one of ``named_parameters``) takes part: those that require a gradient."""
        return param.requires_grad

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
        self.restart_rounds()

    def restart_rounds(self) -> None:
        """Every fragment starts its first round now; nothing is in flight."""
        settings = self.settings
        #: Per fragment: optimizer steps until it sends, and since it last sent (or since the start).
        self.until_send = [first_round(f, settings.fragments, settings.sync_every) for f in range(settings.fragments)]
        self.since_send = [0] * settings.fragments
        self.in_flight: list[InFlight] = []  # exchanges started and not merged yet (overlap_steps)

    @property
    def inner_steps(self) -> int:
        """The position in the round: optimizer steps since the last fragment's (in plain DiLoCo: the model's) last
        outer step."""
        return self.since_send[-1]

    def load_local(self) -> None:
        """local := global (every rank then holds the same weights)."""
        with torch.no_grad():
            for g, p in zip(self.global_params, self.params, strict=True):
                p.copy_(g, non_blocking=True)

    # -- the round -------------------------------------------------------------------------------------------
    def after_optimizer_step(self) -> bool | None:
        """Count one optimizer step; merge the exchange due now, and start (with ``overlap_steps=0``: run) the outer
        step of the fragment whose round ends. Returns the verdict of the outer step merged, or ``None``."""
        self.optimizer_steps += 1
        self.exchanged_this_step, self.step_bytes_sent, self.step_link_bytes = False, 0, 0.0
        verdict = None
        for flight in self.in_flight:
            flight.merge_in -= 1
        for flight in [f for f in self.in_flight if f.merge_in <= 0]:
            verdict = self._merge(flight)
        for f in range(self.settings.fragments):
            self.since_send[f] += 1
            self.until_send[f] -= 1
        for f in [f for f in range(self.settings.fragments) if self.until_send[f] <= 0]:
            self.until_send[f], self.since_send[f] = self.settings.sync_every, 0
            flight = self._start(self.fragments[f], self.settings.overlap_steps, f == self.settings.fragments - 1, f)
            if not flight.merge_in:
                verdict = self._merge(flight)
        return verdict

    def step(self) -> bool | None:
        """Every round now (the end of ``fit``): what is in flight is merged, then one outer step of every fragment
        that trained since it last sent replaces the local weights, so every rank holds the same (global) weights.
        Returns its verdict; ``None`` (nothing to do) when the last optimizer step ended every round."""
        verdicts = []
        for flight in list(self.in_flight):  # (sent by the last optimizer step: its answer replaces, as DiLoCo's)
            flight.replace = not self.since_send[flight.fragment]
            verdicts.append(self._merge(flight))
        members = [i for f, m in enumerate(self.fragments) if self.since_send[f] for i in m]
        self.restart_rounds()
        if members:
            flight = self._start(sorted(members), 0, True)
            flight.replace = True
            verdicts.append(self._merge(flight))
        return all(verdicts) if verdicts else None

    def settle(self) -> None:
        """Wait for every exchange in flight and take its outer SGD step (its merge stays due at its step): what a
        checkpoint saves is then complete. All ranks call it."""
        for flight in self.in_flight:
            self._receive(flight)

    def _start(self, members: list[int], merge_in: int, buffers: bool, fragment: int = -1) -> InFlight:
        """Start the outer exchange of the tensors ``members``: steps 1-2, asynchronous (:meth:`_receive` waits);
        ``buffers``: the floating-point buffers are averaged too (blocking; with the last fragment)."""
        for flight in self.in_flight if self.exchange_state is not None else ():
            self._receive(flight)  # one exchange at a time through the algorithm's memory
        flight = InFlight(members, merge_in, fragment)
        if self.leader:
            flight.flat = self.pseudo_gradient(members)
            state = self.exchange_state
            if state is None:
                flight.handle = self.collectives.all_reduce(flight.flat, "DiLoCo: the pseudo-gradients")
            else:  # the hook's path: one bucket of the fragment's parameters
                flight.handle = exchange(state, [self.params[i] for i in members], flight.flat)
        if buffers and self.buffers:
            for buffer in self.buffers:
                if self.leader:
                    self.collectives.all_reduce(buffer.data, "DiLoCo: the buffers").wait()
                    buffer.data.div_(self.world_size)
                else:
                    buffer.data.zero_()
                if self.node is not None:
                    self.node.all_reduce(buffer.data, "DiLoCo: the buffers inside the node").wait()
            if self.leader:
                flight.sent = sum(b.numel() * b.element_size() for b in self.buffers)
                flight.link = ring_allreduce_volume(flight.sent, self.world_size)
        self.in_flight.append(flight)
        return flight

    def _receive(self, flight: InFlight) -> None:
        """Step 2's end and step 3: the mean over the ranks (in a hierarchical run handed by the node's first rank to
        the others), then the outer SGD step of the fragment's global weights if it is finite on every rank."""
        if flight.done:
            return
        average: Tensor | None = None
        finite = True
        numel = sum(self.params[i].numel() for i in flight.members)
        if self.leader:
            average, finite, sent, link = self._average(flight, numel)
            flight.sent, flight.link = flight.sent + sent, flight.link + link
        if self.node is not None:
            average, finite = self._from_leader(average, finite, numel)
        assert average is not None
        flight.handle = flight.flat = None
        if finite:
            offset = 0
            for i in flight.members:
                g = self.global_params[i]
                g.grad = average[offset : offset + g.numel()].view(g.shape).to(g.device)
                offset += g.numel()
            self.outer_optimizer.step()  # (only the fragment's tensors have a gradient)
            self.outer_optimizer.zero_grad(set_to_none=True)
        flight.done, flight.finite = True, finite

    def _merge(self, flight: InFlight) -> bool:
        """Step 4: the fragment's local weights := its global ones (mixed with ``mixing`` after an overlap);
        returns the verdict."""
        self._receive(flight)
        self.in_flight.remove(flight)
        mixing = self.settings.mixing if self.settings.overlap_steps and flight.finite and not flight.replace else 0.0
        with torch.no_grad():
            for i in flight.members:
                p, g = self.params[i], self.global_params[i]
                if mixing:
                    p.copy_(torch.lerp(g.to(self.device, non_blocking=True), p.detach().float(), mixing))
                else:
                    p.copy_(g, non_blocking=True)
        if flight.finite:
            self.consecutive_skipped = 0
        else:
            self.skipped_outer_steps += 1
            self.consecutive_skipped += 1
        self.step_bytes_sent += flight.sent
        self.step_link_bytes += flight.link
        self.link_bytes_total += flight.link
        self.exchanged_this_step = True
        self.outer_steps += 1
        return flight.finite

    def _from_leader(self, average: Tensor | None, finite: bool, numel: int) -> tuple[Tensor, bool]:
        """The node's first rank's ``average`` (``None`` on the others) and verdict, on every rank of the node: one
        all-reduce inside the node to which the other ranks bring zeros (the verdict travels as one more value)."""
        assert self.node is not None
        packed = torch.zeros(numel + 1, dtype=torch.float32, device=self.device)
        if average is not None:
            packed[:-1] = average
            packed[-1] = 0.0 if finite else 1.0
        packed = self.node.all_reduce(packed, "DiLoCo: the average inside the node").wait()
        return packed[:-1], bool(packed[-1] == 0.0)

    def pseudo_gradient(self, members: list[int] | None = None) -> Tensor:
        """``global - local`` of the tensors ``members`` (default: every one), fp32, flat on the model's device."""
        members = list(range(len(self.params))) if members is None else members
        with torch.no_grad():
            return torch.cat([
                (self.global_params[i].to(self.device, non_blocking=True) - self.params[i].detach().float()).reshape(-1)
                for i in members
            ])  # fmt: skip

    def _average(self, flight: InFlight, numel: int) -> tuple[Tensor, bool, int, float]:
        """The mean over the ranks of what ``flight`` sent, whether it is finite (the same verdict on every rank), the
        bytes this rank sent and those its link carried."""
        state = self.exchange_state
        if state is None:  # a non-finite value on any rank makes the sum non-finite on every rank
            average = flight.handle.wait().div_(self.world_size)
            finite = bool(torch.isfinite(average.sum()))
            sent = 4 * numel
            link = ring_allreduce_volume(sent, self.world_size)
            self.last_exchange = {
                "bytes_sent": sent, "dense_bytes": sent, "link_bytes": link, "payload_bytes": 0,
                "dense_exchange_bytes": sent, "finite": finite,
            }  # fmt: skip
        else:  # the memory is committed only if the mean is finite everywhere
            average = flight.handle.wait().clone()
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
            sync_every=self.settings.sync_every, fragments=self.settings.fragments, link_bytes_per_step=per_step,
            ddp_link_bytes_per_step=ddp,
            compression_ratio=ddp / per_step if per_step else float("inf"),
        )  # fmt: skip
        return stats

    def state_dict(self) -> dict[str, Any]:
        """What every rank holds alike: the global weights (host copies), the outer optimizer, the position in
        every fragment's round, the exchanges waiting for their merge and the counters
        (``torch.load(weights_only=True)``-loadable). Call :meth:`settle` first, on every rank. The outer
        exchange's memory is each rank's own: :attr:`exchange_state`'s ``state_dict()``."""
        return {
            "format": FORMAT,
            "algorithm": self.algorithm,
            "settings": asdict(self.settings),
            "names": list(self.names),
            "global": {n: g.detach().cpu().clone() for n, g in zip(self.names, self.global_params, strict=True)},
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "inner_steps": self.inner_steps,
            "until_send": list(self.until_send),
            "since_send": list(self.since_send),
            "in_flight": [flight.state_dict() for flight in self.in_flight],
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
        if state.get("format") not in (1, FORMAT):
            raise ValueError(f"DiLoCo state of format {state.get('format')!r}, this version reads 1 and {FORMAT}.")
        if state["algorithm"] != self.algorithm:
            raise ValueError(
                f"the checkpoint's outer exchange is {state['algorithm']!r}, this run's {self.algorithm!r}: resume with"
                f" algorithm={state['algorithm']!r}, or load the weights into a new run without the DiLoCo state."
            )
        if list(state["names"]) != self.names:
            raise ValueError("the checkpoint's DiLoCo state is of a model with other parameters: load it into the same model.")
        saved = {key: state["settings"].get(key, default) for key, default in STREAMING_DEFAULTS.items()}
        mine = {key: getattr(self.settings, key) for key in STREAMING_DEFAULTS}
        if saved != mine:
            raise ValueError(
                f"the checkpoint was written with {saved}, this run has {mine}: resume with the same fragments,"
                " overlap_steps and mixing (the rounds in progress are those of the fragments saved)."
            )
        with torch.no_grad():
            for name, g in zip(self.names, self.global_params, strict=True):
                saved_weight = state["global"][name]
                if tuple(saved_weight.shape) != tuple(g.shape):
                    raise ValueError(f"the checkpoint's global weight {name!r} has shape {tuple(saved_weight.shape)}, the model {tuple(g.shape)}.")
                g.copy_(saved_weight)
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        for name in ("optimizer_steps", "outer_steps", "skipped_outer_steps", "consecutive_skipped"):
            setattr(self, name, int(state[name]))
        inner = int(state["inner_steps"])  # (format 1: plain DiLoCo, one fragment)
        self.until_send = [int(n) for n in state.get("until_send", [self.settings.sync_every - inner])]
        self.since_send = [int(n) for n in state.get("since_send", [inner])]
        self.in_flight = [InFlight.from_state(flight) for flight in state.get("in_flight", [])]
        self.link_bytes_total = float(state["link_bytes_total"])
        self.last_exchange = dict(state.get("last_exchange", {}))


def check_same_everywhere(outer: OuterStep, owner: str, names: list[str] | None = None) -> None:
    """Raise on every rank if the ranks were given other outer settings (instead of hanging at the first outer step);
    ``names``: the model's trained parameters, where a rank's :attr:`OuterStep.names` are those it holds values of."""
    config = outer.exchange_state.config.fingerprint(()) if outer.exchange_state is not None else None
    mine = (asdict(outer.settings), outer.algorithm, config, outer.names if names is None else names)
    everyone = comm.all_gather_object(mine)
    if any(other != mine for other in everyone):
        raise ValueError(
            f"{owner}: the ranks were configured differently ({everyone}): give every rank the same sync_every,"
            " outer_lr, outer_momentum, outer_nesterov, offload, algorithm and model."
        )
