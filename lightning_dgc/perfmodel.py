"""A performance model of data-parallel training with DDP, DGC and DEFT: what speedup at N workers?

Our machines hold two workers; users run 8 to 256. Like the performance model behind the DGC paper
(Lin et al., ICLR 2018, Figure 6, after Wen et al., NeurIPS 2017), this module answers "what speedup
at N workers on links of bandwidth B" from what one node *measures* (a :class:`Profile`, written by
:class:`lightning_dgc.profiler.ExchangeProfiler`): the compute time of a step, the top-k selection
time, and the exact bytes every bucket puts on the wire, while communication is modelled
analytically. No process group and no Lightning: every function can be checked by hand.

Units: bytes for sizes, **bits per second** for bandwidths, seconds for times.

Collectives (flat network, ``n`` workers, bandwidth ``B``, latency ``L`` per message step):

* ring all-reduce of ``S`` bytes (dense DDP; DGC's and DEFT's small dense tensors; DEFT's vectors):
  every worker sends and receives ``2 (n-1)/n S`` bytes in ``2 (n-1)`` steps::

      T_allreduce(S) = 2 (n-1) L + 2 (n-1)/n * 8 S / B

* ring all-gather of a fixed-size payload ``P`` per worker (DGC's sparse exchange): every worker
  receives the ``n-1`` other payloads in ``n-1`` steps::

      T_allgather(P) = (n-1) L + (n-1) * 8 P / B

* sparse all-reduce, worst case (the paper's argument against it, section 2): recursive doubling in
  ``ceil(log2 n)`` steps where the density doubles at every step (the partners' indices never
  overlap), capped at the dense size ``D``::

      T_sparse_worst(P) = sum_{i < ceil(log2 n)} [ L + 8 min(2^i P, D) / B ]

Hierarchical network (:class:`Network` with ``gpus_per_node = G > 1``): ``g = min(G, n)`` workers
per node on a local bus (``local_bandwidth``, ``local_latency``), ``m = ceil(n / g)`` nodes on the
slow links. Every collective becomes *reduce within the node, exchange across nodes, broadcast within
the node*, with the bandwidth-optimal (Rabenseifner / van de Geijn) costs on the local bus::

    T_reduce(S, g)    = 2 (g-1) l + 2 (g-1)/g * 8 S / b      (reduce-scatter + gather)
    T_broadcast(S, g) = 2 (g-1) l + 2 (g-1)/g * 8 S / b      (scatter + all-gather)
    T_gather(P, g)    = (g-1) l + (g-1) * 8 P / b
    all-reduce:  T_reduce(S, g) + T_allreduce(S, m) + T_broadcast(S, g)
    all-gather:  T_gather(P, g) + T_allgather(g P, m) + T_broadcast(n P, g)
    worst case:  the first log2 g doubling steps on the local bus, the other ones on the slow links

With ``G = 1`` every local term vanishes and the flat formulas come back.

``Network(algorithm="best")`` lets every all-reduce and all-gather take the cheaper of the ring
and recursive doubling (``ceil(log2 n)`` steps; all-reduce ``log2 n * 8 S / B``, all-gather
``(n-1) * 8 P / B``), as MPI and NCCL pick short-message algorithms; the default is the ring.

What each method sends per bucket comes from the algorithm itself
(:meth:`lightning_dgc.algorithms.Algorithm.wire_cost`, the formula the runtime statistics use too):
a list of collectives (all-reduce or all-gather of so many bytes), some *blocking* (the hook waits for
them before it can go on, e.g. DEFT's norms and union indices, PowerSGD's P), which are never
overlapped with the backward pass. ``ddp`` is one all-reduce of the bucket; ``sparse_allreduce`` is
DGC's payload exchanged by the worst-case sparse all-reduce above, plus the dense all-reduce (a bound,
not an implementation). The selection time of the profile (DGC's top-k over the whole gradient) is
charged as the algorithm says (:meth:`~lightning_dgc.algorithms.Algorithm.selection_share`): DGC in
full, DEFT split among the workers, PowerSGD not at all.

Step time of one worker (``C`` compute: forward + backward + optimizer, measured; ``W`` the part of
it that communication can hide behind, the backward pass when the profile measured it; ``X`` the work
on the critical path that only compression adds: top-k selection, DEFT's blocking collectives;
``c`` the overlappable communication of all buckets and ``c_last`` that of the last bucket, which only
becomes ready when backward ends)::

    no overlap:  T = C + X + c
    overlap:     T = C + X + max(0, c - c_last - W) + c_last

so overlap is never slower, and equals ``max(C, c) + X`` when the whole step can overlap and the
last bucket is negligible. With one worker nothing is exchanged: ``T(1) = C`` for every method, so
``speedup(1) = 1`` and ``speedup(n) = n C / T(n)``; throughput is ``n * batch_size / T(n)``.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from lightning_dgc import algorithms, shards
from lightning_dgc.algorithms import Message, TensorSpec, WireCost, layout_of
from lightning_dgc.algorithms.base import allgather_volume, ring_allreduce_volume

__all__ = [
    "BANDWIDTHS",
    "METHODS",
    "NODE_METHODS",
    "WORKERS",
    "BucketProfile",
    "Network",
    "Prediction",
    "Profile",
    "StepTime",
    "allgather_time",
    "allgather_volume",
    "broadcast_time",
    "doubling_allgather_time",
    "doubling_allreduce_time",
    "flattened_matrices",
    "gather_time",
    "gradient_bytes",
    "predict",
    "reduce_time",
    "ring_allreduce_time",
    "ring_allreduce_volume",
    "sparse_allreduce_worst_time",
    "sparse_allreduce_worst_volume",
    "speedup",
    "step_time",
    "validate",
    "wire_bytes",
]

#: Methods the prediction covers: dense DDP, every registered algorithm, and the worst-case sparse
#: all-reduce bound of DGC's payload.
METHODS: tuple[str, ...] = ("ddp", *algorithms.registered(), "sparse_allreduce")
#: What a method's name ends with for its two-level exchange (``dgc_node``: dense inside the node, DGC
#: across the nodes on each GPU's shard; :func:`lightning_dgc.hook.exchange_two_level`).
NODE_SUFFIX = "_node"
#: The two-level variant of every registered algorithm.
NODE_METHODS: tuple[str, ...] = tuple(f"{m}{NODE_SUFFIX}" for m in algorithms.registered())
#: Worker counts of the prediction: powers of two from 1 to 256.
WORKERS: tuple[int, ...] = tuple(2**i for i in range(9))
#: Link bandwidths of the prediction, bits/s: 100 Mbit/s, 1, 10 and 25 Gbit/s.
BANDWIDTHS: tuple[float, ...] = (100e6, 1e9, 10e9, 25e9)

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
    """

    bandwidth: float
    latency: float = 50e-6
    gpus_per_node: int = 1
    local_bandwidth: float = 100e9
    local_latency: float = 5e-6
    algorithm: Literal["ring", "best"] = "ring"
    nic: Literal["node", "gpu"] = "node"

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

    def two_level(self, cost: WireCost, dense_bytes: float, shard_bytes: float, n: int) -> tuple[float, float]:
        """``(overlappable, blocking)`` time of one bucket's two-level exchange (``cost``: the algorithm's
        wire cost of one shard across the nodes): a reduce-scatter inside the node, the algorithm's
        collectives across the ``m`` nodes (on a shared network card each at ``bandwidth / g``), an
        all-gather of ``shard_bytes`` inside the node. The hook waits for the first two before it starts
        the last (:func:`lightning_dgc.hook.exchange_two_level`): they are blocking."""
        g, m = self.split(n)
        local = (self.local_bandwidth, self.local_latency)
        bandwidth = self.bandwidth / g if self.nic == "node" else self.bandwidth
        across = 0.0
        for message in cost.messages:
            collective = self._allreduce if message.collective == "all_reduce" else self._allgather
            across += collective(message.nbytes, m, bandwidth, self.latency)
        scatter = (g - 1) * self.local_latency + (g - 1) / g * 8 * dense_bytes / self.local_bandwidth if g > 1 else 0.0
        return allgather_time(shard_bytes, g, *local), scatter + across

    def sparse_allreduce_worst(self, payload: float, dense_cap: float, n: int) -> float:
        """Worst-case sparse all-reduce; its first ``log2 g`` doubling steps stay inside the node."""
        g, _ = self.split(n)
        return sparse_allreduce_worst_time(
            payload, dense_cap, n, self.bandwidth, self.latency, local_steps=_doubling_steps(g),
            local_bandwidth=self.local_bandwidth, local_latency=self.local_latency,
        )  # fmt: skip


# -- the profile ----------------------------------------------------------------------------------------
@dataclass
class BucketProfile:
    """One DDP gradient bucket: the shapes of its tensors, in bucket order, and its dense size.

    Attributes:
        shapes: every parameter's shape, in the order DDP packs the bucket.
        dense_bytes: the bucket's size, all-reduced by plain DDP.
        names: the parameters' names (optional, for reading).
    """

    shapes: list[list[int]]
    dense_bytes: int
    names: list[str] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def layout(self) -> list[TensorSpec]:
        names = self.names or [f"tensor{i}" for i in range(len(self.shapes))]
        return layout_of(names, self.shapes)


@dataclass
class Profile:
    """What one node measured for one model (JSON-serialisable; see :mod:`lightning_dgc.profiler`).

    Attributes:
        model: a name for the model.
        buckets: the DDP buckets, in the order DDP reduces them (the last one is ready last).
        compute_s: median time of one optimizer step (forward, backward, optimizer) minus selection.
        backward_s: median backward time minus selection (the window communication can hide
            behind), or ``None`` if not measured (then the whole step is taken as overlappable).
        selection_s: median time to select top-k over the whole gradient on one worker.
        batch_size: samples per worker per optimizer step (for throughput).
        density, value_dtype: DGC's and DEFT's compression settings (unless ``configs`` sets them).
        configs: every algorithm's settings to predict with (its configuration's fields), by name;
            an algorithm not listed uses its defaults (``density``/``value_dtype`` above for DGC and DEFT).
        world_size, strategy, device, steps: how the profile was taken.
        step_s: median measured step time as is (for reference).
        stats: the last ``compression_stats()`` of the profiled run (empty under plain DDP).
        stats_match: whether the per-bucket byte counts summed to the ``compression_stats()`` totals.
    """

    model: str
    buckets: list[BucketProfile]
    compute_s: float
    selection_s: float = 0.0
    backward_s: float | None = None
    batch_size: int = 1
    density: float = 0.001
    value_dtype: str = "fp32"
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    world_size: int = 1
    strategy: str = "dgc"
    device: str = "cpu"
    steps: int = 0
    step_s: float | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    stats_match: bool | None = None
    notes: list[str] = field(default_factory=list)

    # -- what each method sends ----------------------------------------------------------------------
    def config(self, method: str) -> algorithms.AlgorithmConfig:
        """The settings ``method`` (a registered algorithm) is predicted with."""
        cls = algorithms.get(method).config_class
        known = {f.name for f in fields(cls)}
        defaults = {
            k: v for k, v in (("density", self.density), ("value_dtype", self.value_dtype)) if k in known
        }
        return cls(**(defaults | self.configs.get(method, {})))

    def cost(self, method: str, bucket: BucketProfile, n: int) -> WireCost:
        """What ``method`` sends for ``bucket`` per step and worker at ``n`` workers."""
        if method == "ddp":
            dense = Message("all_reduce", bucket.dense_bytes, "dense")
            return WireCost((dense,), bucket.dense_bytes, bucket.numel, 0, bucket.numel)
        cls = algorithms.get(method)
        return cls.wire_cost(self.config(method), bucket.layout(), n, bucket.dense_bytes)

    def two_level_cost(self, method: str, bucket: BucketProfile, g: int, m: int) -> tuple[WireCost, int]:
        """``(wire cost across m nodes, shard bytes)`` of one GPU's shard of ``bucket`` in a two-level
        exchange of ``g`` GPUs per node (``method``: the algorithm's name, without ``_node``)."""
        pieces = shards.shard_pieces(bucket.layout(), g, 0)  # local rank 0 holds the longest shard
        numel = sum(p.numel for p in pieces)
        shard_bytes = numel * DENSE_VALUE_BYTES
        cls = algorithms.get(method)
        return cls.wire_cost(self.config(method), pieces, m, shard_bytes), shard_bytes

    # -- totals per step and rank, as compression_stats() counts them --------------------------------
    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buckets)

    @property
    def dense_bytes(self) -> int:
        """What plain DDP all-reduces per step (``dense_bytes``)."""
        return sum(b.dense_bytes for b in self.buckets)

    def bytes_sent(self, method: str, n: int | None = None) -> int:
        """What ``method`` sends per step and rank at ``n`` workers (default: as profiled)."""
        n = self.world_size if n is None else n
        return sum(self.cost(method, b, n).bytes_sent for b in self.buckets)

    def totals(self, method: str, n: int | None = None) -> dict[str, float]:
        """The byte counts ``compression_stats()`` reports under ``method`` at ``n`` workers."""
        n = self.world_size if n is None else n
        costs = [self.cost(method, b, n) for b in self.buckets]
        dense = sum(c.bytes_of("dense") for c in costs)
        sent = sum(c.bytes_sent for c in costs)
        return {
            "bytes_sent": sent,
            "payload_bytes": sent - dense,
            "dense_exchange_bytes": dense,
            "control_bytes": sum(c.bytes_of("control") for c in costs),
            "padding_bytes": sum(c.padding_bytes for c in costs),
            "dense_bytes": self.dense_bytes,
            "numel": self.numel,
            "k": sum(c.k for c in costs),
            "buckets": len(self.buckets),
            "link_bytes": sum(c.link_bytes(n) for c in costs),
        }

    # -- JSON ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["buckets"] = [_bucket_from_dict(b) for b in data["buckets"]]
        if flattened_matrices(kwargs["buckets"]):
            warnings.warn(
                f"profile {data.get('model')!r}: every tensor of two or more dimensions has the shape [n, 1];"
                " if these are sizes rather than real shapes, PowerSGD's predictions are plain DDP's. Profile"
                " the model again with lightning_dgc.ExchangeProfiler, which stores the real shapes.",
                stacklevel=2,
            )
        return cls(**kwargs)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        data = json.loads(Path(path).read_text())
        return cls.from_dict(data.get("profile", data))


def _bucket_from_dict(data: dict[str, Any]) -> BucketProfile:
    """A bucket of a profile JSON. A bucket without ``shapes`` (only the compressed tensors' sizes, as
    ``sparse_numels``) is refused: its tensors' shapes are lost, and what an algorithm that factorises
    matrices (PowerSGD) sends cannot be priced from sizes alone."""
    if "shapes" not in data:
        raise ValueError(
            "this profile's buckets give tensor sizes (`sparse_numels`) but not their `shapes`, so the"
            " model cannot price PowerSGD, which factorises each matrix. Profile the model again with"
            " lightning_dgc.ExchangeProfiler (it stores every tensor's shape and name per bucket), or add"
            " `shapes` (a list of each tensor's dimensions, in bucket order) to every bucket."
        )
    return BucketProfile(**data)


def flattened_matrices(buckets: Sequence[BucketProfile]) -> bool:
    """Whether every tensor of two or more dimensions has the shape ``[n, 1]`` (and there are several):
    the mark of shapes flattened to their sizes, which prices PowerSGD as plain DDP."""
    matrices = [s for b in buckets for s in b.shapes if len(s) >= 2]
    return len(matrices) > 1 and all(len(s) == 2 and s[1] == 1 for s in matrices)


def gradient_bytes(numels: Iterable[int], bytes_per_value: int = 4) -> int:
    """Size of a dense gradient with these tensor sizes (fp32 by default)."""
    return sum(int(n) for n in numels) * bytes_per_value


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


# -- the prediction -------------------------------------------------------------------------------------
@dataclass
class Prediction:
    """Throughput and speedup of every method for every worker count, bandwidth and overlap setting.

    ``rows`` are plain dicts (JSON): method, workers, bandwidth_bps, overlap, step_s, comm_s,
    exposed_comm_s, selection_s, throughput (samples/s), speedup, wire_bytes (received per worker).
    """

    profile: Profile
    network: Network
    rows: list[dict[str, Any]]

    def network_at(self, bandwidth: float) -> Network:
        return replace(self.network, bandwidth=bandwidth)

    def step_time(self, method: str, n: int, bandwidth: float, overlap: bool = True) -> StepTime:
        return step_time(self.profile, method, n, self.network_at(bandwidth), overlap)

    def lookup(self, method: str, n: int, bandwidth: float, overlap: bool = True) -> dict[str, Any]:
        for row in self.rows:
            if (row["method"], row["workers"], row["overlap"]) == (method, n, overlap) and math.isclose(
                row["bandwidth_bps"], bandwidth
            ):
                return row
        raise KeyError((method, n, bandwidth, overlap))

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile.to_dict(), "network": asdict(self.network), "rows": self.rows}


def predict(
    profile: Profile,
    workers: Sequence[int] = WORKERS,
    bandwidths: Sequence[float] = BANDWIDTHS,
    methods: Sequence[str] = METHODS,
    network: Network | None = None,
) -> Prediction:
    """Evaluate the model on the grid ``methods x workers x bandwidths x {overlap, no overlap}``.

    ``network`` supplies latency and the node layout; its bandwidth is replaced by each of ``bandwidths``.
    """
    network = network or Network(bandwidth=bandwidths[0])
    rows = []
    for method in methods:
        for bandwidth in bandwidths:
            net = replace(network, bandwidth=bandwidth)
            for overlap in (True, False):
                for n in workers:
                    t = step_time(profile, method, n, net, overlap)
                    rows.append(
                        {
                            "method": method,
                            "workers": n,
                            "bandwidth_bps": bandwidth,
                            "overlap": overlap,
                            "step_s": t.total_s,
                            "comm_s": t.comm_s + t.blocking_comm_s,
                            "exposed_comm_s": t.exposed_comm_s + t.blocking_comm_s,
                            "selection_s": t.selection_s,
                            "throughput": n * profile.batch_size / t.total_s,
                            "speedup": n * profile.compute_s / t.total_s,
                            "wire_bytes": wire_bytes(profile, method, n, network.gpus_per_node),
                        }
                    )
    return Prediction(profile, network, rows)


# -- validation against a measurement ---------------------------------------------------------------
_STRATEGY_KEYS = ("strategy", "method", "algorithm")
_STEP_KEYS = {  # key -> factor to seconds
    "step_s": 1.0, "step_time_s": 1.0, "median_step_s": 1.0, "mean_step_s": 1.0, "seconds_per_step": 1.0,
    "step_ms": 1e-3, "step_time_ms": 1e-3, "median_step_ms": 1e-3, "mean_step_ms": 1e-3,
}  # fmt: skip
_BANDWIDTH_KEYS = ("bandwidth_bps", "bandwidth_bits", "bandwidth", "rate", "link", "bandwidth_mbit",
                   "bandwidth_mbps", "bandwidth_gbit", "bandwidth_gbps")  # fmt: skip
_WORKER_KEYS = ("world_size", "workers", "devices", "processes", "nodes")
#: One worker's step time measured while the other worker trains alongside on the same cores.
_SHARED_COMPUTE_KEYS = ("shared_cpu_one_worker_step_time_s", "shared_compute_s")
_STRATEGY_ALIASES = {"ddp": "ddp", "dense": "ddp", "allreduce": "ddp"} | {
    m: m for m in algorithms.registered()
}


def parse_bandwidth(value: Any, key: str = "") -> float | None:
    """Bits/s from ``1e9``, ``"1gbit"``, ``"100mbit"``, ``"1 Gbit/s"``, ``"10G"`` (a bare number in a
    key ending in ``mbit``/``mbps``/``gbit``/``gbps`` is scaled accordingly)."""
    scale = {"mbit": 1e6, "mbps": 1e6, "gbit": 1e9, "gbps": 1e9}
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        for suffix, factor in scale.items():
            if key.lower().endswith(suffix):
                return float(value) * factor
        return float(value) if value > 0 else None
    if not isinstance(value, str):
        return None
    text = value.strip().lower().replace(" ", "").replace("/s", "").replace("ps", "")
    units = (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("g", 1e9), ("m", 1e6), ("k", 1e3), ("bit", 1.0))
    for unit, factor in units:
        if text.endswith(unit):
            try:
                return float(text[: -len(unit)]) * factor
            except ValueError:
                return None
    return None


def measured_records(data: Any, context: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every ``{strategy, bandwidth_bps, workers, step_s, model}`` found anywhere in a measurement JSON.

    The walk is tolerant of the layout: a record is any object with a strategy and a step time; the
    bandwidth, worker count and model may be given on the object or by an enclosing key or object
    (``{"1gbit": {"dgc": {"step_s": ...}}}`` works as well as a flat list of records).
    """
    context = dict(context or {})
    found: list[dict[str, Any]] = []
    if isinstance(data, list):
        for item in data:
            found += measured_records(item, context)
        return found
    if not isinstance(data, dict):
        return found
    here = dict(context)
    for key in _STRATEGY_KEYS:
        if isinstance(data.get(key), str):
            here["strategy"] = data[key]
    for key in _BANDWIDTH_KEYS:
        if key in data and (bw := parse_bandwidth(data[key], key)) is not None:
            here["bandwidth_bps"] = bw
    for key in _WORKER_KEYS:
        if isinstance(data.get(key), int) and not isinstance(data.get(key), bool):
            here["workers"] = data[key]
    if isinstance(data.get("model"), str):
        here["model"] = data["model"]
    for key in _SHARED_COMPUTE_KEYS:
        if isinstance(data.get(key), (int, float)) and not isinstance(data.get(key), bool):
            here["shared_compute_s"] = float(data[key])
    step = next((data[k] * f for k, f in _STEP_KEYS.items() if isinstance(data.get(k), (int, float))), None)
    if step is not None and "strategy" in here:
        found.append({**here, "step_s": float(step)})
    for key, value in data.items():
        if not isinstance(value, (dict, list)):
            continue
        sub = dict(here)
        if (bw := parse_bandwidth(key)) is not None:
            sub["bandwidth_bps"] = bw
        elif key.lower() in _STRATEGY_ALIASES:
            sub["strategy"] = key
        found += measured_records(value, sub)
    return found


def _with_compute(profile: Profile, compute_s: float) -> Profile:
    """``profile`` with another compute time, the backward window scaled alike."""
    scale = compute_s / profile.compute_s if profile.compute_s else 1.0
    backward = profile.backward_s * scale if profile.backward_s is not None else None
    return replace(profile, compute_s=compute_s, backward_s=backward)


def validate(
    prediction: Prediction, measured_json: str | Path, print_fn: Any = print
) -> list[dict[str, Any]]:
    """Predicted against measured step time for every record of ``measured_json`` that the model covers.

    ``measured_json`` is the output of ``benchmarks/slow_links.py`` (two workers joined by a
    rate-limited link): see :func:`measured_records` for the layouts understood. Each returned row has
    strategy, workers, bandwidth_bps, measured_s, predicted_s (with overlap), predicted_no_overlap_s and
    error (``predicted / measured - 1``). When the measurement also gives one worker's step time while
    the other trained alongside on the same cores (``shared_cpu_one_worker_step_time_s``, as
    ``benchmarks/slow_links.py`` records it), ``predicted_shared_compute_s`` and
    ``error_shared_compute`` use that as the compute time, which isolates the communication model from
    the CPU sharing. When the file does not exist, prints a note and returns ``[]``.
    """
    path = Path(measured_json)
    if not path.exists():
        print_fn(
            f"No measurement at {path}: run `python -m benchmarks.slow_links` (two network namespaces joined"
            " by a `tc`-limited link, needs root) to compare these predictions with reality."
        )
        return []
    records = measured_records(json.loads(path.read_text()))
    model = prediction.profile.model
    rows = []
    for r in records:
        method = _STRATEGY_ALIASES.get(str(r["strategy"]).lower())
        if method is None or "bandwidth_bps" not in r:
            continue
        if r.get("model") not in (None, model):
            continue
        n = int(r.get("workers", 2))
        pred = prediction.step_time(method, n, r["bandwidth_bps"], overlap=True).total_s
        pred_no = prediction.step_time(method, n, r["bandwidth_bps"], overlap=False).total_s
        row = {
            "strategy": method, "workers": n, "bandwidth_bps": r["bandwidth_bps"], "measured_s": r["step_s"],
            "predicted_s": pred, "predicted_no_overlap_s": pred_no, "error": pred / r["step_s"] - 1.0,
        }  # fmt: skip
        if "shared_compute_s" in r:  # the workers shared the cores: model the link alone
            shared = _with_compute(prediction.profile, r["shared_compute_s"])
            net = prediction.network_at(r["bandwidth_bps"])
            row["predicted_shared_compute_s"] = step_time(shared, method, n, net, overlap=True).total_s
            row["error_shared_compute"] = row["predicted_shared_compute_s"] / r["step_s"] - 1.0
        rows.append(row)
    if not rows:
        models = sorted({str(r.get("model")) for r in records})
        print_fn(
            f"{path} holds no step time of {sorted(set(_STRATEGY_ALIASES.values()))} with a bandwidth for model {model!r}"
            f" (models found: {models}); nothing to compare."
        )
    return rows
