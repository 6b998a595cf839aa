"""Overhead of the exchange: ``dgc`` at density 1 against stock DDP, and ResNet-20's compression ratio.

    .venv/bin/python -m benchmarks.overhead --quick
    .venv/bin/python -m benchmarks.overhead --models resnet20,lstm --rounds 6 --steps 10

Two processes on loopback (``MASTER_ADDR=127.0.0.1``, gloo on ``lo``, one compute thread each)
train the synthetic workloads of :data:`benchmarks.common.WORKLOADS`. Within one process pair the
strategies alternate, round after round: ``ddp`` (stock DDP), ``dgc_dense`` (``DGCStrategy(density=1)``:
the hook runs momentum correction, the "full" path and decompression, and all-reduces everything,
so the difference to DDP is the hook's own cost) and ``dgc`` at density 0.001. Step time = the
median over every timed step of every round (each step from batch start to batch end); the
overhead ratio is ``dgc_dense`` / ``ddp`` (target: at most 1.1), also given as the median of the
per-round ratios.

The compression ratio is ``compression_stats()["compression_ratio"]`` of the ``dgc`` run at density
0.001 on ResNet-20: the bytes plain DDP would all-reduce divided by every byte the exchange puts on
the wire (indices, values, padding, and the tensors averaged dense: batch-norm parameters, the
first convolution and the classifier, which are too small to compress).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common

RESULT_FILE = "overhead.json"
STRATEGIES = ("ddp", "dgc_dense")  # alternated, round after round
ONCE = ("dgc",)  # after the rounds: the compression ratio at density 0.001
OVERHEAD_TARGET = 1.1


def pair_on_loopback(model: str, batch: int, rounds: int, warmup: int, steps: int, workdir: Path,
                     timeout_s: float) -> list[dict[str, Any]]:  # fmt: skip
    out = workdir / f"overhead_{model}.json"
    port = common.free_port()
    procs = []
    for rank in (0, 1):
        env = common.distributed_env(rank, 2, "127.0.0.1", port, GLOO_SOCKET_IFNAME="lo")
        cmd = [
            common.python(), "-m", "benchmarks.common", "--model", model, "--strategies", ",".join(STRATEGIES),
            "--batch-size", str(batch), "--warmup", str(warmup), "--steps", str(steps), "--rounds", str(rounds),
            "--once", ",".join(ONCE), "--num-nodes", "2", "--out", str(out),
        ]  # fmt: skip
        procs.append(common.start(cmd, env, workdir / f"overhead_{model}.rank{rank}.log"))
    codes = common.wait_all(procs, timeout_s)
    result = out.with_name(f"{out.stem}.rank0.json")
    if codes != [0, 0] or not result.exists():
        logs = "\n".join(common.tail(workdir / f"overhead_{model}.rank{r}.log", 15) for r in (0, 1))
        raise RuntimeError(f"overhead run of {model} failed (exit codes {codes}):\n{logs}")
    return json.loads(result.read_text())["runs"]


def summarise(model: str, batch: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    by: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by.setdefault(run["strategy"], []).append(run)
    steps = {s: [t for r in rs for t in r["step_times_s"]] for s, rs in by.items()}
    median = {s: common.median(ts) for s, ts in steps.items()}
    rounds = sorted({r["round"] for r in runs if r["strategy"] in STRATEGIES})
    per_round = {s: [r["step_time_s"] for r in by[s]] for s in STRATEGIES}
    paired = [d / b for d, b in zip(per_round["dgc_dense"], per_round["ddp"], strict=True)]
    last = (by.get("dgc") or [{}])[-1].get("compression_stats", {})
    return {
        "model": model,
        "batch_size": batch,
        "rounds": len(rounds),
        "step_time_s": median,
        "round_step_time_s": per_round,
        "overhead_ratio": median["dgc_dense"] / median["ddp"],
        "overhead_ratio_paired_median": common.median(paired),
        "overhead_ratio_per_round": paired,
        "dgc_over_ddp_ratio": median["dgc"] / median["ddp"] if "dgc" in median else None,
        "compression": {
            "density": last.get("density"),
            "compression_ratio": last.get("compression_ratio"),
            "bytes_sent": last.get("bytes_sent"),
            "payload_bytes": last.get("payload_bytes"),
            "dense_exchange_bytes": last.get("dense_exchange_bytes"),
            "padding_bytes": last.get("padding_bytes"),
            "control_bytes": last.get("control_bytes"),
            "dense_bytes": last.get("dense_bytes"),
            "values_sent": last.get("values_sent"),
            "numel": last.get("numel"),
        },
        "selection_ms": (by.get("dgc") or [{}])[-1].get("selection_ms"),
    }


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for m in result.get("models", []):
        out.append(
            {
                "target": f"{m['model']}: dgc(density=1) / ddp step time <= {OVERHEAD_TARGET}",
                "value": f"{m['overhead_ratio']:.3f} (per-round median {m['overhead_ratio_paired_median']:.3f})",
                "met": m["overhead_ratio"] <= OVERHEAD_TARGET,
                "note": "per-round ratios: " + ", ".join(f"{r:.2f}" for r in m["overhead_ratio_per_round"]),
            }
        )
    return out


def tables(result: dict[str, Any]) -> list[tuple[str, list[str], list[list[Any]]]]:
    rows = []
    for m in result.get("models", []):
        st = m["step_time_s"]
        rows.append(
            [
                m["model"],
                m["batch_size"],
                m["rounds"],
                st.get("ddp"),
                st.get("dgc_dense"),
                st.get("dgc"),
                m["overhead_ratio"],
                m["overhead_ratio_paired_median"],
                m.get("dgc_over_ddp_ratio"),
            ]  # fmt: skip
        )
    out = [
        (
            "Overhead: 2 processes on loopback, strategies interleaved (median step time, s)",
            [
                "model",
                "batch",
                "rounds",
                "ddp",
                "dgc density 1",
                "dgc density 0.001",
                "dgc(1)/ddp",
                "dgc(1)/ddp per-round median",
                "dgc(0.001)/ddp",
            ],  # fmt: skip
            rows,
        )
    ]
    comp = []
    for m in result.get("models", []):
        c = m["compression"]
        if c.get("compression_ratio") is None:
            continue
        comp.append(
            [
                m["model"],
                c["density"],
                c["dense_bytes"],
                c["bytes_sent"],
                c["payload_bytes"],
                c["padding_bytes"],
                c["dense_exchange_bytes"],
                c["compression_ratio"],
            ]  # fmt: skip
        )
    if comp:
        out.append(
            (
                "Compression ratio counting every byte (one optimizer step, per rank)",
                [
                    "model",
                    "density",
                    "DDP bytes",
                    "bytes sent",
                    "payload (idx+val)",
                    "padding",
                    "dense all-reduce",
                    "ratio",
                ],
                comp,
            )
        )
    tgt = [[t["target"], t["value"], t["met"]] for t in targets(result)]
    if tgt:
        out.append(("Overhead target", ["target", "measured", "met"], tgt))
    return out


def show(result: dict[str, Any]) -> None:
    for title, columns, rows in tables(result):
        common.print_table(title, columns, rows)


def plot(result: dict[str, Any]) -> None:
    plt = common.pyplot()
    models = result.get("models", [])
    if plt is None or not models:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.2), squeeze=False)
    for ax, m in zip(axes[0], models, strict=True):
        for strategy, times in m["round_step_time_s"].items():
            ax.plot(range(1, len(times) + 1), times, marker="o", label=strategy)
        ax.set_xlabel("round")
        ax.set_ylabel("median step time (s)")
        ax.set_title(f"{m['model']}: dgc(1)/ddp = {m['overhead_ratio']:.2f}")
        ax.legend(fontsize=8)
    common.save_figure(fig, "overhead.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.overhead", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="5 rounds of 4 timed steps, ResNet-20 and the LSTM"
    )
    parser.add_argument(
        "--models",
        type=lambda s: s.split(","),
        default=None,
        help="default: resnet20,lstm (full: also resnet110)",
    )
    parser.add_argument("--rounds", type=int, default=None, help="default 5 (full: 8)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 4, full 8)")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    models = args.models or (["resnet20", "lstm"] if args.quick else ["resnet20", "lstm", "resnet110"])
    rounds = args.rounds or (5 if args.quick else 8)
    steps = args.steps or (4 if args.quick else 8)
    con = common.console()
    workdir = Path(tempfile.mkdtemp(prefix="dgc_overhead_"))
    summaries, errors = [], []
    t0 = time.perf_counter()
    try:
        for model in models:
            batch = args.batch_size or common.WORKLOADS[model]["batch_size"]
            con.print(
                f"[bold]{model}[/bold]: {rounds} rounds of {', '.join(STRATEGIES)}, then {', '.join(ONCE)}, batch {batch} ..."
            )
            try:
                runs = pair_on_loopback(model, batch, rounds, args.warmup, steps, workdir, args.timeout)
            except RuntimeError as error:
                errors.append(str(error))
                con.print(f"[red]{error}[/red]")
                continue
            summaries.append(summarise(model, batch, runs))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result = {
        "quick": args.quick,
        "models": summaries,
        "errors": errors,
        "settings": {
            "warmup_steps": args.warmup,
            "timed_steps": steps,
            "rounds": rounds,
            "threads_per_worker": 1,
            "workloads": {m: common.WORKLOADS[m] for m in models},
        },  # fmt: skip
        "wall_s": time.perf_counter() - t0,
    }
    show(result)
    common.write_json(RESULT_FILE, result)
    plot(result)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
