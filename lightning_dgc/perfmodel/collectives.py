"""The time and volume of one collective on a flat network (see :mod:`lightning_dgc.perfmodel`)."""

from __future__ import annotations

import math

from lightning_dgc.algorithms.base import allgather_volume, ring_allreduce_volume

DENSE_VALUE_BYTES = 4  # fp32: what plain DDP all-reduces


# -- primitives: one collective, flat network ---------------------------------------------------------
def ring_allreduce_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """``2 (n-1) L + 2 (n-1)/n * 8 S / B``; 0 for one worker or an empty message (no collective runs)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * latency + ring_allreduce_volume(nbytes, n) * 8 / bandwidth


def allgather_time(payload: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-gather: ``(n-1) L + (n-1) * 8 P / B``; 0 for one worker or an empty payload."""
    if n <= 1 or payload <= 0:
        return 0.0
    return (n - 1) * latency + allgather_volume(payload, n) * 8 / bandwidth


def gather_time(payload: float, n: int, bandwidth: float, latency: float) -> float:
    """Gather of ``payload`` bytes per worker to one leader: ``(n-1) L + (n-1) * 8 P / B``."""
    return allgather_time(payload, n, bandwidth, latency)


def reduce_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Reduce to one leader as reduce-scatter + gather: ``2 (n-1) L + 2 (n-1)/n * 8 S / B``."""
    return ring_allreduce_time(nbytes, n, bandwidth, latency)


def broadcast_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Broadcast from one leader as scatter + all-gather: ``2 (n-1) L + 2 (n-1)/n * 8 S / B``."""
    return ring_allreduce_time(nbytes, n, bandwidth, latency)


def _doubling_steps(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def doubling_allreduce_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Recursive-doubling all-reduce: ``ceil(log2 n)`` exchanges of the whole message."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    steps = _doubling_steps(n)
    return steps * (latency + nbytes * 8 / bandwidth)


def doubling_allgather_time(payload: float, n: int, bandwidth: float, latency: float) -> float:
    """Recursive-doubling all-gather: ``ceil(log2 n)`` steps, the same ``(n-1) P`` received as the ring."""
    if n <= 1 or payload <= 0:
        return 0.0
    return _doubling_steps(n) * latency + allgather_volume(payload, n) * 8 / bandwidth


def sparse_allreduce_worst_volume(payload: float, dense_cap: float, n: int) -> float:
    """Bytes received per worker by the worst-case sparse all-reduce: ``sum_i min(2^i P, D)``."""
    if payload <= 0:
        return 0.0
    return float(sum(min(2**i * payload, dense_cap) for i in range(_doubling_steps(n))))


def sparse_allreduce_worst_time(
    payload: float, dense_cap: float, n: int, bandwidth: float, latency: float, *,
    local_steps: int = 0, local_bandwidth: float | None = None, local_latency: float | None = None,
) -> float:  # fmt: skip
    """Recursive doubling where the density doubles at every step, capped at dense (see the module doc).

    ``local_steps`` of the ``ceil(log2 n)`` steps (the first ones) run on the local bus.
    """
    if payload <= 0:
        return 0.0
    total = 0.0
    for i in range(_doubling_steps(n)):
        local = i < local_steps
        b = local_bandwidth if local and local_bandwidth else bandwidth
        lat = local_latency if local and local_latency is not None else latency
        total += lat + min(2**i * payload, dense_cap) * 8 / b
    return total


