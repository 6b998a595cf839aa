"""DGC's link bytes over a whole run of the long CIFAR-10 protocol, lever by lever, measured through the hook.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.run_bytes

ResNet-20 (the long protocol's model), DDP's default buckets, the hook's own accounting of one step
(:func:`benchmarks.traffic.measure`: a one-process gloo group, a synthetic gradient on every parameter) at every
density a schedule uses; a run's bytes are each stage's step times its steps (7,820 steps, 391 an epoch), and the
ratio is DDP's ring all-reduce over the run against them. At 2 workers a worker's link carries what it hands to the
collectives (an all-gather of one payload, an all-reduce of ``S`` moving ``S``); at 8 the same payloads cost
``(N - 1)`` times as much on an all-gather and ``2 (N - 1) / N`` on an all-reduce (the algorithm's wire cost).

The levers, one after the other from the paper's DGC (density 0.001, fp32 values, 1-D and small tensors averaged
dense, the paper's warm-up of four epochs at 0.25, 0.0625, 0.0156, 0.004): int8 values (one scale per 32), every
tensor compressed (``compress_vectors``, ``min_compress_numel=1``), then the warm-up without its first stage (each
later stage one epoch, as the paper's), or without it in half-epoch stages; then ``algo/dgc_lean`` with its 1-D and
small tensors (under 1,024 values) averaged dense in fp16, as the paper's DGC does, with and without a warm-up, or
compressed at density 1/8 (``small_density``) instead of 0.001, or sent whole every 8 steps from their residual
(``small_every``: a step's bytes are the mean of 8 steps'). ``algo/dgc_1pct_int8`` (the run's record: 59.3x) is
a check of the method. Writes ``benchmarks/results/run_bytes.json``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import dataclasses
import json
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import common
from benchmarks.parity import LEAN_WARMUP, LIGHT_WARMUP
from benchmarks.traffic import free_port, measure
from lightning_dgc.algorithms.base import allgather_volume, ring_allreduce_volume
from lightning_dgc.algorithms.dgc import DGCConfig
from lightning_dgc_recipes.resnet import build_resnet

STEPS, EPOCH = 7820, 391
PAPER_WARMUP = (0.25, 0.0625, 0.015625, 0.004)
EVERY_TENSOR = {"compress_vectors": True, "min_compress_numel": 1}
#: name -> (settings over DGCConfig(density=0.001), final density, warm-up stages as (density, steps))
LEVERS: dict[str, tuple[dict[str, Any], float, tuple[tuple[float, int], ...]]] = {
    "the paper's DGC (algo/dgc)": ({}, 0.001, tuple((d, EPOCH) for d in PAPER_WARMUP)),
    "+ int8 values": ({"value_dtype": "int8"}, 0.001, tuple((d, EPOCH) for d in PAPER_WARMUP)),
    "+ every tensor compressed": ({"value_dtype": "int8", **EVERY_TENSOR}, 0.001,
                                  tuple((d, EPOCH) for d in PAPER_WARMUP)),
    "+ warm-up without its 0.25 stage (algo/dgc_lean)": ({"value_dtype": "int8", **EVERY_TENSOR}, 0.001,
                                                         tuple((d, EPOCH) for d in LEAN_WARMUP)),
    "the same, half-epoch stages": ({"value_dtype": "int8", **EVERY_TENSOR}, 0.001,
                                    tuple((d, EPOCH // 2) for d in LEAN_WARMUP)),
    "algo/dgc_lean, the small tensors averaged dense (its trained diagnostic)": (
        {"value_dtype": "int8"}, 0.001, tuple((d, EPOCH) for d in LEAN_WARMUP)),
    "the same without a warm-up (the dense small tensors' ceiling)": ({"value_dtype": "int8"}, 0.001, ()),
    "algo/dgc_lean, the small tensors at density 1/8 (algo/dgc_lean_small)": (
        {"value_dtype": "int8", "small_density": 0.125}, 0.001, tuple((d, EPOCH) for d in LEAN_WARMUP)),
    "algo/dgc_lean, the small tensors sent whole every 8 steps (algo/dgc_lean_every)": (
        {"value_dtype": "int8", "small_every": 8}, 0.001, tuple((d, EPOCH) for d in LEAN_WARMUP)),
    "algo/dgc_1pct_int8 (check: its run record says 59.3x)": (
        {"value_dtype": "int8"}, 0.01, tuple((d, EPOCH) for d in LIGHT_WARMUP)),
}  # fmt: skip


def step_link_bytes(stats: dict[str, Any], workers: int) -> float:
    """A worker's link bytes in one step at ``workers`` workers, from one measured step's payload and dense parts."""
    payload = stats["bytes_sent"] - stats["dense_exchange_bytes"]
    return allgather_volume(payload, workers) + ring_allreduce_volume(stats["dense_exchange_bytes"], workers)


def lever_rows(workers: Sequence[int] = (2, 8)) -> list[dict[str, Any]]:
    """Every lever's step bytes at each density it uses, and its run's bytes and ratio at each worker count."""
    torch.manual_seed(0)
    model = build_resnet("resnet20", 10)
    cache: dict[tuple[Any, ...], dict[str, Any]] = {}

    def stats_at(settings: dict[str, Any], density: float) -> dict[str, Any]:
        """One step's bytes; with ``small_every``, the mean of that many steps' (one sends the small tensors)."""
        key = (tuple(sorted(settings.items())), density)
        if key not in cache:
            config = dataclasses.replace(DGCConfig(density=density), **settings)
            every = config.small_every
            stats = measure(model, config, steps=1 + every)  # (DDP's first step has one bucket: not counted)
            steps = stats["sent_per_step"][1:]
            cache[key] = {**stats, **{k: sum(s[k] for s in steps) / every for k in steps[0]}}
        return cache[key]

    dense_step = stats_at({}, 0.001)["dense_bytes"]
    rows = []
    for name, (settings, final, stages) in LEVERS.items():
        schedule = [*stages, (final, STEPS - sum(n for _, n in stages))]
        row: dict[str, Any] = {"lever": name, "settings": settings, "final_density": final,
                               "schedule": [list(s) for s in schedule]}  # fmt: skip
        for n in workers:
            ddp = ring_allreduce_volume(dense_step, n) * STEPS
            steps = {d: step_link_bytes(stats_at(settings, d), n) for d, _ in schedule}
            total = sum(steps[d] * count for d, count in schedule)
            row[f"{n}_workers"] = {
                "step_bytes": {str(d): b for d, b in steps.items()}, "run_bytes": total,
                "ratio": ddp / total, "warmup_share": sum(steps[d] * c for d, c in stages) / total,
                "final_step_ratio": ring_allreduce_volume(dense_step, n) / steps[final],
            }  # fmt: skip
        rows.append(row)
    return rows


def table(record: dict[str, Any] | None = None) -> str:
    """The DGC page's table of the levers, from ``run_bytes.json``: each one's bytes over the run and a step's."""
    record = record or json.loads((common.RESULTS / "run_bytes.json").read_text())
    lines = ["| configuration | over the run, 2 workers | warm-up's share | over the run, 8 workers | a step after the"
             " warm-up, 2 workers |", "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in record["rows"]:
        two, eight = r["2_workers"], r["8_workers"]
        lines.append(f"| {r['lever']} | {two['ratio']:,.1f}x | {100 * two['warmup_share']:.0f}% | {eight['ratio']:,.1f}x"
                     f" | {two['final_step_ratio']:,.1f}x |")  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run_bytes", description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(minutes=5))  # fmt: skip
    try:
        rows = lever_rows()
    finally:
        dist.destroy_process_group()
    con = common.console()
    for r in rows:
        two, eight = r["2_workers"], r["8_workers"]
        con.print(f"{r['lever']:58s} 2 workers: {two['run_bytes'] / 1e6:7.1f} MB, {two['ratio']:6.1f}x over the run"
                  f" ({100 * two['warmup_share']:.0f}% in the warm-up; {two['final_step_ratio']:6.1f}x a step after it);"
                  f" 8 workers: {eight['ratio']:6.1f}x")  # fmt: skip
    common.write_json("run_bytes.json", {"steps": STEPS, "steps_per_epoch": EPOCH, "model": "resnet20",
                                         "rows": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
