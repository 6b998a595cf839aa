"""The link as ``density="auto"`` measures it: each step's collectives timed (:class:`ExchangeRecorder`), one
rank's steps in five numbers (:func:`summarize`) and every rank's as one :class:`LinkEstimate`
(:func:`link_from_ranks`); :mod:`lightning_dgc.schedules.auto_density` prices densities on it."""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_dgc import comm
from lightning_dgc.algorithms.base import allgather_volume, ring_allreduce_volume
from lightning_dgc.comm import Pending

__all__ = [
    "MIN_TRANSFER_S", "ExchangeRecorder", "LinkEstimate", "StepSample", "estimate_link", "link_from_ranks", "summarize",
]  # fmt: skip

#: Transfer time per step below which a link is taken as too fast to time (loopback, a fast LAN): dense.
MIN_TRANSFER_S = 20e-6


@dataclass(frozen=True)
class LinkEstimate:
    """What the measuring phase found: ``throughput_bps`` (bits/s; ``inf``: too fast to time), ``latency_s`` (per
    message step) and ``window_s`` (the compute window of a step)."""

    throughput_bps: float
    latency_s: float
    window_s: float

    @property
    def measurable(self) -> bool:
        return math.isfinite(self.throughput_bps) and self.throughput_bps > 0


@dataclass(frozen=True)
class StepSample:
    """One measured step: link bytes of its collectives, their latency steps, the time some was in flight, the
    compute window and the settings check's all-gather (``None``: not measured)."""

    volume_bytes: float
    latency_steps: int
    busy_s: float
    window_s: float | None
    probe_s: float | None


def summarize(samples: Sequence[StepSample]) -> list[float]:
    """One rank's measured steps in five numbers, what the ranks gather: link bytes, time in flight and latency
    steps over the steps, the quickest settings check (``inf``: none) and the median compute window (pure)."""
    probes = [s.probe_s for s in samples if s.probe_s is not None]
    windows = [s.window_s for s in samples if s.window_s is not None]
    return [
        sum(s.volume_bytes for s in samples), sum(s.busy_s for s in samples if s.volume_bytes > 0),
        float(sum(s.latency_steps for s in samples if s.volume_bytes > 0)), min(probes) if probes else math.inf,
        statistics.median(windows) if windows else 0.0,
    ]  # fmt: skip


def link_from_ranks(rows: Sequence[Sequence[float]], world_size: int, probe_ranks: int | None = None) -> LinkEstimate:
    """Every rank's :func:`summarize` as one :class:`LinkEstimate` (pure); ``world_size``: the ranks of the timed
    collectives, ``probe_ranks``: those of the settings check (default ``world_size``; in two levels every rank).

    The latency is the quickest settings check of any rank (its all-gather takes ``probe_ranks - 1`` message steps,
    each as slow as its slowest hop; a slower one waited for a later rank). Each rank's throughput is its link bytes
    over its time in flight less the latency steps; the highest is taken (the rank that waited least for the others measured the link
    best), ``inf`` when no rank's transfer time reaches :data:`MIN_TRANSFER_S` per collective (too fast to
    time). The window is the shortest rank's.
    """
    probe = min(row[3] for row in rows)
    latency = probe / max(1, (probe_ranks or world_size) - 1) if math.isfinite(probe) else 0.0
    throughputs = []
    for volume, busy, steps, _, _ in rows:
        transfer = busy - steps * latency
        if volume > 0 and transfer > MIN_TRANSFER_S * max(1.0, steps / max(1, 2 * (world_size - 1))):
            throughputs.append(8 * volume / transfer)
    return LinkEstimate(max(throughputs, default=math.inf), latency, min(row[4] for row in rows))


def estimate_link(samples: Sequence[StepSample], world_size: int) -> LinkEstimate:
    """One rank's :class:`LinkEstimate` from its measured steps (pure; :func:`link_from_ranks` of one rank)."""
    return link_from_ranks([summarize(samples)], world_size)


class ExchangeRecorder:
    """The collectives of the current step: their link bytes, latency steps, and times of issue and completion."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._lock = threading.Lock()
        self._calls: list[list[float]] = []  # [volume, latency steps, issued, done (nan: not yet)]
        self._on_cuda = False  # whether this step's collectives run on CUDA tensors

    def __getstate__(self) -> dict[str, Any]:  # pickled without the lock, which does not pickle; the copy gets its own
        return {key: value for key, value in self.__dict__.items() if key != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def issued(self, collective: str, nbytes: int, pending: Pending) -> None:
        """Note a collective just started; its completion is noted when its future is done (on the host: gloo's
        collectives, and every collective on the CPU; NCCL's complete at launch, see :meth:`device_done`)."""
        n = self.world_size
        volume, steps = (
            (ring_allreduce_volume(nbytes, n), 2 * (n - 1)) if collective == "all_reduce"
            else (allgather_volume(nbytes, n), n - 1)
        )  # fmt: skip
        call = [volume, steps, time.perf_counter(), math.nan]
        with self._lock:
            self._calls.append(call)
            self._on_cuda = self._on_cuda or pending.output.is_cuda

        def done() -> torch.Tensor:
            call[3] = time.perf_counter()
            return pending.output

        comm.when_all([pending], done, pending.output.device)

    def device_done(self) -> None:
        """After the step's exchange: on CUDA, wait for the device and take now as every collective's completion
        (NCCL's futures complete at launch, so the host cannot see when each one ends)."""
        if self._on_cuda:
            torch.cuda.synchronize()
            now = time.perf_counter()
            with self._lock:
                for call in self._calls:
                    call[3] = now

    def close_step(self, window_s: float | None, probe_s: float | None) -> StepSample:
        """The step's sample (every collective is done by now); the next step starts empty."""
        with self._lock:
            calls, self._calls, self._on_cuda = self._calls, [], False
        now = time.perf_counter()
        intervals = sorted((c[2], c[3] if math.isfinite(c[3]) else now) for c in calls)
        busy, end = 0.0, -math.inf
        for start, stop in intervals:  # the union of the in-flight intervals
            if stop > end:
                busy += stop - max(start, end)
                end = stop
        return StepSample(sum(c[0] for c in calls), int(sum(c[1] for c in calls)), busy, window_s, probe_s)
