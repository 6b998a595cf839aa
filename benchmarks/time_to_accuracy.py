"""Time to accuracy on shaped links: real recipe training against the wall clock, two nodes over a veth pair.

    sudo .venv/bin/python -m benchmarks.time_to_accuracy --quick --rates 10mbit,none
    sudo .venv/bin/python -m benchmarks.time_to_accuracy --rates 10mbit,100mbit,1gbit,none --seeds 42,43

Setup (root, ``ip`` and ``tc`` from iproute2; otherwise skipped with a message): the emulated link of
:mod:`benchmarks.netns`, two network namespaces joined by a veth pair whose ends are shaped with ``tc tbf``
(``--delay`` adds a delay each way, a round trip of twice it: ``netem``, or the delay line of
:mod:`benchmarks.link_delay` where the kernel has no ``netem``; one delay per invocation, on every link). Each
rate of ``--rates`` is one link: ``10mbit``, ``1gbit``, or ``none`` (unshaped: the compute-only bound). One node
per namespace, one process each (``Trainer(num_nodes=2, devices=1)``, gloo bound to the veth, one compute thread
each).

Each run is a recipe, ``python -m lightning_dgc_recipes fit`` with the task's CPU config and the method's
algorithm config, as :mod:`benchmarks.parity` builds it (the same global batch, warm-up and learning-rate
schedule), evaluated every ``val_every`` optimizer steps; :class:`benchmarks.common.RunRecorder` writes each
evaluation's wall-clock since launch, evaluation time so far, step, metrics and bytes. Methods: ``ddp``,
``dgc`` (the recommended recipe, ``configs/algo/dgc_regimes.yaml``: the warm-up and the critical regimes),
``dgc_adamw`` (``configs/algo/dgc_adamw.yaml``: density 0.01, int8 values, a lighter warm-up), ``deft``,
``powersgd``, ``auto`` (DGC with ``density="auto"``), ``diloco``
(``configs/algo/diloco.yaml``) and ``streaming`` (``configs/algo/diloco_streaming.yaml``);
:data:`METHODS` maps each to a :data:`benchmarks.parity.ALGO_SPECS` entry (add one there and here for a new
method). ``--append`` adds this invocation's runs to the record of the same name (a run of the same task,
method, link and seed is replaced), so that the links and methods can be measured in separate invocations.

The report, per task: the target is DDP's final metric (mean over its seeds) minus 0.5 points of accuracy
(perplexity: plus 2%); each method's time to reach it on each link is the wall-clock since launch less the
evaluations' time, mean over seeds (where some seeds never reached it: how many did, and the best metric of the
others; 'not reached' with the best metric where none did); DDP's scaling efficiency per link is the compute-only
step (DDP's median step on the unshaped link) over DDP's step there. The plot draws the metric against the
wall-clock per link, with DDP's unshaped curve as the compute-only bound.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks import common, parity
from benchmarks.netns import ADDRESSES, INTERFACES, SlowLink, missing_requirements
from lightning_dgc.algorithms.base import ring_allreduce_volume

#: method -> its entry of :data:`benchmarks.parity.ALGO_SPECS` (algorithm YAML, extra arguments, warm-up).
METHODS: dict[str, str] = {"ddp": "ddp", "dgc": "dgc_regimes_warmup", "dgc_adamw": "dgc_density_0.01_int8_light_warmup",
                           "deft": "deft", "powersgd": "powersgd", "auto": "dgc_auto", "diloco": "diloco",
                           "streaming": "diloco_streaming", "dgc_1pct_int8": "dgc_1pct_int8",
                           "dgc_warmup": "dgc"}  # fmt: skip
TASKS = ("cifar10", "ptb", "cifar10_full")
#: task -> (epochs, train batches per epoch, evaluate every this many optimizer steps): whole batches only,
#: so that the evaluations fall evenly and the last one ends the run.
#: ``cifar10_full``: the long protocol's short shaped run, which prices its steps (:mod:`benchmarks.composed`)
SCHEDULES: dict[str, tuple[int, int, int]] = {"cifar10": (10, 78, 39), "ptb": (4, 630, 126), "cifar10_full": (1, 312, 39)}
QUICK = (1, 24, 8)  # epochs, batches, evaluate every; with 4 validation batches
QUICK_VAL_BATCHES = 4
MASTER_PORT = 29537


def parse_rate(text: str) -> float | None:
    """``"10mbit"`` -> 10.0 (Mbit/s), ``"1gbit"`` -> 1000.0, ``"500kbit"`` -> 0.5, ``"none"`` -> ``None``."""
    text = text.strip().lower()
    if text in ("none", "unshaped", "0"):
        return None
    match = re.fullmatch(r"([0-9.]+)\s*(k|m|g)?(bit|bps)?", text)
    if not match:
        raise argparse.ArgumentTypeError(f"a rate is like 10mbit, 1gbit, 500kbit or none, got {text!r}")
    return float(match.group(1)) * {"k": 1e-3, "m": 1.0, "g": 1e3, None: 1.0}[match.group(2)]


def parse_delay(text: str) -> float:
    match = re.fullmatch(r"([0-9.]+)\s*(ms)?", text.strip().lower())
    if not match:
        raise argparse.ArgumentTypeError(f"a delay is like 10ms, got {text!r}")
    return float(match.group(1))


def parse_schedule(text: str) -> tuple[int, int, int]:
    """``"1,315,63"`` -> (epochs, train batches per epoch, evaluate every this many steps), each >= 1."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(
            f"a schedule is EPOCHS,BATCHES,EVERY (whole numbers >= 1, e.g. 1,315,63), got {text!r}"
        )
    epochs, batches, every = (int(p) for p in parts)
    if batches % every:
        raise argparse.ArgumentTypeError(
            f"the evaluations must fall evenly: BATCHES ({batches}) must be a multiple of EVERY ({every})"
        )
    return epochs, batches, every


def schedule_of(args: argparse.Namespace, task: str) -> tuple[int, int, int]:
    """The run's (epochs, batches, evaluate every): ``--quick``'s, ``--schedule``'s, or the task's own."""
    return QUICK if args.quick else (args.schedule or SCHEDULES[task])


def link_name(mbit: float | None) -> str:
    return "none" if mbit is None else (f"{mbit / 1e3:g}gbit" if mbit >= 1e3 else f"{mbit:g}mbit")


# -- one run -------------------------------------------------------------------------------------------------
def run_argv(args: argparse.Namespace, task: parity.Task, method: str, link: str, seed: int, workdir: Path
             ) -> tuple[list[str], Path]:  # fmt: skip
    """The recipe's command for one node (both run the same) and its record's path."""
    epochs, batches, val_every = schedule_of(args, task.name)
    name = f"{args.name}/{link}"
    task = replace(task, resumable=False)  # a run of minutes: no checkpoints to resume from
    argv, record = parity.command(task, METHODS[method], args.data_root, epochs, batches, workdir, name=name,
                                  seed=seed)  # fmt: skip
    argv += ["--trainer.devices", "1", "--trainer.num_nodes", "2", "--trainer.check_val_every_n_epoch", "null",
             "--trainer.val_check_interval", str(args.val_every or val_every)]  # fmt: skip
    if args.quick or args.val_batches:
        argv += ["--trainer.limit_val_batches", str(args.val_batches or QUICK_VAL_BATCHES)]
    return argv, record


def run_pair(link: SlowLink, argv: list[str], record: Path, workdir: Path, timeout_s: float) -> dict[str, Any]:
    """Both nodes' processes, one per namespace; the record rank 0 wrote."""
    record.unlink(missing_ok=True)
    launch = time.time()
    procs = []
    for side in (0, 1):
        env = common.distributed_env(side, 2, ADDRESSES[0], MASTER_PORT, GLOO_SOCKET_IFNAME=INTERFACES[side],
                                     **{common.LAUNCH_ENV: repr(launch)})  # fmt: skip
        procs.append(common.start([*link.exec_prefix(side), *argv], env, workdir / f"node{side}.log"))
    codes = common.wait_all(procs, timeout_s)
    if codes != [0, 0] or not record.exists():
        logs = "\n".join(common.tail(workdir / f"node{side}.log", 15) for side in (0, 1))
        raise RuntimeError(f"run failed (exit codes {codes}):\n{logs}")
    return {**json.loads(record.read_text()), "launch_to_exit_s": time.time() - launch}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every run, interleaved: for each task and seed, each method on each link in turn (so that a change in
    the machine's load spreads over every cell rather than one link's)."""
    con = common.console()
    runs: list[dict[str, Any]] = []
    links: list[dict[str, Any]] = []
    errors: list[str] = []
    with SlowLink() as link:
        for mbit in args.rates:  # each shaped link's TCP goodput, once
            link.set_rate(mbit, args.delay)
            goodput = link.measure_mbit(seconds=min(2.0, max(0.5, 50 / mbit))) if mbit is not None else None
            links.append({"link": link_name(mbit), "rate_mbit": mbit, "delay_ms": args.delay,
                          "measured_goodput_mbit": goodput})  # fmt: skip
            con.print(f"[bold]link {link_name(mbit)}[/bold]" + (f": TCP goodput {goodput:.3g} Mbit/s" if goodput else ""))
        for task_name in args.tasks:
            task = parity.TASKS[task_name]
            for seed in args.seeds:
                for method in args.methods:
                    for mbit in args.rates:
                        link.set_rate(mbit, args.delay)
                        try:
                            runs.append(one_run(args, link, task, method, link_name(mbit), seed))
                        except RuntimeError as error:
                            errors.append(f"{task_name} {method} {link_name(mbit)} seed {seed}: {error}")
                            con.print(f"[red]{errors[-1]}[/red]")
    return {"runs": runs, "links": links, "errors": errors}


def one_run(args: argparse.Namespace, link: SlowLink, task: parity.Task, method: str, name: str, seed: int
            ) -> dict[str, Any]:  # fmt: skip
    """One recipe run on the link as it is shaped now: its record, summarised."""
    workdir = Path(tempfile.mkdtemp(prefix="dgc_tta_"))
    argv, record = run_argv(args, task, method, name, seed, workdir)
    try:
        out = run_pair(link, argv, record, workdir, args.timeout)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if method == "ddp":  # DDP reports no bytes: its ring all-reduce of the fp32 gradient
        for entry in out.get("history", []):
            entry["link_bytes"] = entry["step"] * ring_allreduce_volume(4 * out.get("params", 0), 2)
    final = out.get("final", {}).get(task.metric)
    common.console().print(f"  {task.name} {method} {name} seed {seed}: {task.metric} {final}, step"
                           f" {out.get('median_step_s')} s, {out['launch_to_exit_s']:.0f} s in all")  # fmt: skip
    return {
        "task": task.name, "method": method, "link": name, "seed": seed, "record": str(record.relative_to(common.REPO)),
        "command": parity.display_command(argv, workdir), "history": out.get("history", []),
        "final": out.get("final", {}), "median_step_s": out.get("median_step_s"),
        "compression": out.get("compression"), "densities": out.get("densities"), "auto": out.get("auto"),
        "global_step": out.get("global_step"), "launch_to_exit_s": out["launch_to_exit_s"],
    }  # fmt: skip


def merged(path: Path, new: dict[str, Any]) -> dict[str, Any]:
    """``new``'s runs, links and errors added to the record at ``path`` (a run of the same task, method, link and
    seed replaces the old one; a link measured again replaces its goodput)."""
    if not path.exists():
        return new
    old = json.loads(path.read_text())
    key = lambda r: (r["task"], r["method"], r["link"], r["seed"])  # noqa: E731
    fresh = {key(r) for r in new["runs"]}
    links = {lk["link"]: lk for lk in old.get("links", []) + new["links"]}
    return {"runs": [r for r in old.get("runs", []) if key(r) not in fresh] + new["runs"],
            "links": list(links.values()), "errors": old.get("errors", []) + new["errors"]}  # fmt: skip


# -- the report ------------------------------------------------------------------------------------------------
def target(task: parity.Task, ddp_finals: list[float]) -> float | None:
    """DDP's final metric (mean) minus the task's tolerance: 0.5 points of accuracy, or perplexity plus 2%."""
    if not ddp_finals:
        return None
    final = statistics.mean(ddp_finals)
    if task.relative:
        return final * (1 - task.tolerance) if task.higher_is_better else final * (1 + task.tolerance)
    return final - task.tolerance if task.higher_is_better else final + task.tolerance


def time_to(history: list[dict[str, Any]], metric: str, goal: float, higher: bool) -> float | None:
    """Wall-clock since launch, less the evaluations, at the first evaluation that reaches ``goal``."""
    for entry in history:
        value = entry.get(metric)
        if value is not None and (value >= goal if higher else value <= goal):
            return entry["wall_s"] - entry.get("val_s", 0.0)
    return None


def report(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per task, link and method: time to target (mean over seeds) or the best metric, the step."""
    rows = []
    runs = result.get("runs", [])
    for task_name in dict.fromkeys(r["task"] for r in runs):
        task = parity.TASKS[task_name]
        mine = [r for r in runs if r["task"] == task_name]
        by_seed: dict[int, list[float]] = {}  # DDP's final metric per seed (each link trains the same run)
        for r in mine:
            if r["method"] == "ddp" and task.metric in r["final"]:
                by_seed.setdefault(r["seed"], []).append(r["final"][task.metric])
        goal = target(task, [statistics.mean(v) for v in by_seed.values()])
        bound = [r["median_step_s"] for r in mine if r["method"] == "ddp" and r["link"] == "none" and r["median_step_s"]]
        compute_only = statistics.mean(bound) if bound else None
        for link in dict.fromkeys(r["link"] for r in mine):
            for method in dict.fromkeys(r["method"] for r in mine):
                seeds = [r for r in mine if (r["link"], r["method"]) == (link, method)]
                if not seeds:
                    continue
                times = [time_to(r["history"], task.metric, goal, task.higher_is_better) if goal is not None else None
                         for r in seeds]  # fmt: skip
                values = [[h[task.metric] for h in r["history"] if task.metric in h] for r in seeds]
                best = [(max(v) if task.higher_is_better else min(v)) for v in values if v]
                steps = [r["median_step_s"] for r in seeds if r["median_step_s"]]
                step = statistics.mean(steps) if steps else None
                rows.append({
                    "task": task_name, "link": link, "method": method, "seeds": len(seeds), "target": goal,
                    "time_to_target_s": statistics.mean(times) if all(t is not None for t in times) else None,
                    "reached": sum(t is not None for t in times), "best": statistics.mean(best) if best else None,
                    "final": statistics.mean([r["final"].get(task.metric, math.nan) for r in seeds]),
                    "median_step_s": step,
                    "ddp_efficiency": compute_only / step if method == "ddp" and compute_only and step else None,
                })  # fmt: skip
    return rows


def markdown_levels(result: dict[str, Any], task_name: str = "cifar10") -> list[str]:
    """The docs' table of the time to each of the task's :data:`LEVELS` (:func:`milestones`), per link and method."""
    levels = LEVELS[task_name]
    lines = ["| link | method | " + " | ".join(f"{100 * g:.0f}%" for g in levels) + " |",
             "|" + " --- |" * (len(levels) + 2)]  # fmt: skip
    for link, method, *cells in milestones(result, task_name, levels):
        lines.append(f"| {link_label(link)} | {METHOD_LABELS.get(method, method)} | " + " | ".join(cells) + " |")
    return lines


def markdown_time_split(result: dict[str, Any]) -> list[str]:
    """The docs' table of where a step's time goes (:func:`where_time_goes`), in milliseconds, shaped links only."""
    lines = ["| link | method | step | compute | selection | the rest: exchange, other hook work, waits | model's step |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    ms = lambda x: "-" if x is None else f"{1e3 * x:.0f}"  # noqa: E731
    for w in result.get("time_split") or where_time_goes(result):
        if w["link"] != "none":
            lines.append(f"| {link_label(w['link'])} | {METHOD_LABELS.get(w['method'], w['method'])} | {ms(w['step_s'])} |"
                         f" {ms(w['compute_s'])} | {ms(w['selection_s'])} | {ms(w['rest_s'])} | {ms(w['predicted_step_s'])} |")  # fmt: skip
    return lines


#: method -> the performance model's name for its exchange at the final density (``None``: not modelled).
MODELLED = {"ddp": "ddp", "dgc": "dgc", "dgc_adamw": None, "auto": None, "deft": "deft", "powersgd": "powersgd",
            "diloco": None, "streaming": None, "dgc_warmup": "dgc"}  # fmt: skip


def where_time_goes(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per task, link and method: the median step split into compute (DDP's median step unshaped: the
    compute-only bound), selection (the run's recorded ``selection_ms`` per step) and the rest (the exchange and its waits),
    beside the performance model's step (:func:`lightning_dgc.perfmodel.step_time`, at the final density, on the
    link's measured goodput, with that compute and selection). Means over seeds."""
    from lightning_dgc.perfmodel import Network, step_time

    runs = result.get("runs", [])
    goodput = {lk["link"]: lk["measured_goodput_mbit"] for lk in result.get("links", [])}
    out = []
    for task_name in dict.fromkeys(r["task"] for r in runs):
        mine = [r for r in runs if r["task"] == task_name]
        bound = [r["median_step_s"] for r in mine if (r["method"], r["link"]) == ("ddp", "none") and r["median_step_s"]]
        if not bound:
            continue
        compute = statistics.mean(bound)
        profile = _profile(task_name, compute)
        for link in dict.fromkeys(r["link"] for r in mine):
            for method in dict.fromkeys(r["method"] for r in mine):
                seeds = [r for r in mine if (r["link"], r["method"]) == (link, method) and r["median_step_s"]]
                if not seeds:
                    continue
                step = statistics.mean(r["median_step_s"] for r in seeds)
                selection = statistics.mean(_selection_per_step_s(r) for r in seeds)
                predicted = None
                name = MODELLED.get(method)
                if profile is not None and name is not None and goodput.get(link):
                    modelled = replace(profile, selection_s=selection if name in ("dgc", "deft") else 0.0)
                    predicted = step_time(modelled, name, 2, Network(bandwidth=goodput[link] * 1e6)).total_s
                out.append({"task": task_name, "link": link, "method": method, "step_s": step, "compute_s": compute,
                            "selection_s": selection, "rest_s": step - compute - selection,
                            "predicted_step_s": predicted})  # fmt: skip
    return out


def _selection_per_step_s(run: dict[str, Any]) -> float:
    """The run's selection time per optimizer step (its record sums ``selection_ms`` over the steps)."""
    stats = run.get("compression") or {}
    return stats.get("selection_ms", 0.0) / 1e3 / max(1, stats.get("steps", 1))


def _profile(task_name: str, compute_s: float) -> Any:
    """The performance model's profile of the task's model (its buckets as DDP makes them), or ``None``."""
    if task_name != "cifar10":
        return None
    from lightning_dgc.front.profiler import bucket_layout, bucket_profiles
    from lightning_dgc.perfmodel import Profile
    from lightning_dgc_recipes.vision import ImageClassifier

    net = ImageClassifier(arch="resnet20", num_classes=10)
    return Profile("resnet20", bucket_profiles(bucket_layout(net)), compute_s=compute_s, selection_s=0.0,
                   density=0.001, configs={"powersgd": {"matrix_approximation_rank": 2}}, batch_size=64)  # fmt: skip


def tables(result: dict[str, Any]) -> list[tuple[str, list[str], list[list[Any]]]]:
    """(title, columns, rows) of the report, for the terminal and ``benchmarks.report``."""
    columns = ["task", "link", "method", "target", "time to target s", "best (mean)", "step s", "DDP efficiency"]
    table = []
    for r in result.get("report") or report(result):
        reached = (f"{r['time_to_target_s']:.0f}" if r["time_to_target_s"] is not None
                   else f"not reached ({r['reached']}/{r['seeds']} seeds)")  # fmt: skip
        eff = None if r["ddp_efficiency"] is None else f"{r['ddp_efficiency']:.0%}"
        table.append([r["task"], r["link"], r["method"], r["target"], reached, r["best"], r["median_step_s"], eff])
    links = [[lk["link"], lk["measured_goodput_mbit"]] for lk in result.get("links", [])]
    ms = lambda x: None if x is None else round(1e3 * x)  # noqa: E731
    split = [[w["task"], w["link"], w["method"], ms(w["step_s"]), ms(w["compute_s"]), ms(w["selection_s"]),
              ms(w["rest_s"]), ms(w["predicted_step_s"])] for w in result.get("time_split") or where_time_goes(result)]  # fmt: skip
    return [("Time to accuracy on shaped links (2 nodes x 1 process)", columns, table),
            ("Where a step's time goes (ms; compute: DDP's step unshaped)",
             ["task", "link", "method", "step", "compute", "selection", "exchange and waits", "model's step"], split),
            *[(f"{task}: time to these levels (mean over the seeds that reached it)",
               ["link", "method", *[f"{100 * g:.0f}%" for g in LEVELS[task]]], milestones(result, task, LEVELS[task]))
              for task in dict.fromkeys(r["task"] for r in result.get("runs", [])) if task in LEVELS],
            ("Link check: TCP goodput", ["link", "measured Mbit/s"], links)]  # fmt: skip


def milestones(result: dict[str, Any], task_name: str, goals: Sequence[float]) -> list[list[Any]]:
    """Per link and method: the time to each of ``goals`` (mean over the seeds that reached it, and how many of
    them did), for the curve's shape between the first evaluation and the target."""
    task = parity.TASKS[task_name]
    runs = [r for r in result.get("runs", []) if r["task"] == task_name]
    rows = []
    for link in dict.fromkeys(r["link"] for r in runs):
        for method in dict.fromkeys(r["method"] for r in runs):
            seeds = [r for r in runs if (r["link"], r["method"]) == (link, method)]
            if not seeds:
                continue
            cells = []
            for goal in goals:
                times = [t for r in seeds if (t := time_to(r["history"], task.metric, goal, task.higher_is_better)) is not None]
                cells.append(f"{statistics.mean(times):.0f} s" + (f" ({len(times)}/{len(seeds)})" if len(times) < len(seeds) else "")
                             if times else "not reached")  # fmt: skip
            rows.append([link, method, *cells])
    return rows


#: How the README names each method (its column).
METHOD_LABELS = {"ddp": "`ddp`", "dgc": "`algo/dgc_regimes`", "dgc_adamw": "`algo/dgc_1pct_int8`",
                 "auto": '`density="auto"`', "deft": "`deft`", "powersgd": "`powersgd`", "diloco": "`algo/diloco`",
                 "streaming": "`algo/diloco_streaming`", "dgc_warmup": "`algo/dgc_warmup`"}  # fmt: skip


#: A lower level than the target, reported beside it (the task's metric): what the compressed methods reach
#: on the 10-epoch CIFAR schedule, where few reach DDP's final accuracy.
MILESTONE = {"cifar10": 0.58}
#: The levels of the terminal's and the docs' table of times (:func:`milestones`).
LEVELS = {"cifar10": (0.45, 0.5, 0.55, 0.58, 0.6)}


def link_label(link: str) -> str:
    return "unshaped" if link == "none" else link.replace("mbit", " Mbit/s").replace("gbit", " Gbit/s")


def markdown_table(result: dict[str, Any], task_name: str = "cifar10") -> list[str]:
    """The README's headline: one row per method, for each shaped link two columns: the time to the task's
    :data:`MILESTONE` and to the target (means over seeds), each with how much sooner than DDP on that link; where
    only some seeds reached it, how many, their mean time and the best metric of the others; where none did, 'not
    reached' with the best metric. A first row gives DDP unshaped (the compute-only bound)."""
    task = parity.TASKS[task_name]
    runs = [r for r in result.get("runs", []) if r["task"] == task_name]
    rows = [r for r in result.get("report") or report(result) if r["task"] == task_name]
    goal = rows[0]["target"] if rows else None
    milestone = MILESTONE.get(task_name)
    links = sorted({r["link"] for r in runs if r["link"] != "none"}, key=lambda lk: parse_rate(lk) or math.inf)
    methods = [m for m in METHOD_LABELS if any(r["method"] == m for r in runs)]

    def pct(x: float, digits: int = 1) -> str:  # a best metric with the target's two digits: compared with it
        return f"{100 * x:.{digits}f}%" if task.metric == "val_acc" else f"{x:.{digits}f}"

    def cell(link: str, method: str, level: float | None) -> str:
        seeds = [r for r in runs if (r["link"], r["method"]) == (link, method)]
        if not seeds or level is None:
            return "not run"
        times = [time_to(r["history"], task.metric, level, task.higher_is_better) for r in seeds]
        if any(t is None for t in times):
            short = [r for r, t in zip(seeds, times, strict=True) if t is None]  # the seeds that never reached it
            values = [h[task.metric] for r in short for h in r["history"] if task.metric in h]
            best = max(values) if task.higher_is_better else min(values)
            reached = [t for t in times if t is not None]
            if not reached:
                return f"not reached (best {pct(best, 2)})"
            return f"{len(reached)}/{len(seeds)} seeds, in {statistics.mean(reached):.0f} s; the others' best {pct(best, 2)}"
        t = statistics.mean(times)  # type: ignore[type-var]
        ddp = [time_to(r["history"], task.metric, level, task.higher_is_better)
               for r in runs if (r["link"], r["method"]) == (link, "ddp")]  # fmt: skip
        if method == "auto" and all((r.get("auto") or {}).get("auto_density") == 1.0 for r in seeds):
            return f"{t:.0f} s (chose dense: DDP's step)"  # a ratio to DDP here would be noise between two DDP runs
        sooner = statistics.mean(ddp) / t if ddp and None not in ddp and method != "ddp" else None  # type: ignore[type-var]
        return f"{t:.0f} s" + (f" ({sooner:.2f}x)" if sooner else "")

    efficiency = {r["link"]: r["ddp_efficiency"] for r in rows if r["method"] == "ddp"}
    header = ["method"]
    for link in links:
        eff = f", DDP efficiency {efficiency[link]:.0%}" if efficiency.get(link) else ""
        target = (f"{100 * goal:.2f}%" if task.metric == "val_acc" else f"{goal:.2f}") if goal is not None else ""
        lead = f"{link_label(link)}{eff}: "  # on the first of the link's columns
        header += [f"{lead}to {pct(milestone)}" if milestone is not None else "",
                   f"{'' if milestone is not None else lead}to {target} (DDP's final"
                   f" {'- 0.5 points' if not task.relative else '+ 2%'})" if target else ""]  # fmt: skip
    lines = ["| " + " | ".join(h for h in header if h) + " |", "|" + " --- |" * len([h for h in header if h])]
    if any(r["link"] == "none" and r["method"] == "ddp" for r in runs):
        bound = [cell("none", "ddp", lv) for link in links for lv in (milestone, goal) if lv is not None]
        n = len({r["seed"] for r in runs if (r["link"], r["method"]) == ("none", "ddp")})
        lines.append(f"| `ddp` unshaped (compute only; {n} seed{'s' if n > 1 else ''}) | " + " | ".join(bound) + " |")
    for method in methods:
        cells = [cell(link, method, lv) for link in links for lv in (milestone, goal) if lv is not None]
        lines.append(f"| {METHOD_LABELS[method]} | " + " | ".join(cells) + " |")
    return lines


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """No pass/fail targets: the study reports times (``benchmarks.report`` asks every benchmark)."""
    return []


def show(result: dict[str, Any]) -> None:
    for title, columns, rows in tables(result):
        common.print_table(title, columns, rows)


def plot(result: dict[str, Any], name: str) -> None:
    plt = common.pyplot()
    runs = result.get("runs", [])
    if plt is None or not runs:
        return
    tasks = list(dict.fromkeys(r["task"] for r in runs))
    links = list(dict.fromkeys(r["link"] for r in runs))
    fig, axes = plt.subplots(len(tasks), len(links), figsize=(4.2 * len(links), 3.4 * len(tasks)), squeeze=False)
    colors = {m: f"C{i}" for i, m in enumerate(METHODS)}
    for row, task_name in zip(axes, tasks, strict=True):
        task = parity.TASKS[task_name]
        bound = [r for r in runs if (r["task"], r["method"], r["link"]) == (task_name, "ddp", "none")]
        for ax, link in zip(row, links, strict=True):
            if bound:
                h = [e for e in bound[0]["history"] if task.metric in e]
                ax.plot([(e["wall_s"] - e.get("val_s", 0)) / 60 for e in h], [e[task.metric] for e in h], color="grey",
                        ls="--", lw=1, label="compute only (DDP, unshaped)")  # fmt: skip
            for r in runs:
                if (r["task"], r["link"]) != (task_name, link):
                    continue
                h = [e for e in r["history"] if task.metric in e]
                first = r["seed"] == min(x["seed"] for x in runs if (x["task"], x["link"], x["method"]) == (task_name, link, r["method"]))
                ax.plot([(e["wall_s"] - e.get("val_s", 0)) / 60 for e in h], [e[task.metric] for e in h],
                        color=colors.get(r["method"]), lw=1.2, alpha=1 if first else 0.4,
                        label=r["method"] if first else None)  # fmt: skip
            ax.set_title(f"{task_name}, link {link}")
            ax.set_xlabel("wall-clock since launch, evaluations excluded (min)")
            ax.set_ylabel(task.metric_label)
        for ax in row:
            ax.legend(fontsize=6)
    common.save_figure(fig, f"{name}.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.time_to_accuracy",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--quick", action="store_true", help=f"smoke test: {QUICK[1]} steps, evaluated every {QUICK[2]}")
    parser.add_argument("--rates", type=lambda s: [parse_rate(x) for x in s.split(",")], default=[10.0, 100.0, None],
                        help="links, comma-separated: 10mbit, 1gbit, none (unshaped) (default 10mbit,100mbit,none)")  # fmt: skip
    parser.add_argument("--delay", type=parse_delay, default=None,
                        help="extra delay each way, e.g. 40ms for an 80 ms round trip (netem, or benchmarks.link_delay)")  # fmt: skip
    parser.add_argument("--tasks", type=lambda s: s.split(","), default=["cifar10", "ptb"],
                        help=f"of {', '.join(TASKS)} (cifar10_full: the long protocol's short shaped runs, only when named)")
    parser.add_argument("--methods", type=lambda s: s.split(","), default=list(METHODS),
                        help=f"of {', '.join(METHODS)}")  # fmt: skip
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[42])
    parser.add_argument("--val-batches", type=int, default=None,
                        help="evaluate on this many batches (default all; a run that only prices steps needs few)")
    parser.add_argument("--val-every", type=int, default=None, help="evaluate every this many steps (default per task)")
    parser.add_argument("--schedule", type=parse_schedule, default=None,
                        help="EPOCHS,BATCHES,EVERY for every task of this invocation (a shorter run; give it its own"
                             " --name): epochs, train batches per epoch, evaluate every this many steps")  # fmt: skip
    parser.add_argument("--data-root", type=Path, default=common.REPO.parent / "shared" / "data")
    parser.add_argument("--timeout", type=float, default=6 * 3600, help="seconds per run")
    parser.add_argument("--report-only", action="store_true",
                        help="no training: rebuild the report, tables and plot of the record of --name")
    parser.add_argument("--append", action="store_true",
                        help="add these runs to the record of the same name (same task, method, link, seed: replaced)")
    parser.add_argument("--name", default=None, help="results/<name>.json and .png (default time_to_accuracy[_quick])")
    args = parser.parse_args(argv)
    args.name = args.name or ("time_to_accuracy_quick" if args.quick else "time_to_accuracy")
    unknown = [m for m in args.methods if m not in METHODS] + [t for t in args.tasks if t not in TASKS]
    if unknown:
        parser.error(f"unknown method or task {unknown[0]!r}: methods {list(METHODS)}, tasks {list(TASKS)}")
    if args.report_only:
        result = json.loads((common.RESULTS / f"{args.name}.json").read_text())
        result["report"], result["time_split"] = report(result), where_time_goes(result)
        show(result)
        common.write_json(f"{args.name}.json", result)
        plot(result, args.name)
        return 0
    reason = missing_requirements()
    if reason is None and not args.data_root.is_dir():
        reason = f"data root {args.data_root} not found (pass --data-root)"
    if reason:
        common.console().print(f"[yellow]time_to_accuracy skipped: {reason}[/yellow]")
        return 0
    t0 = time.perf_counter()
    result = measure(args)
    if args.append:
        result = merged(common.RESULTS / f"{args.name}.json", result)
    result["report"] = report(result)
    result["time_split"] = where_time_goes(result)
    runs = result["runs"]
    methods = list(dict.fromkeys([r["method"] for r in runs] + args.methods))
    result.update(wall_s=time.perf_counter() - t0, quick=args.quick, settings={
        "rates": [lk["link"] for lk in result["links"]], "delay_ms": args.delay,
        "tasks": list(dict.fromkeys([r["task"] for r in runs] + args.tasks)),
        "methods": {m: parity.ALGO_SPECS[METHODS[m]][:2] for m in methods},
        "seeds": sorted({r["seed"] for r in runs} | set(args.seeds)),
        "schedule": {t: schedule_of(args, t) for t in args.tasks},
        "nodes": 2, "processes_per_node": 1, "threads_per_process": 1,
    })  # fmt: skip
    show(result)
    common.write_json(f"{args.name}.json", result)
    plot(result, args.name)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
