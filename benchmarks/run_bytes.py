"""DGC's and DEFT's link bytes over a whole run of the long CIFAR-10 protocol, lever by lever, measured through the
hook.

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
a check of the method.

DEFT's union depends on the number of workers, so its rows (``deft_rows``) price each step with DEFT's own wire cost
at 2 and 8 workers on the buckets DDP built in the measured step (:func:`benchmarks.traffic.deft_bytes_at`):
``algo/deft`` (a check against its trained runs), without its warm-up, and with ``budget="k"`` as published, with
and without the warm-up. Writes ``benchmarks/results/run_bytes.json``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import dataclasses
import json
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import common
from benchmarks.parity import LEAN_WARMUP, LIGHT_WARMUP
from benchmarks.traffic import free_port, measure
from lightning_dgc.algorithms.base import allgather_volume, ring_allreduce_volume
from lightning_dgc.algorithms.deft_config import DEFTConfig
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
#: ``algo/deft``'s settings over ``DEFTConfig(density=0.001)``
DEFT_SHIPPED = {"momentum_correction": True, "k_allocation": "size", "budget": "dgc_link", "wire": "compact"}
#: name -> (settings over algo/deft's, final density, warm-up stages), as :data:`LEVERS`
DEFT_LEVERS: dict[str, tuple[dict[str, Any], float, tuple[tuple[float, int], ...]]] = {
    "algo/deft (check: its run records say 15.1x at 2 workers, 8.4x at 8)": (
        {}, 0.001, tuple((d, EPOCH) for d in PAPER_WARMUP)),
    "algo/deft without its warm-up": ({}, 0.001, ()),
    "algo/deft with budget k (as published)": ({"budget": "k"}, 0.001, tuple((d, EPOCH) for d in PAPER_WARMUP)),
    "algo/deft with budget k, without its warm-up": ({"budget": "k"}, 0.001, ()),
}  # fmt: skip


def step_link_bytes(stats: dict[str, Any], workers: int) -> float:
    """A worker's link bytes in one step at ``workers`` workers, from one measured step's payload and dense parts."""
    payload = stats["bytes_sent"] - stats["dense_exchange_bytes"]
    return allgather_volume(payload, workers) + ring_allreduce_volume(stats["dense_exchange_bytes"], workers)


def run_row(name: str, settings: dict[str, Any], final: float, stages: Sequence[tuple[float, int]],
            link_step: Callable[[dict[str, Any], float, int], float], ddp_step: int,
            workers: Sequence[int]) -> dict[str, Any]:  # fmt: skip
    """One configuration's step bytes at each density its schedule uses, and its run's bytes and ratio at each worker
    count; ``link_step(settings, density, workers)``: a worker's link bytes in one step."""
    schedule = [*stages, (final, STEPS - sum(n for _, n in stages))]
    row: dict[str, Any] = {"lever": name, "settings": settings, "final_density": final,
                           "schedule": [list(s) for s in schedule]}  # fmt: skip
    for n in workers:
        ddp = ring_allreduce_volume(ddp_step, n)
        steps = {d: link_step(settings, d, n) for d, _ in schedule}
        total = sum(steps[d] * count for d, count in schedule)
        row[f"{n}_workers"] = {
            "step_bytes": {str(d): b for d, b in steps.items()}, "run_bytes": total, "ratio": ddp * STEPS / total,
            "warmup_share": sum(steps[d] * c for d, c in stages) / total, "final_step_ratio": ddp / steps[final],
        }  # fmt: skip
    return row


def lever_rows(workers: Sequence[int] = (2, 8)) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """DGC's levers (:data:`LEVERS`) and DEFT's configurations (:data:`DEFT_LEVERS`), each a :func:`run_row`."""
    torch.manual_seed(0)
    model = build_resnet("resnet20", 10)
    cache: dict[str, dict[str, Any]] = {}

    def stats_at(config: DGCConfig) -> dict[str, Any]:
        """One step's bytes; with ``small_every``, the mean of that many steps' (one sends the small tensors)."""
        key = repr(config)  # (a config is not hashable; its repr names its class and every field)
        if key not in cache:
            every = config.small_every
            stats = measure(model, config, steps=1 + every)  # (DDP's first step has one bucket: not counted)
            steps = stats["sent_per_step"][1:]
            cache[key] = {**stats, **{k: sum(s[k] for s in steps) / every for k in steps[0]}}
        return cache[key]

    def dgc_step(settings: dict[str, Any], density: float, n: int) -> float:
        return step_link_bytes(stats_at(dataclasses.replace(DGCConfig(density=density), **settings)), n)

    def deft_step(settings: dict[str, Any], density: float, n: int) -> float:
        # DEFT's union depends on the number of workers: its own wire cost at n, on the buckets DDP built
        return stats_at(DEFTConfig(density=density, **{**DEFT_SHIPPED, **settings}))["link_at"][str(n)]

    ddp_step = stats_at(DGCConfig(density=0.001))["dense_bytes"]
    dgc = [run_row(name, *lever, dgc_step, ddp_step, workers) for name, lever in LEVERS.items()]
    deft = [run_row(name, *lever, deft_step, ddp_step, workers) for name, lever in DEFT_LEVERS.items()]
    return dgc, deft


def table(record: dict[str, Any] | None = None, rows: str = "rows", workers: int = 2) -> str:
    """A page's table of ``run_bytes.json``'s ``rows`` (the DGC page's levers; ``"deft_rows"``: the DEFT page's): each
    one's bytes over the run at ``workers`` workers, its warm-up's share, over the run at the other count, and a
    step's after the warm-up at ``workers``."""
    record = record or json.loads((common.RESULTS / "run_bytes.json").read_text())
    other = 8 if workers == 2 else 2
    lines = [f"| configuration | over the run, {workers} workers | warm-up's share | over the run, {other} workers"
             f" | a step after the warm-up, {workers} workers |", "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in record[rows]:
        at, at_other = r[f"{workers}_workers"], r[f"{other}_workers"]
        lines.append(f"| {r['lever']} | {at['ratio']:,.1f}x | {100 * at['warmup_share']:.0f}% | {at_other['ratio']:,.1f}x"
                     f" | {at['final_step_ratio']:,.1f}x |")  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run_bytes", description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(minutes=5))  # fmt: skip
    try:
        rows, deft_rows = lever_rows()
    finally:
        dist.destroy_process_group()
    con = common.console()
    for r in [*rows, *deft_rows]:
        two, eight = r["2_workers"], r["8_workers"]
        con.print(f"{r['lever']:58s} 2 workers: {two['run_bytes'] / 1e6:7.1f} MB, {two['ratio']:6.1f}x over the run"
                  f" ({100 * two['warmup_share']:.0f}% in the warm-up; {two['final_step_ratio']:6.1f}x a step after it);"
                  f" 8 workers: {eight['ratio']:6.1f}x")  # fmt: skip
    common.write_json("run_bytes.json", {"steps": STEPS, "steps_per_epoch": EPOCH, "model": "resnet20",
                                         "rows": rows, "deft_rows": deft_rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
