"""The network a prediction runs on: bandwidth, latency, nodes of several GPUs (:class:`Network`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from lightning_dgc.algorithms import WireCost
from lightning_dgc.perfmodel.collectives import (
    _doubling_steps,
    allgather_time,
    broadcast_time,
    doubling_allgather_time,
    doubling_allreduce_time,
    gather_time,
    reduce_time,
    ring_allreduce_time,
    sparse_allreduce_worst_time,
)


# -- the network ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Network:
    """Links between workers.

    Args:
        bandwidth: bits/s of the slow links (between nodes; between all workers when flat).
        latency: seconds per message step on those links (50 us: a TCP round on Ethernet).
        gpus_per_node: workers per node sharing a fast local bus; 1 is a flat network.
        local_bandwidth: bits/s of the local bus (100 Gbit/s, about PCIe 3 x16).
        local_latency: seconds per message step on the local bus.
        algorithm: ``"ring"`` (every collective a ring) or ``"best"`` (the cheaper of ring and
            recursive doubling, per collective, as short-message algorithms do).
        nic: for the two-level exchange (``<algorithm>_node``): ``"node"``, one network card of
            ``bandwidth`` per node, shared by the node's ``gpus_per_node`` exchanges that run at once
            (each sees ``bandwidth / gpus_per_node``); ``"gpu"``, one card of ``bandwidth`` per GPU.
        concurrency: collectives a process group runs at once (gloo: 2 threads per group; NCCL: 1, one
            stream): the step's collectives run in the order they are issued on that many channels, each as
            soon as one is free (:func:`channels_end`), their bytes one after the other on the link.
    """

    bandwidth: float
    latency: float = 50e-6
    gpus_per_node: int = 1
    local_bandwidth: float = 100e9
    local_latency: float = 5e-6
    algorithm: Literal["ring", "best"] = "ring"
    nic: Literal["node", "gpu"] = "node"
    concurrency: int = 1

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or not self.local_bandwidth > 0:
            raise ValueError(
                f"bandwidths must be > 0 bits/s, got {self.bandwidth} and {self.local_bandwidth}."
            )
        if self.latency < 0 or self.local_latency < 0:
            raise ValueError("latencies must be >= 0 seconds.")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}.")
        if self.algorithm not in ("ring", "best"):
            raise ValueError(f"algorithm must be 'ring' or 'best', got {self.algorithm!r}.")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1 collective at once, got {self.concurrency}.")
        if self.nic not in ("node", "gpu"):
            raise ValueError(f"nic must be 'node' (one network card per node) or 'gpu', got {self.nic!r}.")

    def _allreduce(self, nbytes: float, n: int, bandwidth: float, latency: float) -> float:
        ring = ring_allreduce_time(nbytes, n, bandwidth, latency)
        if self.algorithm == "ring":
            return ring
        return min(ring, doubling_allreduce_time(nbytes, n, bandwidth, latency))

    def _allgather(self, payload: float, n: int, bandwidth: float, latency: float) -> float:
        ring = allgather_time(payload, n, bandwidth, latency)
        if self.algorithm == "ring":
            return ring
        return min(ring, doubling_allgather_time(payload, n, bandwidth, latency))

    def split(self, n: int) -> tuple[int, int]:
        """``(g, m)``: workers per node and nodes for ``n`` workers."""
        g = min(self.gpus_per_node, n)
        return g, math.ceil(n / g)

    def allreduce(self, nbytes: float, n: int) -> float:
        """All-reduce time: ring on a flat network; reduce / all-reduce / broadcast when hierarchical."""
        g, m = self.split(n)
        local = (self.local_bandwidth, self.local_latency)
        return (
            reduce_time(nbytes, g, *local)
            + self._allreduce(nbytes, m, self.bandwidth, self.latency)
            + broadcast_time(nbytes, g, *local)
        )

    def allgather(self, payload: float, n: int) -> float:
        """All-gather time: ring on a flat network; gather / all-gather of node blocks / broadcast."""
        g, m = self.split(n)
        local = (self.local_bandwidth, self.local_latency)
        if payload <= 0:
            return 0.0
        return (
            gather_time(payload, g, *local)
            + self._allgather(g * payload, m, self.bandwidth, self.latency)
            + broadcast_time(n * payload, g, *local)
        )

    def parts(self, collective: str, nbytes: float, n: int) -> tuple[float, float]:
        """``(latency, transfer)`` seconds of one collective (``"all_reduce"`` or ``"all_gather"``): its time on this
        network and the part of it that is bytes (its time with no latency)."""
        time_of = Network.allreduce if collective == "all_reduce" else Network.allgather
        total = time_of(self, nbytes, n)
        transfer = time_of(replace(self, latency=0.0, local_latency=0.0), nbytes, n)
        return total - transfer, transfer

    def duration(self, collective: str, nbytes: float, n: int) -> tuple[float, float]:
        """``(duration, transfer)`` of one collective: a ring's steps overlap its bytes, so it takes the longer of its
        latency steps and its bytes plus one step (what a small message pays, steps times latency, and a large one,
        its bytes, both stay); ``transfer``: its bytes alone, on the link the step's collectives share."""
        latency, transfer = self.parts(collective, nbytes, n)
        return max(latency, transfer + min(latency, self.latency)), transfer

    def two_level(self, cost: WireCost, dense_bytes: float, shard_bytes: float, n: int) -> tuple[float, float]:
        """``(overlappable, blocking)`` time of one bucket's two-level exchange (``cost``: the algorithm's
        wire cost of one shard across the nodes): a reduce-scatter inside the node, the algorithm's
        collectives across the ``m`` nodes (on a shared network card each at ``bandwidth / g``), an
        all-gather of ``shard_bytes`` inside the node. The hook waits for the first two before it starts
        the last (:func:`lightning_dgc.exchange.hook.exchange_two_level`): they are blocking."""
        g, m = self.split(n)
        local = (self.local_bandwidth, self.local_latency)
        bandwidth = self.bandwidth / g if self.nic == "node" else self.bandwidth
        across_net = replace(self, bandwidth=bandwidth, gpus_per_node=1)
        runs = [(across_net.duration(msg.collective, msg.nbytes, m)[0], msg.blocking) for msg in cost.messages]
        across = channels_end(runs, self.concurrency)
        scatter = (g - 1) * self.local_latency + (g - 1) / g * 8 * dense_bytes / self.local_bandwidth if g > 1 else 0.0
        return allgather_time(shard_bytes, g, *local), scatter + across

    def sparse_allreduce_worst(self, payload: float, dense_cap: float, n: int) -> float:
        """Worst-case sparse all-reduce; its first ``log2 g`` doubling steps stay inside the node."""
        g, _ = self.split(n)
        return sparse_allreduce_worst_time(
            payload, dense_cap, n, self.bandwidth, self.latency, local_steps=_doubling_steps(g),
            local_bandwidth=self.local_bandwidth, local_latency=self.local_latency,
        )  # fmt: skip





def channels_end(runs: list[tuple[float, bool]], channels: int, start: float = 0.0) -> float:
    """When the last of ``runs`` (each ``(duration, blocking)``, in the order they are issued from ``start``) ends on
    ``channels`` channels that take the next collective as soon as one is free; a blocking one is waited for before
    the next is issued."""
    free, issued, end = [start] * channels, start, start
    for duration, blocking in runs:
        i = min(range(channels), key=free.__getitem__)
        free[i] = max(issued, free[i]) + duration
        end = max(end, free[i])
        if blocking:
            issued = free[i]
    return end
