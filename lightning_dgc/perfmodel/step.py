"""The time of one training step at ``n`` workers (:func:`step_time`), its speedup and its bytes on the wire."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

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
#: Bytes per rank of the settings check every compressing exchange runs before a step's first bucket: one all-gather
#: over every rank (on the host, a ring that is not node-aware), which the hook waits for
#: (:func:`lightning_dgc.exchange.agreement.check_settings_agree`).
SETTINGS_CHECK_BYTES = 16


# -- the step -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepTime:
    """One worker's step, broken down (seconds): ``total_s`` is their sum (see the module doc of
    :mod:`lightning_dgc.perfmodel` for the timeline that gives ``exposed_comm_s``)."""

    method: str
    workers: int
    overlap: bool
    compute_s: float
    selection_s: float
    blocking_comm_s: float  # what the hooks waited for (DEFT's norms and indices, PowerSGD's P, two levels)
    comm_s: float  # every other collective of all buckets, one after the other
    last_bucket_comm_s: float  # of which the last bucket's (cannot overlap with backward)
    window_s: float  # how much of compute can hide communication (backward)
    exchange_s: float = 0.0  # the exchange's measured host work (Profile.exchange_s), in place of selection_s
    control_s: float = 0.0  # the settings check before the step's first bucket: the hook waits for it
    exposed_comm_s: float = 0.0  # what the collectives add after the backward pass

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.selection_s + self.exchange_s + self.control_s + self.blocking_comm_s
                + self.exposed_comm_s)  # fmt: skip


@dataclass(frozen=True)
class _Run:
    """One collective of a step as the timeline runs it: how long it takes, its bytes alone, and whether the hook
    waits for it."""

    duration: float
    transfer: float
    blocking: bool


def _timeline(buckets: list[list[_Run]], window: float, overlap: bool, channels: int, control: _Run | None,
              one_step: float) -> tuple[float, float]:  # fmt: skip
    """``(waited, exposed)``: the seconds the hooks held the backward pass back (blocking collectives, the settings
    check first) and what the collectives add after it.

    The backward pass runs ``window`` seconds; every bucket but the last is ready at its start (``overlap``; else
    all at its end), the last at its end. Each bucket's hook issues its collectives in order; they run on
    ``channels`` channels, each as soon as one is free, and a blocking one holds the hook (and the rest of the
    backward pass) until it ends. The step's bytes share one link: the last collective ends no sooner than the
    first one started plus all their bytes and one message step.
    """
    free = [0.0] * channels
    held = hook = 0.0
    first, transfer, end = math.inf, 0.0, 0.0
    for k, runs in enumerate(buckets):
        ready = window if (k == len(buckets) - 1 or not overlap) else 0.0
        hook = max(ready + held, hook)
        for run in ([control] if k == 0 and control is not None else []) + runs:
            i = min(range(channels), key=free.__getitem__)
            start = max(hook, free[i])
            free[i] = start + run.duration
            first, transfer, end = min(first, start), transfer + run.transfer, max(end, free[i])
            if run.blocking:
                held += free[i] - hook
                hook = free[i]
    if math.isfinite(first):
        end = max(end, first + transfer + one_step)
    return held, max(0.0, end - window - held)


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


def _bucket_runs(profile: Profile, bucket: BucketProfile, method: str, n: int, net: Network) -> list[_Run]:
    """One bucket's collectives, in the order its hook issues them."""
    base = node_base(method)
    if base is not None:  # the hook waits for the reduce-scatter and the exchange across nodes, not the all-gather
        g, m = net.split(n)
        cost, shard_bytes = profile.two_level_cost(base, bucket, g, m)
        gather, waited = net.two_level(cost, bucket.dense_bytes, shard_bytes, n)
        return [_Run(waited, 0.0, True), _Run(gather, 0.0, False)]
    if method == "sparse_allreduce":
        worst, _, _ = _sparse_worst(profile, bucket, n, net)
        return [_Run(worst + net.allreduce(profile.cost("dgc", bucket, n).bytes_of("dense"), n), 0.0, False)]
    return [_Run(*net.duration(m.collective, m.nbytes, n), m.blocking) for m in profile.cost(method, bucket, n).messages]


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
    buckets = [_bucket_runs(profile, b, method, n, network) for b in profile.buckets]
    measured = profile.exchange_s.get(method)
    selection = 0.0 if measured is not None else profile.selection_s * _selection_share(method, n, network.gpus_per_node)
    control = None
    if method != "ddp" and buckets:  # one ring over every worker, not node-aware: each step crosses the slow links
        flat = replace(network, gpus_per_node=1)
        control = _Run(*flat.duration("all_gather", SETTINGS_CHECK_BYTES, n), True)
    held, exposed = _timeline(buckets, window, overlap, network.concurrency, control, network.latency)
    control_s = control.duration if control is not None else 0.0
    overlappable = [sum(r.duration for r in runs if not r.blocking) for runs in buckets]
    return StepTime(
        method, n, overlap, profile.compute_s, selection, blocking_comm_s=held - control_s, comm_s=sum(overlappable),
        last_bucket_comm_s=overlappable[-1] if overlappable else 0.0, window_s=window, exchange_s=measured or 0.0,
        control_s=control_s, exposed_comm_s=exposed,
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


