"""Bytes each rank puts on the wire per step, measured through the real DDP hook path.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.traffic [--quick]

For every model of :mod:`benchmarks.shapes` (real modules from ``lightning_dgc_recipes/``, on the CPU; ``--quick``
skips the LSTM): DGC and DEFT at densities 0.01 and 0.001 with values in fp32 and fp16 (DGC also int8), and
their peer PowerSGD at ranks 1, 2 and 4 (Vogels et al. 2019; compressing from the third step). A one-process gloo
group, the model wrapped in ``DistributedDataParallel`` (default buckets: 1 MB, then 25 MB) with an
``ExchangeState`` and the hook registered, optimizer steps of a synthetic loss (``sum(p * r)`` over all
parameters, ``r`` random: every parameter gets a gradient; no algorithm's byte count depends on the
gradient's values), then ``state.compression_stats()`` after ``state.finish_step()`` of the last step
(DDP uses one bucket in its first step and rebuilds its buckets after it). Nothing is estimated: the
numbers are the hook's own accounting of the tensors it hands to the collectives.

Columns (bytes per step per rank, i.e. the message each rank contributes to the collectives):

* ``sent``: everything the hook exchanges: ``payload + dense + control`` (``bytes_sent``).
* ``indices+values``: the compressed part. DGC: the all-gathered payload, ``k`` fp32/fp16/int8 values (int8:
  with one fp32 scale per 32) and ``k`` uint16 delta codes (plus one filler code per 65535 positions of the
  bucket); DEFT: the int32 union all-reduce plus the values all-reduce; PowerSGD: the factors P and Q (fp32).
* ``padding``: DGC's payload padding to a multiple of 4 bytes (per bucket).
* ``control``: DEFT's plan agreement: one float64 per fragment (norm) and per rank (selection time),
  per bucket. It grows with the number of workers; the row is for one worker, ``ctrl@8w`` is the
  same for 8 workers (``control_at`` in the JSON also has 16), from the hook's own fragmenting
  function on the measured buckets.
* ``dense``: tensors averaged uncompressed, in the value dtype (fp16 with int8; fp16 ones pre-divided by the
  world size): every 1-D tensor (batch-norm scales and shifts, biases) and tensors of fewer than 1024 values;
  for PowerSGD every tensor whose rank-r factors would not be 2x smaller than the tensor.
* ``DDP``: what plain DDP all-reduces for the same buckets (fp32 gradients).
* ``ratio``: ``DDP / sent``.
* ``buffers``: not part of the gradient exchange, and computed from the module's buffers rather than
  measured (a one-process group broadcasts nothing): DDP also broadcasts the buffers (batch-norm
  running statistics) from rank 0 at every forward (``broadcast_buffers=True``, DDP's default, which
  the strategies keep); plain DDP pays it too. ``ratio+buf`` is ``(DDP + buffers) / (sent + buffers)``.

Target: ResNet-50 at density 0.001 at least 400x less than dense; the verdict and the breakdown of
what keeps it from the target are printed at the end and saved with the results in
``benchmarks/results/traffic.json``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP: no spin-waiting

import argparse
import json
import platform
import socket
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.shapes import MODELS, build_model
from lightning_dgc import ExchangeState, algorithms, exchange_hook
from lightning_dgc.algorithms.deft import DEFT
from lightning_dgc.algorithms.dgc import DGCConfig
from lightning_dgc.algorithms.powersgd import PowerSGDConfig
from lightning_dgc.algorithms.topk_plan import tensor_kind, tensor_values, values_per_step
from lightning_dgc.tensor_ops import codec

RESULTS = Path(__file__).resolve().parent / "results" / "traffic.json"
DENSITIES = (0.01, 0.001)
VALUE_DTYPES = ("fp32", "fp16", "int8")
SPARSE_ALGORITHMS = ("dgc", "deft")
POWERSGD_RANKS = (1, 2, 4)
POWERSGD_START = 2  # the first two steps are plain all-reduce (DDP rebuilds its buckets after the first)
TARGET_MODEL, TARGET_DENSITY, TARGET_RATIO = "resnet50", 0.001, 400.0


class SyntheticLoss(nn.Module):
    """``sum(p * r)`` over the wrapped model's parameters, ``r`` fresh normal noise per call.

    Run through DDP's forward (so the reducer is armed) without the model's own forward: the hook
    sees a gradient for every parameter, with the real names, shapes, order and buckets.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, seed: Tensor) -> Tensor:
        generator = torch.Generator().manual_seed(int(seed))
        total = torch.zeros(())
        for p in self.model.parameters():
            total = total + (p * torch.randn(p.shape, generator=generator)).sum()
        return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def buffer_broadcast_bytes(model: nn.Module) -> int:
    """Bytes DDP broadcasts per forward with ``broadcast_buffers=True`` (all module buffers)."""
    return sum(b.numel() * b.element_size() for b in model.buffers())


def measure(model: nn.Module, config: algorithms.AlgorithmConfig, steps: int = 2) -> dict[str, Any]:
    """Run ``steps`` steps of the synthetic loss through DDP + the hook; the last step's stats (and each step's bytes
    sent, ``sent_per_step``)."""
    wrapper = SyntheticLoss(model)
    ddp = DDP(wrapper)  # DDP's default buckets (1 MB first, then 25 MB), as the strategies use them
    state = ExchangeState(config, measure_buildup=True)  # the union's size is a figure reported here
    state.register_parameters(wrapper.named_parameters())
    ddp.register_comm_hook(state, exchange_hook)
    buckets, sent = [], []
    for step in range(steps):
        for p in wrapper.parameters():
            p.grad = None
        state.clear_plans()  # keep only the last step's bucket layouts (read by deft_bytes_at)
        ddp(torch.tensor(step)).backward()
        assert state.finish_step(), "a synthetic gradient came out non-finite"
        step_stats = state.compression_stats()
        buckets.append(step_stats["buckets"])
        sent.append({key: step_stats[key] for key in ("bytes_sent", "dense_exchange_bytes")})
    stats = state.compression_stats()
    stats["buckets_per_step"], stats["sent_per_step"] = buckets, sent
    deft = state.algorithm.name == "deft"
    stats["control_at"] = deft_bytes_at(state, "control", (1, 8, 16)) if deft else {}
    stats["link_at"] = deft_bytes_at(state, "link", (2, 8, 16)) if deft else {}
    del ddp
    return stats


def deft_bytes_at(state: ExchangeState, part: str, worlds: Sequence[int]) -> dict[str, float]:
    """DEFT's bytes a step at each of ``worlds`` workers for the buckets of the measured run (DEFT's own wire cost
    on the bucket layouts DDP built for the last step: only the world size varies). ``part``: ``"control"`` (what
    a rank hands to the plan's agreement) or ``"link"`` (what each worker's link carries, every collective a ring:
    :meth:`~lightning_dgc.algorithms.base.WireCost.link_bytes`)."""
    def of(world: int) -> float:
        costs = [DEFT.wire_cost(state.config, plan.layout, world, plan.dense_bytes) for plan in state.plans]
        return sum(c.bytes_of("control") if part == "control" else c.link_bytes(world) for c in costs)

    return {str(world): of(world) for world in worlds}


def dense_breakdown(model: nn.Module, density: float, value_dtype: str) -> dict[str, int]:
    """Which tensors the hook averages dense, by kind (uses the hook's own ``tensor_kind``)."""
    config = DGCConfig(density=density, value_dtype=value_dtype)
    one_d, small, full = 0, 0, 0
    for p in model.parameters():
        kind = tensor_kind(p.numel(), p.dim(), tensor_values(config, p.numel(), p.dim(), density), config)
        if kind == "dense":
            if p.dim() <= 1:
                one_d += p.numel() * 4
            else:
                small += p.numel() * 4
        elif kind == "full":
            full += p.numel() * 4
    return {"one_d_bytes": one_d, "small_bytes": small, "full_bytes": full}


def what_would_close_it(rows: list[dict[str, Any]], model: nn.Module) -> list[dict[str, Any]]:
    """Changes that would raise DGC's ratio, as arithmetic on the measured parts (projections, not runs).

    ``rows`` are the measured DGC fp32 and fp16 rows of one model and density. Only what a change
    touches is recomputed: the number of kept values, bytes per kept value, and the dense part.
    """
    fp32 = next(r for r in rows if r["value_dtype"] == "fp32")
    fp16 = next(r for r in rows if r["value_dtype"] == "fp16")
    density, ddp = fp32["density"], fp32["dense_bytes"]
    one_d = [p.numel() for p in model.parameters() if p.dim() <= 1]
    big_one_d = [n for n in one_d if n >= DGCConfig().min_compress_numel]

    def saved(sizes: list[int], value_bytes: int) -> int:
        """Bytes saved by no longer sending ``sizes`` dense, minus what their k values cost."""
        kept = sum(values_per_step(n, density) for n in sizes)
        return sum(n * value_bytes for n in sizes) - kept * (codec.CODE_BYTES + value_bytes)

    options = {
        f"compress 1-D tensors of >= {DGCConfig().min_compress_numel} values too, fp32 values": fp32[
            "bytes_sent"
        ]
        - saved(big_one_d, 4),
        "compress every 1-D tensor too, fp32 values": fp32["bytes_sent"] - saved(one_d, 4),
        "compress every 1-D tensor too, fp16 values": fp16["bytes_sent"] - saved(one_d, 2),
        "fp32 values, dense part accumulated and sent every 4th step": fp32["bytes_sent"]
        - fp32["dense_exchange_bytes"] * 3 // 4,
    }
    return [
        {"change": name, "bytes_sent": int(b), "ratio": ddp / b, "reaches_target": ddp / b >= TARGET_RATIO}
        for name, b in options.items()
    ]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.traffic", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="skip the 66M-parameter LSTM")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args(argv)


def print_tables(rows: list[dict[str, Any]], verdict: dict[str, Any] | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 172))
    table = Table(
        title="Bytes per step per rank (hook accounting, 1-process gloo group, DDP's default buckets)"
    )
    columns = ("model", "algorithm", "density", "values", "sent", "indices+values", "padding", "control",
               "dense", "DDP", "ratio", "ctrl@8w", "buffers", "ratio+buf")  # fmt: skip
    for c in columns:
        table.add_column(c, justify="left" if c in ("model", "algorithm") else "right")
    for r in rows:
        table.add_row(
            r["model"], r["algorithm"], r["setting"], r["value_dtype"], f"{r['bytes_sent']:,}",
            f"{r['payload_bytes'] - r['control_bytes'] - r['padding_bytes']:,}", f"{r['padding_bytes']:,}",
            f"{r['control_bytes']:,}", f"{r['dense_exchange_bytes']:,}", f"{r['dense_bytes']:,}",
            f"{r['compression_ratio']:.1f}x", f"{r['control_at']['8']:,}" if r["control_at"] else "-",
            f"{r['buffer_broadcast_bytes']:,}", f"{r['ratio_with_buffers']:.1f}x",
        )  # fmt: skip
    console.print(table)
    if verdict is None:
        return
    console.print(
        f"Target: {TARGET_MODEL} at density {TARGET_DENSITY} >= {TARGET_RATIO:.0f}x less than dense: "
        + ("[green]met[/green]" if verdict["met"] else "[red]not met[/red]")
        + f" (best measured: {verdict['best_ratio']:.1f}x with {verdict['best']})"
    )
    for line in verdict["why"]:
        console.print(f"  {line}")
    options = Table(
        title=f"What would close it: DGC, {TARGET_MODEL}, density {TARGET_DENSITY} (projections "
        "from the measured parts; accuracy effects not measured)"
    )
    for c in ("change", "bytes sent", "ratio", f">= {TARGET_RATIO:.0f}x"):
        options.add_column(c, justify="left" if c == "change" else "right")
    for o in verdict["options"]:
        options.add_row(
            o["change"], f"{o['bytes_sent']:,}", f"{o['ratio']:.1f}x", "yes" if o["reaches_target"] else "no"
        )
    console.print(options)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    models = args.models or ([m for m in MODELS if m != "lstm"] if args.quick else list(MODELS))
    started_group = not dist.is_initialized()
    if started_group:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
            timeout=timedelta(minutes=5),
        )  # fmt: skip
    rows: list[dict[str, Any]] = []
    breakdowns: dict[str, dict[str, int]] = {}
    verdict: dict[str, Any] | None = None
    try:
        for model_name in models:
            torch.manual_seed(0)
            model = build_model(model_name, "cpu")
            buffers = buffer_broadcast_bytes(model)
            runs: list[tuple[str, str, str, algorithms.AlgorithmConfig, int]] = []
            for density in DENSITIES:
                breakdowns[f"{model_name}@{density:g}"] = dense_breakdown(model, density, "fp32")
                for name in SPARSE_ALGORITHMS:
                    for value_dtype in VALUE_DTYPES:
                        if name == "deft" and value_dtype == "int8":
                            continue  # DEFT refuses int8: it sums values in an all-reduce
                        config = algorithms.get(name).config_class(density=density, value_dtype=value_dtype)
                        runs.append((name, f"{density:g}", value_dtype, config, 2))
            for rank in POWERSGD_RANKS:
                config = PowerSGDConfig(matrix_approximation_rank=rank, start_iter=POWERSGD_START)
                runs.append(("powersgd", f"rank {rank}", "fp32", config, POWERSGD_START + 1))
            for name, setting, value_dtype, config, steps in runs:
                t0 = time.perf_counter()
                stats = measure(model, config, steps)
                row = {"model": model_name, "algorithm": name, "setting": setting, "value_dtype": value_dtype,
                       "density": getattr(config, "density", None),
                       "rank": getattr(config, "matrix_approximation_rank", None),
                       "parameters": sum(p.numel() for p in model.parameters()), **stats,
                       "buffer_broadcast_bytes": buffers, "seconds": time.perf_counter() - t0}  # fmt: skip
                row["ratio_with_buffers"] = (row["dense_bytes"] + buffers) / (row["bytes_sent"] + buffers)
                rows.append(row)
            if model_name == TARGET_MODEL:
                verdict = target_verdict(rows, breakdowns[f"{model_name}@{TARGET_DENSITY:g}"], model)
            del model
    finally:
        if started_group:
            dist.destroy_process_group()
    print_tables(rows, verdict)
    report = {
        "command": "python -m benchmarks.traffic " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {
            "densities": list(DENSITIES),
            "value_dtypes": list(VALUE_DTYPES),
            "powersgd_ranks": list(POWERSGD_RANKS),
            "powersgd_start_iter": POWERSGD_START,
            "ddp_buckets": "DDP default (first 1 MB, then 25 MB)",
            "world_size": 1,
            "min_compress_numel": DGCConfig().min_compress_numel,
            "torch": torch.__version__,
            "machine": platform.machine(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "target": verdict,
        "dense_breakdown": breakdowns,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return report


def target_verdict(rows: list[dict[str, Any]], breakdown: dict[str, int], model: nn.Module) -> dict[str, Any]:
    candidates = [r for r in rows if r["model"] == TARGET_MODEL and r["density"] == TARGET_DENSITY]
    best = max(candidates, key=lambda r: r["compression_ratio"])
    met = best["compression_ratio"] >= TARGET_RATIO
    dgc32 = next(r for r in candidates if r["algorithm"] == "dgc" and r["value_dtype"] == "fp32")
    sparse = dgc32["payload_bytes"] - dgc32["padding_bytes"]
    why = [
        f"DGC fp32: {dgc32['bytes_sent']:,} B sent = {sparse:,} B indices+values + "
        f"{dgc32['dense_exchange_bytes']:,} B dense + {dgc32['padding_bytes']} B padding; "
        f"DDP sends {dgc32['dense_bytes']:,} B.",
        f"The dense part is {dgc32['dense_exchange_bytes'] / dgc32['bytes_sent']:.0%} of what is sent: "
        f"{breakdown['one_d_bytes']:,} B of 1-D tensors (batch-norm scales/shifts, the fc bias) and "
        f"{breakdown['small_bytes']:,} B of tensors under {DGCConfig().min_compress_numel} values, "
        "averaged uncompressed (fp32 in this row).",
        f"Even with no dense part, a uint16 code + fp32 value per kept value caps the ratio at "
        f"{dgc32['dense_bytes'] / sparse:.0f}x at this density.",
    ]
    options = what_would_close_it([r for r in candidates if r["algorithm"] == "dgc"], model)
    return {"met": met, "best_ratio": best["compression_ratio"], "best": f"{best['algorithm']} {best['value_dtype']}",
            "limit": TARGET_RATIO, "why": why, "options": options}  # fmt: skip


if __name__ == "__main__":
    main()
