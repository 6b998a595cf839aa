"""The prediction over worker counts and bandwidths (:func:`predict`), and its validation against a measured
record (:func:`validate`)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from lightning_dgc import algorithms
from lightning_dgc.perfmodel.network import Network
from lightning_dgc.perfmodel.profile import Profile
from lightning_dgc.perfmodel.step import METHODS, StepTime, step_time, wire_bytes

#: Worker counts of the prediction: powers of two from 1 to 256.
WORKERS: tuple[int, ...] = tuple(2**i for i in range(9))
#: Link bandwidths of the prediction, bits/s: 100 Mbit/s, 1, 10 and 25 Gbit/s.
BANDWIDTHS: tuple[float, ...] = (100e6, 1e9, 10e9, 25e9)


# -- the prediction -------------------------------------------------------------------------------------
@dataclass
class Prediction:
    """Throughput and speedup of every method for every worker count, bandwidth and overlap setting.

    ``rows`` are plain dicts (JSON): method, workers, bandwidth_bps, overlap, step_s, comm_s,
    exposed_comm_s (both with the settings check and what the hooks waited for), selection_s, exchange_s (the
    profile's measured exchange time of the method), throughput (samples/s), speedup, wire_bytes (received per
    worker).
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
                            "comm_s": t.comm_s + t.blocking_comm_s + t.control_s,
                            "exposed_comm_s": t.exposed_comm_s + t.blocking_comm_s + t.control_s,
                            "selection_s": t.selection_s,
                            "exchange_s": t.exchange_s,
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
