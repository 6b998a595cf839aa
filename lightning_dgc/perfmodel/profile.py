"""What one node measures (:class:`Profile`, written by :class:`lightning_dgc.front.profiler.ExchangeProfiler`): the
compute and selection time of a step and every bucket's tensors; saved and loaded as JSON."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from lightning_dgc import algorithms
from lightning_dgc.algorithms import Message, TensorSpec, WireCost, layout_of
from lightning_dgc.exchange import shards
from lightning_dgc.perfmodel.collectives import DENSE_VALUE_BYTES


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
    """What one node measured for one model (JSON-serialisable; see :mod:`lightning_dgc.front.profiler`).

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
        exchange_s: seconds per step each method's exchange takes on the profiled machine besides its
            collectives' bytes and latency, by method (``"dgc"``, ``"dgc_node"``, ...): the hook's host work
            (selection included), the decode, the memory's commit, and the waits of ranks that share cores.
            A method listed is charged this in place of ``selection_s`` times its share; the slow-link
            benchmarks measure it (:mod:`benchmarks.step_terms`); a method not listed is charged its
            selection alone.
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
    exchange_s: dict[str, float] = field(default_factory=dict)

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
        pieces = shards.shard_pieces(bucket.layout(), g, 0)  # local rank 0: up to a row per tensor short of the longest
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


