"""``density="auto"``: the density picked from the link the run measures, for DGC and DEFT.

A measuring phase of :data:`MEASURE_STEPS` optimizer steps runs the exchange dense (density 1: one all-reduce
of every bucket, as DDP's, with nothing selected and nothing held back) and times what it issues:

* the **link**: each step's collectives (the bucket all-reduces), the bytes they carry on each worker's link
  (ring volumes) against the time some collective was in flight (the union of their intervals, from issue to
  completion), less their latency steps, give the throughput; the all-gather of 16 bytes that checks the
  ranks' settings before every step gives the latency;
* the **compute window**: from the end of the previous optimizer step to the last bucket's hook (the data,
  the forward and the backward pass; the optimizer step of the step before).

Every rank gathers every rank's figures once (one all-gather of 56 bytes per rank,
:func:`~lightning_dgc.schedules.link_measure.link_from_ranks`): the quickest settings check is the latency, the
highest throughput and the shortest window are taken (the rank that waited least for the others measured the link
best; the shortest window is the conservative one). :func:`choose_density` (pure) then prices every candidate
density with the algorithm's own :meth:`~lightning_dgc.algorithms.Algorithm.wire_cost` on a
:class:`~lightning_dgc.perfmodel.Network` of that throughput and latency, every density below 1 with the settings
check too (DDP's own step skips it; where density 1 is DDP's own step, it is priced as DDP's fp32 all-reduce, whatever
the values' dtype), and keeps the largest density whose exchange takes at most :data:`AUTO_MARGIN` of the window,
never below ``min_density``: 1 (dense, DDP's own step: :mod:`lightning_dgc.exchange.passthrough`) when every rank
is on one host (:func:`~lightning_dgc.comm.host_key`), when DDP's all-reduce fits, when no density is faster than
it (a latency-bound link), or when the link is too fast to time. The same figures on every rank give the same density on
every rank. The model prices bytes and latency only, not the selection or the memory's work: a compressed choice is
then checked, its next :data:`MEASURE_STEPS` steps (after the first) timed end to end against the dense steps
measured (the slowest rank's median each, one all-gather of 8 bytes), and the exchange goes back to dense if they
were no faster. The phase comes back every ``auto_every`` optimizer steps (0: never), since links change.

Under the two-level exchange (``state.topology``) the same steps measure and price the exchange across nodes
alone, the only one the density changes (:mod:`lightning_dgc.schedules.auto_levels`).

A density set from outside (``strategy.density = d``, :class:`~lightning_dgc.schedules.warmup.SparsityWarmup`) is a
floor: the density in force is ``max(floor, the link's)``, 1 while measuring.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from lightning_dgc import comm
from lightning_dgc.algorithms import Algorithm, AlgorithmConfig, TensorSpec
from lightning_dgc.algorithms.checks import check_density
from lightning_dgc.comm import TimedCollectives
from lightning_dgc.exchange.passthrough import can_pass_through
from lightning_dgc.perfmodel.network import Network
from lightning_dgc.schedules.auto_levels import check_nodes_on_hosts, priced_buckets
from lightning_dgc.schedules.link_measure import (
    ExchangeRecorder,
    LinkEstimate,
    StepSample,
    link_from_ranks,
    summarize,
)

__all__ = [
    "AUTO_MARGIN", "MEASURE_STEPS", "AutoDensity", "Choice", "candidate_densities", "choose_density", "exchange_time",
]  # fmt: skip

#: The share of the compute window the chosen exchange may take: without any overlap it adds at most a
#: quarter to the step's compute.
AUTO_MARGIN = 0.25
#: Optimizer steps of a measuring phase (the run's first step, DDP's warm-up bucket, is not counted).
MEASURE_STEPS = 5

#: A bucket as the decision sees it: its tensors, and what DDP would all-reduce for it (bytes).
Bucket = tuple[Sequence[TensorSpec], int]


@dataclass(frozen=True)
class Choice:
    """The density :func:`choose_density` picked, its predicted exchange time per step, DDP's, and why."""

    density: float
    predicted_s: float
    dense_s: float
    reason: str


def candidate_densities(min_density: float) -> list[float]:
    """1, 1/2, 1/4, ... down to ``min_density`` (included): the densities priced, largest first."""
    out, d = [], 1.0
    while d > min_density:
        out.append(d)
        d /= 2
    return [*out, min_density]


def exchange_time(
    algorithm: type[Algorithm[Any, Any, Any]], config: AlgorithmConfig, buckets: Sequence[Bucket],
    world_size: int, network: Network,
) -> float:  # fmt: skip
    """Seconds the collectives of one step take on ``network`` (one after the other: a conservative sum)."""
    costs = [algorithm.wire_cost(config, list(layout), world_size, dense_bytes) for layout, dense_bytes in buckets]
    return sum((network.allreduce if m.collective == "all_reduce" else network.allgather)(m.nbytes, world_size)
               for cost in costs for m in cost.messages)  # fmt: skip


def priced_time(
    algorithm: type[Algorithm[Any, Any, Any]], config: AlgorithmConfig, density: float, buckets: Sequence[Bucket],
    world_size: int, network: Network, check_s: float = 0.0, dense_is_ddp: bool = False,
) -> float:  # fmt: skip
    """What :func:`choose_density` charges ``density``: its collectives, plus the settings check below 1 (DDP's own
    step skips it); with ``dense_is_ddp``, density 1 is DDP's all-reduce of every bucket's dense bytes."""
    if dense_is_ddp and density >= 1.0:
        return sum(network.allreduce(dense_bytes, world_size) for _, dense_bytes in buckets)
    return exchange_time(algorithm, replace(config, density=density), buckets, world_size, network) + (
        check_s if density < 1 else 0.0)


def choose_density(
    link: LinkEstimate, buckets: Sequence[Bucket], world_size: int, algorithm: type[Algorithm[Any, Any, Any]],
    config: AlgorithmConfig, min_density: float, margin: float = AUTO_MARGIN, one_host: bool = False,
    check_s: float = 0.0, dense_is_ddp: bool = False,
) -> Choice:  # fmt: skip
    """The largest density in [``min_density``, 1] whose exchange fits ``margin`` of the compute window (pure).

    Args:
        link: the measured throughput, latency and compute window.
        buckets: the model's gradient buckets (their tensors and dense bytes).
        world_size: the ranks exchanging.
        algorithm, config: whose :meth:`~lightning_dgc.algorithms.Algorithm.wire_cost` prices each density
            (``config``'s other settings, e.g. ``value_dtype``, apply).
        min_density: the lowest density allowed.
        margin: the share of the window the exchange may take.
        one_host: whether every rank runs on one host (:func:`lightning_dgc.comm.host_key`).
        check_s: the settings check a compressed step waits for before its first bucket (one all-gather over every
            rank, ``ranks - 1`` latency steps), charged to every density below 1; DDP's own step skips it.
        dense_is_ddp: whether density 1 runs DDP's own step
            (:func:`~lightning_dgc.exchange.passthrough.can_pass_through`), priced then as DDP's all-reduce of each
            bucket's dense bytes, whatever the algorithm's value dtype; otherwise density 1 is the algorithm's own
            dense exchange, priced by its ``wire_cost``.

    Dense (1) when every rank is on one host (loopback, shared memory or NVLink, where compression does not pay and
    processes sharing cores time their waits for each other), when the link cannot be timed, when DDP's all-reduce
    fits, or when no density is faster than it; when none fits but some are faster, the fastest (the lowest such).
    """
    if world_size <= 1 or not buckets:
        return Choice(1.0, 0.0, 0.0, "nothing to exchange")
    if one_host:
        return Choice(1.0, 0.0, 0.0, "every rank is on one host (loopback, shared memory, NVLink): dense")
    if not link.measurable:
        return Choice(1.0, 0.0, 0.0, "the link is too fast to time: dense")
    network = Network(bandwidth=link.throughput_bps, latency=link.latency_s)
    times = {d: priced_time(algorithm, config, d, buckets, world_size, network, check_s, dense_is_ddp)
             for d in candidate_densities(min_density)}  # fmt: skip
    dense, budget = times[1.0], margin * link.window_s
    if dense <= budget:
        return Choice(1.0, dense, dense, "DDP's all-reduce fits the compute window: dense")
    if fitting := [d for d, t in times.items() if t <= budget]:
        d = max(fitting)
        return Choice(d, times[d], dense, "the largest density whose exchange fits the compute window")
    fastest = min(times, key=lambda d: (times[d], -d))
    if times[fastest] >= dense:
        return Choice(1.0, dense, dense, "no density is faster than DDP's all-reduce (latency-bound link): dense")
    return Choice(fastest, times[fastest], dense, "no density fits the compute window: the fastest")


# -- the run's controller ----------------------------------------------------------------------------------
class AutoDensity:
    """One run's automatic density: the measuring phases, the choice, the floor, the statistics.

    The front doors call :meth:`attach` with the exchange state, :meth:`hooked` from every bucket's hook (with
    the settings check's duration on a step's first bucket) and :meth:`step_done` after every optimizer step.
    """

    def __init__(self, config: AlgorithmConfig, owner: str) -> None:
        self.owner = owner
        self.min_density: float = config.min_density  # type: ignore[attr-defined]
        self.every: int = config.auto_every  # type: ignore[attr-defined]
        self.floor = self.min_density  # a schedule's density: the one in force is never below it
        self.link_density = 1.0  # the link's choice (1 until the first one)
        self.measuring = True
        self.choice: Choice | None = None
        self.link: LinkEstimate | None = None
        #: What the last decision priced: each bucket's tensors and dense bytes (two levels: its longest shard).
        self.priced: list[Bucket] = []
        self.priced_check_s = 0.0  # ... the settings check it added to every density below 1 (seconds)
        self.priced_dense_is_ddp = False  # ... and whether density 1 was priced as DDP's own step
        self.steps = 0  # optimizer steps of this fit
        self.last_measured_s: float | None = None
        self._samples: list[StepSample] = []
        self._recorder: ExchangeRecorder | None = None
        self._step_end: float | None = None
        self._last_hook: float | None = None
        self._hooks_block = False  # two levels: the hook waits for its collectives (on the CPU, the host does)
        self._in_hooks = self._before_last = 0.0  # ... the time it held the host: all of it, and before the last hook
        self._probe_s: float | None = None
        self._predict: Any = None  # density -> predicted seconds, once a link was measured
        self.checking = False  # steps at a compressed choice, timed against the dense steps
        self._periods: list[float] = []  # step periods (end to end) of the measuring or checking steps
        self.dense_step_s: float | None = None  # the slowest rank's median dense step while measuring
        self.checked_step_s: float | None = None  # ... and of the compressed steps that checked the choice

    @property
    def density(self) -> float:
        """The density in force: 1 while measuring, else ``max(floor, the link's)``."""
        return 1.0 if self.measuring else max(self.floor, self.link_density)

    def attach(self, state: Any) -> None:
        """Time ``state``'s collectives from now on (in two levels those across nodes: the state's), and start a
        measuring phase (a new fit measures anew)."""
        if not isinstance(state.collectives, TimedCollectives):
            self._recorder = ExchangeRecorder(state.world_size)
            state.collectives = TimedCollectives(state.collectives, self._recorder)
        else:
            self._recorder = state.collectives.recorder
        self.steps, self.measuring, self.checking, self._samples, self._periods = 0, True, False, [], []
        self._step_end, self._hooks_block = None, state.hook_waits
        state.density = self.density

    def set_floor(self, value: float, state: Any) -> None:
        """A density set from outside (a schedule): the floor of the density in force."""
        self.floor = check_density(value)
        if state is not None:
            state.density = self.density

    def hooked(self, probe_s: float | None = None) -> None:
        """A bucket's hook starts (``probe_s``: the settings check's duration, on the step's first bucket)."""
        self._last_hook, self._before_last = time.perf_counter(), self._in_hooks
        if probe_s is not None:
            self._probe_s = probe_s

    def hook_done(self) -> None:
        """A bucket's hook returned. In two levels it waited for the bucket's collectives: not compute, so that
        time leaves the compute window (a flat hook's does not wait)."""
        if self._hooks_block and self._last_hook is not None:
            self._in_hooks += time.perf_counter() - self._last_hook

    def exchange_done(self) -> None:
        """After a backward pass's exchange was finished: while measuring, the device's collectives end now
        (:meth:`ExchangeRecorder.device_done`; the CPU's were timed as they ended)."""
        if self.measuring and self._recorder is not None:
            self._recorder.device_done()

    def step_done(self, state: Any, group: Any = None) -> None:
        """After an optimizer step, on every rank: close the step's sample; decide, or start measuring again."""
        if self._recorder is None:
            return
        window = None
        if self._step_end is not None and self._last_hook is not None and self._last_hook > self._step_end:
            window = self._last_hook - self._step_end - self._before_last
        self._in_hooks = self._before_last = 0.0
        sample = self._recorder.close_step(window, self._probe_s)
        self._probe_s = None
        self.last_measured_s = sample.busy_s
        now = time.perf_counter()
        if self._step_end is not None:  # the run's first step (DDP's warm-up) is not counted
            if self.measuring:
                self._samples.append(sample)
                self._periods.append(now - self._step_end)
            elif self.checking:
                self._periods.append(now - self._step_end)
        self.steps += 1
        if self.measuring and len(self._samples) >= MEASURE_STEPS:
            self._decide(state, group)
        elif self.checking and len(self._periods) > MEASURE_STEPS:
            self._check(state, group)
        elif not self.measuring and self.every and self.steps % self.every == 0:
            self.measuring, self.checking, self._samples, self._periods = True, False, [], []
            state.density = self.density
        self._step_end = time.perf_counter()

    def _decide(self, state: Any, group: Any) -> None:
        mine = torch.tensor([*summarize(self._samples), statistics.median(self._periods), comm.host_key()],
                            dtype=torch.float64)  # fmt: skip
        gathered = [t.tolist() for t in comm.all_gather_host(mine, group, "all-gather of the link measurements"
                                                             " (density='auto')")]  # fmt: skip
        if state.nodes is not None:  # two levels or a sharded model (rows in global rank order, node by node)
            check_nodes_on_hosts([row[6] for row in gathered], state.nodes.per_node, self.owner)
        probe_ranks = len(gathered) if state.nodes is not None else None  # across nodes: checked by every rank
        link = self.link = link_from_ranks([row[:5] for row in gathered], state.world_size, probe_ranks)
        check_s = self.priced_check_s = link.latency_s * max(0, (probe_ranks or state.world_size) - 1)  # an all-gather
        self.dense_step_s = max(row[5] for row in gathered)  # the slowest rank's step sets the pace
        buckets = self.priced = priced_buckets(state.plans)  # two levels: each bucket's longest shard, on every rank
        algorithm, config = type(state.algorithm), state.config
        one_host = len({row[6] for row in gathered}) == 1
        ddp = self.priced_dense_is_ddp = can_pass_through(state)  # density 1 is DDP's own fp32 step
        choice = self.choice = choose_density(link, buckets, state.world_size, algorithm, config, self.min_density,
                                              one_host=one_host, check_s=check_s, dense_is_ddp=ddp)  # fmt: skip
        self.measuring, self._samples, self._periods, self.link_density = False, [], [], choice.density
        self.checking = choice.density < 1.0
        if link.measurable:
            network = Network(bandwidth=link.throughput_bps, latency=link.latency_s)
            cache: dict[float, float] = {}

            def predict(d: float) -> float:
                if d not in cache:
                    cache[d] = priced_time(algorithm, config, d, buckets, state.world_size, network, check_s, ddp)
                return cache[d]

            self._predict = predict
        else:
            self._predict = None
        state.density = self.density
        if state.global_rank == 0:
            from lightning.fabric.utilities.rank_zero import rank_zero_info

            rate = f"{link.throughput_bps / 1e6:.4g} Mbit/s" if link.measurable else "too fast to time"
            rank_zero_info(
                f"{self.owner}: density='auto' chose {choice.density:g} at step {self.steps} ({choice.reason}; link"
                f" {rate}, latency {link.latency_s * 1e3:.3g} ms, compute window {link.window_s * 1e3:.4g} ms,"
                f" predicted exchange {choice.predicted_s * 1e3:.4g} ms, DDP's {choice.dense_s * 1e3:.4g} ms)."
            )

    def _check(self, state: Any, group: Any) -> None:
        """After the steps that check a compressed choice (every rank): dense again if they were no faster than
        the dense steps measured (what the model does not price: the selection, the memory's work)."""
        mine = torch.tensor([statistics.median(self._periods[1:])], dtype=torch.float64)  # the first: new plans
        gathered = comm.all_gather_host(mine, group, "all-gather of the checked step times (density='auto')")
        self.checked_step_s = max(float(t[0]) for t in gathered)
        self.checking, self._periods = False, []
        if self.dense_step_s is not None and self.checked_step_s >= self.dense_step_s and self.choice is not None:
            self.choice = replace(self.choice, density=1.0, predicted_s=self.choice.dense_s,
                                  reason="compressed steps were no faster than dense ones: dense")  # fmt: skip
            self.link_density = 1.0
            state.density = self.density
            if state.global_rank == 0:
                from lightning.fabric.utilities.rank_zero import rank_zero_info

                rank_zero_info(
                    f"{self.owner}: density='auto' goes back to dense at step {self.steps}: steps of"
                    f" {self.checked_step_s * 1e3:.4g} ms compressed against {self.dense_step_s * 1e3:.4g} ms dense."
                )

    def stats(self) -> dict[str, float | int | bool]:
        """What ``compression_stats()`` adds: the link's density, predicted and measured exchange time, ..."""
        out: dict[str, float | int | bool] = {"auto_density": self.link_density, "auto_measuring": self.measuring}
        if self.last_measured_s is not None:
            out["measured_exchange_ms"] = self.last_measured_s * 1e3
        if self.link is not None:
            out["compute_window_ms"] = self.link.window_s * 1e3
            if self.link.measurable:
                out["link_mbit_s"] = self.link.throughput_bps / 1e6
                out["link_latency_ms"] = self.link.latency_s * 1e3
        if self.dense_step_s is not None:
            out["dense_step_ms"] = self.dense_step_s * 1e3
        if self.checked_step_s is not None:
            out["checked_step_ms"] = self.checked_step_s * 1e3
        if self._predict is not None:
            out["predicted_exchange_ms"] = self._predict(self.density) * 1e3
        return out
