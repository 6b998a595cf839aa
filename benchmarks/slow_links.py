"""Slow links, end to end: two workers joined by a rate-limited link, real Lightning training steps.

    sudo .venv/bin/python -m benchmarks.slow_links            # 1 Gbit/s and 100 Mbit/s
    sudo .venv/bin/python -m benchmarks.slow_links --quick    # fewer steps
    sudo .venv/bin/python -m benchmarks.slow_links --bandwidths 100 --models lstm --strategies ddp,dgc

Setup (root, ``ip`` and ``tc`` from iproute2; otherwise the benchmark is skipped with a message):
two network namespaces joined by a veth pair, 10.77.0.1/24 and 10.77.0.2/24 (the only addresses
used), each end's egress shaped by a token bucket (``tc qdisc ... tbf rate <R>mbit``), so the link
is R in each direction, like full-duplex Ethernet. The achieved rate is measured with a TCP
transfer before the runs and reported. The namespaces (and with them the veth pair) are deleted in
a ``finally``, also on Ctrl-C or SIGTERM.

Runs: one process per namespace, launched with ``ip netns exec`` and Lightning's multi-node
variables (``MASTER_ADDR`` = 10.77.0.1, ``NODE_RANK``, ``WORLD_SIZE=2``, ``LOCAL_RANK=0``,
``Trainer(num_nodes=2, devices=1)``, gloo bound to the veth with ``GLOO_SOCKET_IFNAME``), one
compute thread each. Each process pair runs, in turn, every strategy (``ddp``, ``powersgd``:
lightning_dgc's PowerSGD, with the updates of torch's hook, ``dgc`` and ``deft`` at density 0.001) for a
few warm-up steps and then timed steps of synthetic CIFAR / PTB batches (see
:data:`benchmarks.common.WORKLOADS`); the step time is the median of the timed steps, each from
batch start to batch end.

Scaling efficiency = 2-worker throughput / (2 x 1-worker throughput) = t1 / t2 with the same
per-worker batch, where t1 is the median step time of one process training alone without any
exchange (measured once per model, no network). This machine's two workers share its cores (with
whatever else runs on it), so the same process pair also trains both workers *independently at the
same time* (strategy ``single``, no exchange) between the distributed runs: ``efficiency_shared_cpu``
= that step time / t2 isolates what the exchange and the link cost from what CPU sharing costs.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.netns import ADDRESSES, INTERFACES, SlowLink, missing_requirements

MASTER_PORT = 29517
DEFAULT_BANDWIDTHS = (1000, 100)
DEFAULT_MODELS = ("resnet110", "lstm")


# -- runs -------------------------------------------------------------------------------------------------
def _worker_cmd(model: str, strategies: list[str], batch: int, warmup: int, steps: int, nodes: int, out: Path,
                rounds: int = 1, terms: bool = False) -> list[str]:  # fmt: skip
    return [
        common.python(), "-m", "benchmarks.common", "--model", model, "--strategies", ",".join(strategies),
        "--batch-size", str(batch), "--warmup", str(warmup), "--steps", str(steps), "--num-nodes", str(nodes),
        "--rounds", str(rounds), "--out", str(out), *(["--count", "--latency"] if terms else []),
    ]  # fmt: skip


def merge_rounds(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per strategy (first-seen order): every round's timed steps together, their median."""
    merged: dict[str, dict[str, Any]] = {}
    for run in runs:
        entry = merged.get(run["strategy"])
        if entry is None:
            merged[run["strategy"]] = entry = {**run, "step_times_s": [], "round_step_time_s": []}
        entry["step_times_s"] = entry["step_times_s"] + run["step_times_s"]
        entry["round_step_time_s"] = entry["round_step_time_s"] + [run["step_time_s"]]
        mean = run["strategy"] == "diloco"  # a round's steps differ: the mean over whole rounds
        entry["step_time_s"] = statistics.fmean(entry["step_times_s"]) if mean else common.median(entry["step_times_s"])
        entry["steps"] = len(entry["step_times_s"])
    return list(merged.values())


def one_worker(
    model: str, batch: int, warmup: int, steps: int, workdir: Path, timeout_s: float
) -> dict[str, Any]:
    """Median step time of one process training alone (no exchange, no network)."""
    out = workdir / f"single_{model}.json"
    log = workdir / f"single_{model}.log"
    code, _ = common.run_command(
        _worker_cmd(model, ["single"], batch, warmup, steps, 1, out), common.worker_env(), log, timeout_s
    )
    result = out.with_name(f"{out.stem}.rank0.json")
    if code != 0 or not result.exists():
        raise RuntimeError(f"one-worker run of {model} failed ({code}):\n{common.tail(log)}")
    return json.loads(result.read_text())["runs"][0]


def two_workers(
    link: SlowLink, model: str, strategies: list[str], batch: int, warmup: int, steps: int, workdir: Path, timeout_s: float,
    rounds: int = 1, terms: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """Both processes, one per namespace, running ``strategies`` in turn (``rounds`` times): rank 0's runs, and with
    ``terms`` the collectives each counted and the latency of a small all-reduce and all-gather (rank 0's)."""
    tag = f"{model}_{link.rate_mbit or 'unlimited'}_{link.delay_ms or 0:g}"
    out = workdir / f"pair_{tag}.json"
    procs = []
    for side in (0, 1):
        env = common.distributed_env(side, 2, ADDRESSES[0], MASTER_PORT, GLOO_SOCKET_IFNAME=INTERFACES[side])
        cmd = [*link.exec_prefix(side), *_worker_cmd(model, strategies, batch, warmup, steps, 2, out, rounds, terms)]
        procs.append(common.start(cmd, env, workdir / f"pair_{tag}.rank{side}.log"))
    codes = common.wait_all(procs, timeout_s)
    files = [out.with_name(f"{out.stem}.rank{side}.json") for side in (0, 1)]
    if codes != [0, 0] or not files[0].exists():
        logs = "\n".join(common.tail(workdir / f"pair_{tag}.rank{side}.log", 15) for side in (0, 1))
        raise RuntimeError(f"2-worker run {tag} failed (exit codes {codes}):\n{logs}")
    first = json.loads(files[0].read_text())
    runs = merge_rounds(first["runs"])
    other = {r["strategy"]: r["step_time_s"] for r in merge_rounds(json.loads(files[1].read_text())["runs"])}
    for run in runs:
        run["rank1_step_time_s"] = other.get(run["strategy"])
    return runs, {"latency_s": first.get("latency_s")}


def _install_sigterm() -> Any:
    def raise_interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        return signal.signal(signal.SIGTERM, raise_interrupt)
    except ValueError:  # not the main thread
        return None


def measure(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="dgc_slow_links_"))
    con = common.console()
    pairs: list[tuple[int, float, str, int, list[dict[str, Any]], dict[str, Any]]] = []
    links: list[dict[str, Any]] = []
    alone: dict[str, list[dict[str, Any]]] = {model: [] for model in args.models}
    errors: list[str] = []
    previous = _install_sigterm()

    def measure_alone(when: str) -> None:
        for model in args.models:
            batch = args.batch_size or common.WORKLOADS[model]["batch_size"]
            run = one_worker(model, batch, args.warmup, args.steps, workdir, args.timeout)
            alone[model].append(run)
            con.print(
                f"[bold]{model}[/bold]: one worker alone ({when}), batch {batch}: {run['step_time_s']:.3f} s/step"
            )

    try:
        measure_alone("before")
        with SlowLink() as link:
            for mbit, rtt in args.links:
                link.set_rate(mbit or None, rtt / 2 or None)
                goodput, measured_rtt = link.measure_mbit(), link.measure_rtt_ms()
                links.append({"bandwidth_mbit": mbit or None, "measured_goodput_mbit": goodput, "rtt_ms": rtt,
                              "measured_rtt_ms": measured_rtt, "delay_by": link.delay_by})  # fmt: skip
                con.print(f"[bold]link {mbit or 'unlimited'} Mbit/s, round trip {rtt:g} ms[/bold]: measured TCP"
                          f" goodput {goodput:.0f} Mbit/s, round trip {measured_rtt:.2f} ms")  # fmt: skip
                for model in args.models:
                    batch = args.batch_size or common.WORKLOADS[model]["batch_size"]
                    # "single" second: the first distributed run creates the process group the barrier needs
                    order = [*args.strategies[:1], "single", *args.strategies[1:]]
                    con.print(f"  {model}: {', '.join(order)} ...")
                    try:
                        pair, terms = two_workers(link, model, order, batch, args.warmup, args.steps, workdir,
                                                  args.timeout, args.rounds, args.terms)  # fmt: skip
                    except RuntimeError as error:
                        errors.append(str(error))
                        con.print(f"[red]{error}[/red]")
                        continue
                    pairs.append((mbit, rtt, model, batch, pair, terms))
                    con.print("    " + ", ".join(f"{r['strategy']} {r['step_time_s']:.3f} s" for r in pair))
        measure_alone("after")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(workdir, ignore_errors=True)

    one = {}
    for model, measured in alone.items():
        times = [t for run in measured for t in run["step_times_s"]]
        one[model] = {
            "step_time_s": common.median(times),
            "step_times_s": times,
            "runs_step_time_s": [run["step_time_s"] for run in measured],
            "batch_size": measured[0]["batch_size"] if measured else None,
        }
    runs: list[dict[str, Any]] = []
    for mbit, rtt, model, batch, pair, terms in pairs:
        shared = next(r["step_time_s"] for r in pair if r["strategy"] == "single")
        t1 = one[model]["step_time_s"]
        for run in pair:
            if run["strategy"] == "single":
                continue
            t2 = run["step_time_s"]
            runs.append(
                {
                    "model": model,
                    "bandwidth_mbit": mbit or None,
                    "rtt_ms": rtt,
                    "strategy": run["strategy"],
                    "batch_size": batch,
                    "step_time_s": t2,
                    "one_worker_step_time_s": t1,
                    "efficiency": t1 / t2,
                    "shared_cpu_one_worker_step_time_s": shared,
                    "efficiency_shared_cpu": shared / t2,
                    "throughput_samples_s": 2 * batch / t2,
                    "one_worker_throughput_samples_s": batch / t1,
                    "rank1_step_time_s": run.get("rank1_step_time_s"),
                    "bytes_sent_per_step": run.get("bytes_sent"),
                    "dense_bytes_per_step": run["dense_bytes"],
                    "compression_ratio": run.get("compression_ratio"),
                    "selection_ms": run.get("selection_ms"),
                    "hook_registered": run["hook_registered"],
                    "steps": run["steps"],
                    "warmup_steps": run["warmup_steps"],
                    "step_times_s": run["step_times_s"],
                    "round_step_time_s": run["round_step_time_s"],
                    "collectives_per_step": run.get("collectives_per_step"),
                    "latency_s": terms.get("latency_s"),
                }
            )
    return {"runs": runs, "links": links, "one_worker": one, "errors": errors}


# -- the model beside the measurements -----------------------------------------------------------------------
#: Strategy -> (the model's method, the algorithm's settings as :func:`benchmarks.common.make_strategy` sets them).
MODELLED: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp": ("ddp", {}),
    "dgc": ("dgc", {"density": common.DENSITY}),
    "dgc_0.01_int8": ("dgc", {"density": 0.01, "value_dtype": "int8"}),
    "deft": ("deft", {"density": common.DENSITY, "k_allocation": "size", "budget": "dgc_link"}),
    "powersgd": ("powersgd", {"matrix_approximation_rank": common.POWERSGD_RANK, "start_iter": common.POWERSGD_START_ITER}),
}  # fmt: skip


def _profile(model: str, strategy: str, compute_s: float, exchange_s: float | None = None) -> Any:
    """The workload's :class:`~lightning_dgc.perfmodel.Profile` for ``strategy``: DDP's buckets of the model, the
    algorithm's settings, the measured compute and (when given) exchange time."""
    from lightning_dgc.front.profiler import bucket_layout, bucket_profiles
    from lightning_dgc.perfmodel import Profile

    method, config = MODELLED[strategy]
    module, _, _ = common.build_workload(model, common.WORKLOADS[model]["batch_size"], 1)
    return Profile(model, bucket_profiles(bucket_layout(module)), compute_s=compute_s, configs={method: config},
                   exchange_s={} if exchange_s is None else {method: exchange_s})  # fmt: skip


def _network(run: dict[str, Any], links: list[dict[str, Any]]) -> Any:
    """The run's link as the model sees it: the rate's goodput measured without an added delay, a message step's
    latency (half the measured all-reduce of the two ranks on this link: two steps), two collectives at once (gloo's
    threads)."""
    from lightning_dgc.perfmodel import Network

    rate = next(lk for lk in links if lk["bandwidth_mbit"] == run["bandwidth_mbit"] and not lk["rtt_ms"])
    return Network(bandwidth=rate["measured_goodput_mbit"] * 1e6, latency=run["latency_s"]["all_reduce"] / 2,
                   concurrency=2)  # fmt: skip


def add_predictions(result: dict[str, Any]) -> None:
    """``predicted_s`` and ``error`` (predicted / measured - 1) beside every modelled run on a shaped link: the
    compute is the shared-CPU step of the same pair, each strategy's exchange time apart from its link
    (``exchange_s``) comes from the unshaped link (its step less that compute and less what the model gives its
    collectives there), the link from :func:`_network`."""
    from lightning_dgc.perfmodel import step_time

    runs, links = result["runs"], result["links"]
    for run in runs:
        run.pop("predicted_s", None), run.pop("error", None)
    def compute_of(run: dict[str, Any]) -> float:  # the step without exchange on the run's link, else alone
        same = [r for r in runs if r["strategy"] == "compute" and (r["model"], r["bandwidth_mbit"], r["rtt_ms"])
                == (run["model"], run["bandwidth_mbit"], run["rtt_ms"])]  # fmt: skip
        return same[0]["step_time_s"] if same else run["shared_cpu_one_worker_step_time_s"]

    for ref in [r for r in runs if r["bandwidth_mbit"] is None and r["strategy"] in MODELLED]:
        compute = compute_of(ref)
        method = MODELLED[ref["strategy"]][0]
        link_only = step_time(_profile(ref["model"], ref["strategy"], compute, 0.0), method, 2, _network(ref, links))
        ref["exchange_s"] = max(0.0, ref["step_time_s"] - link_only.total_s)
        for run in runs:
            if (run["model"], run["strategy"]) != (ref["model"], ref["strategy"]) or run is ref:
                continue
            profile = _profile(run["model"], run["strategy"], compute_of(run), ref["exchange_s"])
            run["predicted_s"] = step_time(profile, method, 2, _network(run, links)).total_s
            run["error"] = run["predicted_s"] / run["step_time_s"] - 1


# -- report --------------------------------------------------------------------------------------------
TARGETS = (
    ("dgc", 100, ">=", 0.90),
    ("ddp", 100, "<", 0.60),
)


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets at 100 Mbit/s, per model: dgc >= 90 % efficiency, ddp < 60 %."""
    out = []
    for run in result.get("runs", []):
        for strategy, mbit, op, bound in TARGETS:
            if run["strategy"] == strategy and run["bandwidth_mbit"] == mbit and not run.get("rtt_ms"):
                value = run["efficiency"]
                met = value >= bound if op == ">=" else value < bound
                out.append(
                    {
                        "target": f"{run['model']}: {strategy} efficiency at {mbit} Mbit/s {op} {bound:.0%}",
                        "value": f"{value:.0%} (against the shared-CPU baseline: {run['efficiency_shared_cpu']:.0%})",
                        "efficiency": value,
                        "efficiency_shared_cpu": run["efficiency_shared_cpu"],
                        "met": met,
                        "note": _note(run, met, result.get("runs", [])),
                    }
                )
    return out


def _note(run: dict[str, Any], met: bool, runs: list[dict[str, Any]] | None = None) -> str:
    """Where the step time goes, from the run's own figures (for the targets table)."""
    alone, shared, step = (
        run["one_worker_step_time_s"],
        run["shared_cpu_one_worker_step_time_s"],
        run["step_time_s"],
    )
    sent = run.get("bytes_sent_per_step")
    sent = run["dense_bytes_per_step"] if sent is None and run["strategy"] == "ddp" else sent
    parts = []
    if sent is not None:
        wire = sent * 8 / (run["bandwidth_mbit"] * 1e6)
        parts.append(f"{sent / 1e6:.2f} MB/step = {wire:.3f} s of link time")
    faster = [
        r
        for r in runs or []
        if (r["model"], r["strategy"]) == (run["model"], run["strategy"])
        and (r["bandwidth_mbit"] or math.inf) > run["bandwidth_mbit"]
    ]
    link_bound = None
    if faster:
        fast = max(faster, key=lambda r: r["bandwidth_mbit"] or math.inf)
        parts.append(
            f"step {fast['step_time_s']:.2f} s at {fast['bandwidth_mbit'] or 'unlimited'} Mbit/s, {step:.2f} s here"
        )
        link_bound = step > 1.1 * fast["step_time_s"]
    parts.append(f"against the shared-CPU baseline {run['efficiency_shared_cpu']:.0%}")
    if not met and run["strategy"] != "ddp":
        if link_bound is False:
            parts.append("so not the link")
        sharing, rest = shared - alone, step - shared
        parts.append(
            f"of the {step - alone:.2f} s/step over one worker alone, {sharing:.2f} s is two workers computing at"
            f" once on this 2-core VM (CPU sharing: one machine per worker removes it) and {rest:.2f} s the"
            " exchange's own compute and synchronisation (the hook, DDP's buckets, waiting for the slower worker)"
        )
    return "; ".join(parts)


def tables(result: dict[str, Any]) -> list[tuple[str, list[str], list[list[Any]]]]:
    """(title, columns, rows) of the benchmark's tables, for the terminal and the README."""
    columns = [
        "model", "link Mbit/s", "round trip ms", "strategy", "batch", "step s", "predicted s", "1-worker s", "efficiency",
        "shared-CPU 1-worker s", "efficiency (shared CPU)", "MB sent/step", "selection ms",
    ]  # fmt: skip
    rows = []
    for r in result.get("runs", []):
        sent = r.get("bytes_sent_per_step")
        rows.append(
            [
                r["model"], r["bandwidth_mbit"] or "unlimited", r.get("rtt_ms", 0.0), r["strategy"], r["batch_size"],
                r["step_time_s"], r.get("predicted_s"),
                r["one_worker_step_time_s"], f"{r['efficiency']:.0%}", r["shared_cpu_one_worker_step_time_s"],
                f"{r['efficiency_shared_cpu']:.0%}", None if sent is None else sent / 1e6, r.get("selection_ms"),
            ]
        )  # fmt: skip
    out = [("Slow links: 2 workers over a shaped veth pair", columns, rows)]
    links = [
        [lk["bandwidth_mbit"] or "unlimited", lk["measured_goodput_mbit"]] for lk in result.get("links", [])
    ]
    if links:
        out.append(
            (
                "Link check: TCP goodput through the shaped veth pair",
                ["shaped to Mbit/s", "measured Mbit/s"],
                links,
            )
        )
    tgt = [[t["target"], t["value"], t["met"]] for t in targets(result)]
    if tgt:
        out.append(("Slow-link targets", ["target", "measured", "met"], tgt))
    return out


def plot(result: dict[str, Any], name: str = "slow_links") -> None:
    plt = common.pyplot()
    runs = result.get("runs", [])
    if plt is None or not runs:
        return
    models = list(dict.fromkeys(r["model"] for r in runs))
    bandwidths = list(dict.fromkeys((r["bandwidth_mbit"], r.get("rtt_ms", 0.0)) for r in runs))
    strategies = list(dict.fromkeys(r["strategy"] for r in runs))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), squeeze=False)
    width = 0.8 / max(1, len(strategies))
    for ax, model in zip(axes[0], models, strict=True):
        for i, strategy in enumerate(strategies):
            values = [
                next((r["efficiency"] * 100 for r in runs if (r["model"], (r["bandwidth_mbit"], r.get("rtt_ms", 0.0)),
                      r["strategy"]) == (model, bw, strategy)), 0)
                for bw in bandwidths
            ]  # fmt: skip
            ax.bar([j + i * width for j in range(len(bandwidths))], values, width, label=strategy)
        ax.axhline(90, color="grey", lw=0.8, ls="--")
        ax.set_xticks([j + width * (len(strategies) - 1) / 2 for j in range(len(bandwidths))])
        ax.set_xticklabels([(f"{bw} Mbit/s" if bw else "unlimited") + (f", {rtt:g} ms" if rtt else "")
                            for bw, rtt in bandwidths])  # fmt: skip
        ax.set_ylabel("scaling efficiency, 2 workers (%)")
        ax.set_title(model)
        ax.set_ylim(0, 110)
    axes[0][0].legend(fontsize=8)
    common.save_figure(fig, f"{name}.png")


def show(result: dict[str, Any]) -> None:
    for title, columns, rows in tables(result):
        common.print_table(title, columns, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.slow_links", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="fewer timed steps (for run_all --quick)")
    parser.add_argument("--bandwidths", type=lambda s: [int(x) for x in s.split(",")], default=list(DEFAULT_BANDWIDTHS),
                        help="Mbit/s, comma-separated; 0 = no shaping (default: 1000,100)")  # fmt: skip
    parser.add_argument("--rtts", type=lambda s: [float(x) for x in s.split(",")], default=[0.0],
                        help="round trips added to every shaped link, ms, comma-separated (half each way; default 0)")
    parser.add_argument("--terms", action="store_true",
                        help="also count each strategy's collectives per step and time a small all-reduce and"
                             " all-gather on every link; with an unshaped link (bandwidth 0), the performance"
                             " model's step beside every other (benchmarks.step_terms)")
    parser.add_argument("--note", default="", help="a line kept in the record's settings (how the machine was)")
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(DEFAULT_MODELS))
    parser.add_argument("--strategies", type=lambda s: s.split(","), default=list(common.SPEED_STRATEGIES))
    parser.add_argument(
        "--batch-size", type=int, default=None, help="per worker (default: per model, see WORKLOADS)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per run (default 3)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 10, quick 5)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="times each process pair runs every strategy, interleaved (default 2, quick 1)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=900, help="seconds per process pair")
    parser.add_argument("--name", default="slow_links",
                        help="result name: writes results/<name>.json and .png (default slow_links)")  # fmt: skip
    args = parser.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    args.steps = args.steps if args.steps is not None else (5 if args.quick else 10)
    args.rounds = args.rounds if args.rounds is not None else (1 if args.quick else 2)
    args.links = [(mbit, rtt) for mbit in args.bandwidths for rtt in (args.rtts if mbit else [0.0])]

    reason = missing_requirements()
    if reason:
        common.console().print(f"[yellow]slow_links skipped: {reason}[/yellow]")
        common.write_json(f"{args.name}.json", {"skipped": reason, "runs": []})
        return 0
    t0 = time.perf_counter()
    result = measure(args)
    result.update(
        wall_s=time.perf_counter() - t0,
        quick=args.quick,
        settings={
            "density": common.DENSITY,
            "powersgd_rank": common.POWERSGD_RANK,
            "powersgd_start_iter": common.POWERSGD_START_ITER,
            "warmup_steps": args.warmup,
            "timed_steps": args.steps,
            "rounds": args.rounds,
            "threads_per_worker": 1,
            "shaping": "tc tbf on both veth ends (burst: 2 ms at the rate, >= 64 KiB)",
            "delay": "half the round trip each way: tc netem, or where the kernel has none benchmarks.link_delay",
            "diloco_sync_every": common.DILOCO_SYNC_EVERY,
            "step": "median of every round's timed steps; diloco: their mean (whole rounds)",
            "note": args.note,
            "workloads": {m: common.WORKLOADS[m] for m in args.models},
        },
    )
    if args.terms:
        add_predictions(result)
    show(result)
    common.write_json(f"{args.name}.json", result)
    plot(result, args.name)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
