"""The time of one training step at ``n`` workers (:func:`step_time`), its speedup and its bytes on the wire."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_dgc import algorithms
from lightning_dgc.algorithms.base import ring_allreduce_volume
from lightning_dgc.perfmodel.collectives import DENSE_VALUE_BYTES, sparse_allreduce_worst_volume
from lightning_dgc.perfmodel.network import Network
from lightning_dgc.perfmodel.profile import BucketProfile, Profile

#: Methods the prediction covers: dense DDP, every registered algorithm, and the worst-case sparse
#: all-reduce bound of DGC's payload.
METHODS: tuple[str, ...] = ("ddp", *algorithms.registered(), "sparse_allreduce")
#: What a method's name ends with for its two-level exchange (``dgc_node``: dense inside the node, DGC
#: across the nodes on each GPU's shard; :func:`lightning_dgc.exchange.hook.exchange_two_level`).
NODE_SUFFIX = "_node"
#: The two-level variant of every registered algorithm.
NODE_METHODS: tuple[str, ...] = tuple(f"{m}{NODE_SUFFIX}" for m in algorithms.registered())


# -- the step -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepTime:
    """One worker's step, broken down (seconds). ``total_s`` applies the overlap rule of the module doc."""

    method: str
    workers: int
    overlap: bool
    compute_s: float
    selection_s: float
    blocking_comm_s: float  # DEFT's norms and union indices: the hook waits for them
    comm_s: float  # every other collective of all buckets
    last_bucket_comm_s: float  # of which the last bucket's (cannot overlap with backward)
    window_s: float  # how much of compute can hide communication (backward)

    @property
    def exposed_comm_s(self) -> float:
        if not self.overlap:
            return self.comm_s
        return max(0.0, self.comm_s - self.last_bucket_comm_s - self.window_s) + self.last_bucket_comm_s

    @property
    def total_s(self) -> float:
        return self.compute_s + self.selection_s + self.blocking_comm_s + self.exposed_comm_s


def _sparse_worst(
    profile: Profile, bucket: BucketProfile, n: int, net: Network | None
) -> tuple[float, int, int]:
    """DGC's payload through the worst-case sparse all-reduce: (time or volume, payload, dense cap)."""
    cost = profile.cost("dgc", bucket, n)
    payload = cost.bytes_of("payload")
    cap = (cost.numel - (cost.values_sent - cost.k)) * DENSE_VALUE_BYTES  # the compressed tensors, dense fp32
    if net is None:
        return sparse_allreduce_worst_volume(payload, cap, n), payload, cap
    return net.sparse_allreduce_worst(payload, cap, n), payload, cap


def node_base(method: str) -> str | None:
    """The algorithm of a two-level method's name (``"dgc_node"`` -> ``"dgc"``), else ``None``."""
    return method[: -len(NODE_SUFFIX)] if method in NODE_METHODS else None


def _bucket_comm(
    profile: Profile, bucket: BucketProfile, method: str, n: int, net: Network
) -> tuple[float, float]:
    """(overlappable, blocking) communication time of one bucket."""
    base = node_base(method)
    if base is not None:
        g, m = net.split(n)
        cost, shard_bytes = profile.two_level_cost(base, bucket, g, m)
        return net.two_level(cost, bucket.dense_bytes, shard_bytes, n)
    if method == "sparse_allreduce":
        worst, _, _ = _sparse_worst(profile, bucket, n, net)
        return worst + net.allreduce(profile.cost("dgc", bucket, n).bytes_of("dense"), n), 0.0
    overlappable = blocking = 0.0
    for message in profile.cost(method, bucket, n).messages:
        collective = net.allreduce if message.collective == "all_reduce" else net.allgather
        t = collective(message.nbytes, n)
        if message.blocking:
            blocking += t
        else:
            overlappable += t
    return overlappable, blocking


def _selection_share(method: str, n: int, gpus_per_node: int = 1) -> float:
    base = node_base(method)
    if base is not None:  # the algorithm's share across the nodes, of a 1/g shard
        g, m = min(gpus_per_node, n), math.ceil(n / min(gpus_per_node, n))
        return _selection_share(base, m) / g
    if method == "ddp":
        return 0.0
    if method == "sparse_allreduce":
        return 1.0
    return algorithms.get(method).selection_share(n)


def step_time(profile: Profile, method: str, n: int, network: Network, overlap: bool = True) -> StepTime:
    """The modelled step of one worker among ``n`` (see the module docstring for the formulas)."""
    if method not in METHODS + NODE_METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS + NODE_METHODS}.")
    if n < 1:
        raise ValueError(f"the number of workers must be >= 1, got {n}.")
    window = profile.compute_s if profile.backward_s is None else min(profile.backward_s, profile.compute_s)
    if n == 1:  # a single worker exchanges nothing
        return StepTime(method, 1, overlap, profile.compute_s, 0.0, 0.0, 0.0, 0.0, window)
    comm = [_bucket_comm(profile, b, method, n, network) for b in profile.buckets]
    return StepTime(
        method, n, overlap, profile.compute_s,
        profile.selection_s * _selection_share(method, n, network.gpus_per_node),
        blocking_comm_s=sum(b for _, b in comm), comm_s=sum(c for c, _ in comm),
        last_bucket_comm_s=comm[-1][0] if comm else 0.0, window_s=window,
    )  # fmt: skip


def speedup(profile: Profile, method: str, n: int, network: Network, overlap: bool = True) -> float:
    """Throughput of ``n`` workers over that of one: ``n C / T(n)``."""
    return n * profile.compute_s / step_time(profile, method, n, network, overlap).total_s


def wire_bytes(profile: Profile, method: str, n: int, gpus_per_node: int = 1) -> float:
    """Bytes one worker receives per step on a flat network (ring all-reduce, ring all-gather, ...); for a
    two-level method, across the nodes only (``compression_stats()["inter_node_bytes"]``)."""
    base = node_base(method)
    if base is not None:
        g = min(gpus_per_node, n)
        m = math.ceil(n / g)
        return sum(profile.two_level_cost(base, b, g, m)[0].link_bytes(m) for b in profile.buckets)
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS + NODE_METHODS}.")
    total = 0.0
    for b in profile.buckets:
        if method == "sparse_allreduce":
            worst, _, _ = _sparse_worst(profile, b, n, None)
            total += worst + ring_allreduce_volume(profile.cost("dgc", b, n).bytes_of("dense"), n)
            continue
        total += profile.cost(method, b, n).link_bytes(n)
    return total


