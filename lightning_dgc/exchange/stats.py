"""What each step of the exchange sent, per rank: the figures behind ``compression_stats()`` and the
``compression/*`` scalars that :class:`~lightning_dgc.CompressionMonitor` logs."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from lightning_dgc.algorithms import BucketWork, WireCost


@dataclass
class StepStats:
    """What one optimizer step put on the wire, per rank."""

    payload_bytes: int = 0  # the compressed part: indices/codes, values or factors, padding, control
    dense_exchange_bytes: int = 0  # tensors averaged dense
    padding_bytes: int = 0
    dense_bytes: int = 0  # what plain DDP would have sent for the same buckets
    values_sent: int = 0
    link_bytes: float = 0.0  # what each worker's link carries, every collective a ring (WireCost.link_bytes)
    inter_node_bytes: float = 0.0  # the part of link_bytes that crosses nodes (all of it on a flat run)
    numel: int = 0
    selection_ms: float = 0.0
    buckets: int = 0
    density: float | None = None  # the density the step was compressed with (algorithms that have one)
    control_bytes: int = 0  # DEFT: the norms (and selection times) exchanged to agree on a plan
    k_target: int = 0  # values the density asks for (sum of k over compressed tensors)
    union_values: int = 0  # distinct indices in the union of all ranks' selections
    rank_selected: int = 0  # values this rank selected itself
    buildup_requested: bool = False  # whether the step was asked to measure union_values (a host sync)
    buildup_measured: bool = False  # whether the algorithm did (BucketWork.stats / add_union_values)
    rank_selection_ms: list[float] = field(default_factory=list)  # DEFT: every rank's previous selection
    plans: list[tuple[list[int], list[int]]] = field(default_factory=list)  # DEFT: (k, owner) per fragment

    @property
    def bytes_sent(self) -> int:
        return self.payload_bytes + self.dense_exchange_bytes


class ExchangeStatistics:
    """This step's figures, bucket by bucket (:meth:`record`, from the hook), and the last finished step's
    (:meth:`report`). Decode callbacks of different buckets may add to a step at once: a lock guards it."""

    def __init__(self, measure_buildup: bool = False) -> None:
        #: Count the distinct indices of all ranks' selections (the build-up factor) in every step.
        self.measure_buildup = measure_buildup
        self._buildup_step = -1
        self.current = StepStats()
        self.last: StepStats | None = None
        self.last_finite = True
        self.last_selection_ms = 0.0  # this rank's selection time in the previous step (DEFT shares it)
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # pickled without the lock, which does not pickle; the copy gets its own
        return {key: value for key, value in self.__dict__.items() if key != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def request_buildup(self, step: int) -> None:
        """Count the build-up factor in step ``step``."""
        self._buildup_step = step

    def measures_buildup(self, step: int) -> bool:
        return self.measure_buildup or self._buildup_step == step

    def record(
        self, cost: WireCost, work: BucketWork, selection_s: float, world_size: int, density: float | None,
        buildup_requested: bool, node_link_bytes: float = 0.0,
    ) -> None:  # fmt: skip
        """Add one bucket's wire cost and measured figures (``node_link_bytes``: what a two-level exchange moves
        inside the node besides)."""
        payload = cost.bytes_sent - cost.bytes_of("dense")
        with self._lock:
            stats = self.current
            stats.payload_bytes += payload
            stats.control_bytes += cost.bytes_of("control")
            stats.padding_bytes += cost.padding_bytes
            stats.dense_exchange_bytes += cost.bytes_of("dense")
            stats.dense_bytes += cost.dense_bytes
            stats.values_sent += cost.values_sent
            across = cost.link_bytes(world_size)
            stats.link_bytes += across + node_link_bytes
            stats.inter_node_bytes += across
            stats.k_target += cost.k
            stats.numel += cost.numel
            stats.selection_ms += selection_s * 1e3
            stats.buckets += 1
            stats.density = density
            stats.rank_selected += work.stats.get("rank_selected", 0)
            stats.buildup_requested = buildup_requested
            if "union_values" in work.stats:
                stats.union_values += work.stats["union_values"]
                stats.buildup_measured = True
            if "rank_selection_ms" in work.stats:
                stats.rank_selection_ms = work.stats["rank_selection_ms"]
            if "plan" in work.stats:
                stats.plans.append(work.stats["plan"])

    def add_union_values(self, count: int) -> None:
        """Add to this step's union size."""
        with self._lock:
            self.current.union_values += count
            self.current.buildup_measured = True

    def close_step(self, finite: bool) -> None:
        """The step is over: its figures become the last step's."""
        with self._lock:
            self.last_selection_ms = self.current.selection_ms
            self.last, self.current = self.current, StepStats()
        self.last_finite = finite

    def report(self, algorithm: str, step: int) -> dict[str, float | int | bool]:
        """The last finished step's figures, as ``compression_stats()`` returns them (empty before the first)."""
        s = self.last
        if s is None:
            return {}
        stats: dict[str, Any] = {
            "algorithm": algorithm,
            "bytes_sent": s.bytes_sent,
            "payload_bytes": s.payload_bytes,
            "dense_exchange_bytes": s.dense_exchange_bytes,
            "padding_bytes": s.padding_bytes,
            "dense_bytes": s.dense_bytes,
            "compression_ratio": s.dense_bytes / s.bytes_sent if s.bytes_sent else float("inf"),
            "link_bytes": s.link_bytes,
            "inter_node_bytes": s.inter_node_bytes,
            "values_sent": s.values_sent,
            "numel": s.numel,
            "selection_ms": s.selection_ms,
            "control_bytes": s.control_bytes,
            "k": s.k_target,
            "rank_selected": s.rank_selected,
            "buckets": s.buckets,
            "step": step,
            "finite": self.last_finite,
        }
        if s.density is not None:
            stats["density"] = s.density
        # Nothing selected: no build-up (1). Selected but not counted: not reported, rather than a false 0.
        if s.buildup_measured or (s.buildup_requested and not s.k_target):
            stats["union_values"] = s.union_values
            stats["buildup_factor"] = s.union_values / s.k_target if s.k_target else 1.0
        if s.rank_selection_ms:
            stats["rank_selection_ms"] = list(s.rank_selection_ms)
            stats["max_rank_selection_ms"] = max(s.rank_selection_ms)
        return stats
