"""Overhead of the exchange: ``dgc`` at density 1 against stock DDP, and ResNet-20's compression ratio.

    .venv/bin/python -m benchmarks.overhead --quick
    .venv/bin/python -m benchmarks.overhead --models resnet20,lstm --rounds 6 --steps 10

Two processes on loopback (``MASTER_ADDR=127.0.0.1``, gloo on ``lo``, one compute thread each)
train the synthetic workloads of :data:`benchmarks.common.WORKLOADS`. Within one process pair the
strategies alternate, round after round: ``ddp`` (stock DDP), ``dgc_dense`` (``DGCStrategy(density=1)``:
DDP's own step through the compression hook, SGD's momentum applied after the all-reduce
(:mod:`lightning_dgc.exchange.passthrough`), so the difference to DDP is the hook's own cost) and ``dgc`` at density
0.001. Step time = the
median over every timed step of every round (each step from batch start to batch end); the
overhead ratio is ``dgc_dense`` / ``ddp`` (target: at most 1.1), also given as the median of the
per-round ratios.

The compression ratio is ``compression_stats()["compression_ratio"]`` of the ``dgc`` run at density
0.001 on ResNet-20: the bytes plain DDP would all-reduce divided by every byte the exchange puts on
the wire (indices, values, padding, and the tensors averaged dense: batch-norm parameters, the
first convolution and the classifier, which are too small to compress).

``--recipe`` times whole training steps of the CIFAR-10 CPU recipe's model instead
(``configs/cifar10_resnet20_cpu.yaml``: ResNet-20, 64 images per process, SGD with momentum): two
processes on loopback, one compute thread each, run ``ddp``, ``dgc`` (density 0.001), ``dgc_monitor``
(``dgc`` with :class:`~lightning_dgc.CompressionMonitor` logging every 10 steps), ``deft``, ``powersgd``
and ``dgc_trim_every_step`` (``dgc`` handing the heap's free pages back after every step,
``lightning_dgc.tensor_ops.heap.TRIM_AFTER_STEP_GROWTH_BYTES = 0``), one after the other, repeat after repeat (the
order rotating), every run with a TensorBoard logger and the Trainer logging every 10 steps. A step is the
time from one batch's start to the next's (forward, backward, exchange, optimizer, callbacks and
logging), on the wall clock and on the process's CPU clock (every thread; far less disturbed by other
load). Each run's figure is the median of its timed steps, each configuration's the median of its runs,
and its ratio to DDP also the median of the per-repeat ratios; as other load on a shared machine only
ever adds to a step, the lower quartile of every timed step is given too. The record keeps rank 0's step
times, the load average before and after, and every process's end-of-step trims, resident size and heap's
free bytes at the end of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
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
    if "recipe" in result:
        return recipe_targets(result)
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
    if "recipe" in result:
        return recipe_tables(result)
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


# -- whole steps of the CIFAR-10 CPU recipe (--recipe) ---------------------------------------------------------
RECIPE_FILE = "overhead_recipe.json"
#: The configurations of ``--recipe``, alternated repeat after repeat (the order rotating).
RECIPE_CONFIGS = ("ddp", "dgc", "dgc_monitor", "deft", "powersgd", "dgc_trim_every_step")
#: The CPU recipe's per-process batch (``configs/cifar10_resnet20_cpu.yaml``).
RECIPE_BATCH = 64
RECIPE_LOG_EVERY = 10
#: DGC's own cost on a fast link, in DDP's step time (target: dgc / ddp at most this); the monitor's,
#: in dgc's.
RECIPE_DGC_TARGET = 1.05
RECIPE_MONITOR_TARGET = 1.02


class _StepPeriod:
    """From one training batch's start to the next's (the last batch: to the end of fit): wall seconds, and the
    CPU seconds of the process (every thread; far less disturbed by other load on a shared machine)."""

    def __init__(self) -> None:
        import lightning as L

        class Timer(L.Callback):
            def __init__(timer) -> None:  # noqa: N805  (the outer object holds the figures)
                timer.starts: list[tuple[float, float]] = []

            def on_train_batch_start(timer, *args: Any) -> None:  # noqa: N805
                timer.starts.append((time.perf_counter(), time.process_time()))

            def on_train_end(timer, *args: Any) -> None:  # noqa: N805
                timer.starts.append((time.perf_counter(), time.process_time()))

        self.callback = Timer()

    def periods(self, clock: int = 0) -> list[float]:
        s = [start[clock] for start in self.callback.starts]
        return [b - a for a, b in zip(s, s[1:], strict=False)]


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def recipe_run(config: str, warmup: int, steps: int, logdir: Path) -> dict[str, Any]:
    """One run of ``config`` in this process (of 2): ``warmup + steps`` steps of ResNet-20 at the recipe's batch."""
    import lightning as L
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_dgc import CompressionMonitor
    from lightning_dgc.tensor_ops import heap

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    module, loader, _ = common.build_workload("resnet20", RECIPE_BATCH, (warmup + steps) * 2)
    strategy = {"dgc_monitor": "dgc", "dgc_trim_every_step": "dgc"}.get(config, config)
    timer = _StepPeriod()
    callbacks: list[Any] = [timer.callback]
    if config == "dgc_monitor":
        callbacks.insert(0, CompressionMonitor())
    growth = heap.TRIM_AFTER_STEP_GROWTH_BYTES
    if config == "dgc_trim_every_step":
        heap.TRIM_AFTER_STEP_GROWTH_BYTES = 0
    trims = heap.trims_after_step
    trainer = L.Trainer(
        accelerator="cpu", devices=1, num_nodes=2, strategy=common.make_strategy(strategy),
        max_steps=warmup + steps, max_epochs=1, limit_val_batches=0, num_sanity_val_steps=0,
        logger=TensorBoardLogger(str(logdir), name=config), log_every_n_steps=RECIPE_LOG_EVERY,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    try:
        trainer.fit(module, train_dataloaders=loader)
    finally:
        heap.TRIM_AFTER_STEP_GROWTH_BYTES = growth
    timed, cpu = timer.periods()[warmup:], timer.periods(clock=1)[warmup:]
    return {
        "config": config,
        "steps": len(timed),
        "step_times_s": timed,
        "step_time_s": common.median(timed),
        "step_cpu_times_s": cpu,
        "step_cpu_time_s": common.median(cpu),
        "trims_after_step": heap.trims_after_step - trims,
        "resident_bytes_end": _resident_bytes(),
        "free_heap_bytes_end": heap.free_heap_bytes(),
    }


def recipe_worker(args: argparse.Namespace) -> int:
    """One of the two processes of ``--recipe``: every repeat runs every configuration (rotated order)."""
    import logging
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    configs = args.configs
    runs: list[dict[str, Any]] = []
    rank = int(os.environ.get("NODE_RANK", "0"))
    out = args.worker_out.with_name(f"{args.worker_out.stem}.rank{rank}.json")
    for repeat in range(args.repeats):
        shift = repeat % len(configs)
        for config in configs[shift:] + configs[:shift]:
            if dist.is_available() and dist.is_initialized():
                dist.barrier()
            run = recipe_run(config, args.warmup, args.steps, args.worker_out.parent / "logs")
            runs.append({"repeat": repeat, **run})
            print(f"repeat {repeat} {config}: median step {run['step_time_s'] * 1e3:.1f} ms", flush=True)
            out.write_text(json.dumps({"rank": rank, "runs": runs}) + "\n")  # what ran, should a later run fail
    return 0


def _clock_summary(runs: list[dict[str, Any]], configs: Sequence[str], key: str) -> dict[str, Any]:
    """Medians of ``key`` (a run's median step) per configuration over the repeats, and ratios to ddp: of the
    medians, and the median of the per-repeat ratios (each repeat's runs ran next to each other)."""
    per_repeat: dict[str, dict[int, float]] = {c: {} for c in configs}
    for run in runs:
        per_repeat[run["config"]][run["repeat"]] = run[key]
    median = {c: common.median(list(v.values())) for c, v in per_repeat.items()}

    def ratio(c: str, base: str) -> dict[str, Any]:
        paired = [t / per_repeat[base][r] for r, t in per_repeat[c].items() if r in per_repeat[base]]
        return {"of_medians": median[c] / median[base], "paired_median": common.median(paired), "per_repeat": paired}

    steps_key = {"step_time_s": "step_times_s", "step_cpu_time_s": "step_cpu_times_s"}[key]
    every = {c: sorted(t for run in runs if run["config"] == c for t in run[steps_key]) for c in configs}
    quartile = {c: v[len(v) // 4] if v else float("nan") for c, v in every.items()}
    return {
        "step_s": median,
        "repeat_step_s": {c: [v[r] for r in sorted(v)] for c, v in per_repeat.items()},
        # the lower quartile of every timed step of every repeat: other load only ever adds to a step
        "lower_quartile_step_s": quartile,
        "lower_quartile_ratio_to_ddp": {c: quartile[c] / quartile["ddp"] for c in configs},
        "ratio_to_ddp": {c: ratio(c, "ddp") for c in configs},
        "monitor_over_dgc": ratio("dgc_monitor", "dgc"),
    }


def summarise_recipe(runs_by_rank: list[list[dict[str, Any]]], configs: Sequence[str]) -> dict[str, Any]:
    """Rank 0's step times (every step ends in collectives, so both ranks agree to within the exchange's
    jitter), wall and CPU clock; every rank's end-of-step trims and memory at the end of the runs."""
    memory = {
        c: {
            f"rank{rank}": {
                "trims_after_step": [r["trims_after_step"] for r in rs if r["config"] == c],
                "resident_mb_end": common.median([r["resident_bytes_end"] / 2**20 for r in rs if r["config"] == c]),
                "free_heap_mb_end": common.median(
                    [r["free_heap_bytes_end"] / 2**20 for r in rs if r["config"] == c and r["free_heap_bytes_end"]]
                ),
            }
            for rank, rs in enumerate(runs_by_rank)
        }
        for c in configs
    }
    return {
        "rank0_runs": [{k: [round(t, 5) for t in v] if isinstance(v, list) else v for k, v in run.items()}
                       for run in runs_by_rank[0]],  # fmt: skip
        "wall": _clock_summary(runs_by_rank[0], configs, "step_time_s"),
        "cpu": _clock_summary(runs_by_rank[0], configs, "step_cpu_time_s"),
        "memory": memory,
    }


def recipe_tables(result: dict[str, Any]) -> list[tuple[str, list[str], list[list[Any]]]]:
    s = result["summary"]
    rows = []
    for c in result["settings"]["configs"]:
        wall, cpu, mem = s["wall"], s["cpu"], s["memory"][c]["rank0"]
        rows.append([c, wall["step_s"][c] * 1e3, wall["ratio_to_ddp"][c]["of_medians"],
                     wall["ratio_to_ddp"][c]["paired_median"], wall["lower_quartile_ratio_to_ddp"][c],
                     cpu["step_s"][c] * 1e3, cpu["ratio_to_ddp"][c]["of_medians"],
                     cpu["ratio_to_ddp"][c]["paired_median"], cpu["lower_quartile_ratio_to_ddp"][c],
                     sum(mem["trims_after_step"]), mem["resident_mb_end"], mem["free_heap_mb_end"]])  # fmt: skip
    title = (f"Whole steps, ResNet-20 at {result['settings']['batch_size']} images per process, 2 processes on"
             f" loopback, {result['settings']['repeats']} interleaved repeats (rank 0)")  # fmt: skip
    columns = ["configuration", "wall ms", "/ ddp", "/ ddp per repeat", "/ ddp lower quartile", "CPU ms", "/ ddp",
               "/ ddp per repeat", "/ ddp lower quartile", "end-of-step trims", "resident MiB at the end",
               "heap free MiB at the end"]  # fmt: skip
    tgt = [[t["target"], t["value"], t["met"]] for t in recipe_targets(result)]
    return [(title, columns, rows), ("Overhead targets", ["target", "measured", "met"], tgt)]


def recipe_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for clock in ("wall", "cpu"):
        s = result["summary"][clock]
        dgc, mon = s["ratio_to_ddp"]["dgc"], s["monitor_over_dgc"]
        out += [
            {"target": f"resnet20 recipe: dgc / ddp step time ({clock}) <= {RECIPE_DGC_TARGET}",
             "value": f"{dgc['of_medians']:.3f} (per-repeat median {dgc['paired_median']:.3f})",
             "met": dgc["of_medians"] <= RECIPE_DGC_TARGET},
            {"target": f"resnet20 recipe: dgc with CompressionMonitor / dgc ({clock}) <= {RECIPE_MONITOR_TARGET}",
             "value": f"{mon['of_medians']:.3f} (per-repeat median {mon['paired_median']:.3f})",
             "met": mon["of_medians"] <= RECIPE_MONITOR_TARGET},
        ]  # fmt: skip
    return out


def run_recipe(args: argparse.Namespace) -> int:
    con = common.console()
    configs = list(args.configs)
    workdir = Path(tempfile.mkdtemp(prefix="dgc_overhead_recipe_"))
    load_before = list(os.getloadavg())
    errors: list[str] = []
    complete: list[int] = []
    t0 = time.perf_counter()
    con.print(f"[bold]resnet20 recipe[/bold]: {args.repeats} repeats of {', '.join(configs)} ...")
    try:
        port = common.free_port()
        procs = []
        for rank in (0, 1):
            env = common.distributed_env(rank, 2, "127.0.0.1", port, GLOO_SOCKET_IFNAME="lo")
            cmd = [common.python(), "-m", "benchmarks.overhead", "--recipe", "--configs", ",".join(configs),
                   "--repeats", str(args.repeats), "--warmup", str(args.warmup), "--steps", str(args.steps),
                   "--worker-out", str(workdir / "recipe.json")]  # fmt: skip
            procs.append(common.start(cmd, env, workdir / f"recipe.rank{rank}.log"))
        codes = common.wait_all(procs, args.timeout)
        outs = [workdir / f"recipe.rank{r}.json" for r in (0, 1)]
        runs_by_rank = [json.loads(o.read_text())["runs"] if o.exists() else [] for o in outs]
        complete = [r for r in range(args.repeats)
                    if all(sum(run["repeat"] == r for run in rs) == len(configs) for rs in runs_by_rank)]  # fmt: skip
        if codes != [0, 0]:
            logs = "\n".join(common.tail(workdir / f"recipe.rank{r}.log", 20) for r in (0, 1))
            errors.append(f"exit codes {codes}; complete repeats {complete}:\n{logs}")
            con.print(f"recipe run failed (exit codes {codes}); keeping the {len(complete)} complete repeats:", style="red")
            con.print(logs, markup=False)
        if not complete:
            return 1
        runs_by_rank = [[run for run in rs if run["repeat"] in complete] for rs in runs_by_rank]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result = {
        "recipe": "configs/cifar10_resnet20_cpu.yaml",
        "summary": summarise_recipe(runs_by_rank, configs),
        "settings": {"configs": configs, "repeats": len(complete), "repeats_asked": args.repeats,
                     "warmup_steps": args.warmup,
                     "timed_steps": args.steps, "batch_size": RECIPE_BATCH, "world_size": 2,
                     "threads_per_worker": 1, "log_every_n_steps": RECIPE_LOG_EVERY,
                     "density": common.DENSITY},  # fmt: skip
        "errors": errors,
        "load_average_before": load_before,
        "load_average_after": list(os.getloadavg()),
        "wall_s": time.perf_counter() - t0,
    }
    for title, columns, rows in recipe_tables(result):
        common.print_table(title, columns, rows)
    common.write_json(args.out or RECIPE_FILE, result)
    return 1 if errors else 0


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
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per run (default 2; --recipe: 10)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 4, full 8)")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--recipe", action="store_true",
                        help="whole steps of the CIFAR-10 CPU recipe's ResNet-20 (64 images per process) under"
                             " ddp, dgc, dgc with CompressionMonitor, deft, powersgd and dgc trimming every step;"
                             " writes results/overhead_recipe.json")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5, help="--recipe: repeats of every configuration")
    parser.add_argument("--configs", type=lambda s: s.split(","), default=list(RECIPE_CONFIGS),
                        help=f"--recipe: configurations (default {','.join(RECIPE_CONFIGS)}; ddp, dgc and"
                             " dgc_monitor are needed for the ratios)")  # fmt: skip
    parser.add_argument("--out", default=None, help="--recipe: result file name (default overhead_recipe.json)")
    parser.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.recipe:
        args.steps = args.steps or 20
        args.warmup = 10 if args.warmup is None else args.warmup
        if args.worker_out is not None:
            return recipe_worker(args)
        return run_recipe(args)
    args.warmup = 2 if args.warmup is None else args.warmup
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
