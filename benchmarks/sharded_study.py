"""The PTB transformer sharded across 2 nodes of 2 processes: native HSDP against ``dgc_hsdp`` (3 seeds), and
``diloco_hsdp`` against ``diloco`` (one seed), full length; a sitting runs what has not finished (a run stopped
midway starts again: these runs keep no checkpoint).

    nice -n 19 .venv/bin/python -m benchmarks.sharded_study          # run what is left, then report
    .venv/bin/python -m benchmarks.sharded_study --list
    .venv/bin/python -m benchmarks.sharded_study --report-only

Each run is the recipes' command line (``configs/ptb_transformer_cpu.yaml`` under bf16 autocast, 6 epochs, the
global batch of the recipe's 2 processes: 10 windows a process) with an algorithm YAML, started as 2 nodes x 2
processes on this machine (``benchmarks.sharded.launch``), with ``benchmarks.common.RunRecorder``'s record under
``benchmarks/results/parity_runs/sharded_ptb/``, through ``benchmarks.parity``'s command, its reuse of a finished
record of the same command, and its callbacks:

* ``native_hsdp``: ``benchmarks/native_hsdp.yaml`` (FSDP2 inside the node, its dense all-reduce across the nodes);
* ``dgc_hsdp``: ``configs/algo/dgc_hsdp.yaml`` (the recommended DGC across the nodes, its light warm-up);
* ``diloco``: ``configs/algo/diloco.yaml`` (the replicated model: DDP inside the node, DiLoCo across it);
* ``diloco_hsdp``: ``configs/algo/diloco_hsdp.yaml``.

The report (``benchmarks/results/sharded_ptb.json``): validation perplexity (the mean of the last two evaluations),
each seed's ``dgc_hsdp`` against its native HSDP run, relative, their mean +- the standard error, and the bytes each
process's link carried across the nodes over the whole run: the exchange's own count (``link_bytes``, warm-up
included) against native HSDP's ring all-reduce of each process's fp32 shard, every step (``2 (N-1)/N`` of it, N = 2
nodes). Targets: within 2% perplexity on >= 50x fewer bytes; ``diloco_hsdp`` within 1% of ``diloco``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import common, parity, sharded
from lightning_dgc.algorithms.base import ring_allreduce_volume

NAME = "sharded_ptb"
TASK = parity.TASKS["ptb_transformer"]
SEEDS = (42, 43, 44)
#: the runs, in the order they are trained: the pair at each seed, then DiLoCo's pair
#: seed 42's pair, then DiLoCo's pair, then the other seeds: every target has a figure as early as possible
RUNS = ((42, "native_hsdp"), (42, "dgc_hsdp"), (42, "diloco"), (42, "diloco_hsdp"),
        *((s, a) for s in SEEDS[1:] for a in ("native_hsdp", "dgc_hsdp")))
SPECS = {
    "native_hsdp": ("benchmarks/native_hsdp.yaml", (), False),
    "dgc_hsdp": ("configs/algo/dgc_hsdp.yaml", (), "light_warmup"),
    "diloco_hsdp": ("configs/algo/diloco_hsdp.yaml", (), False),
}
TARGETS = {"perplexity_within": 0.02, "fewer_bytes": 50.0, "diloco_within": 0.01}


def argv_of(algo: str, seed: int, data_root: Path, workdir: Path) -> tuple[list[str], Path]:
    """The run's command line (``parity.command`` at 4 processes, launched as 2 nodes of 2) and its record."""
    parity.ALGO_SPECS.update(SPECS)
    argv, record = parity.command(TASK, algo, data_root, TASK.full[0], None, workdir, NAME, 4, seed)
    devices = argv.index("--trainer.devices")
    argv[devices + 1] = str(sharded.PER_NODE)
    return [*argv, "--trainer.num_nodes", str(sharded.NODES)], record


def finished_run(algo: str, seed: int, data_root: Path) -> dict[str, Any] | None:
    """The run's record if it finished with this very command (its key), else ``None``."""
    with tempfile.TemporaryDirectory() as workdir:
        argv, record = argv_of(algo, seed, data_root, Path(workdir))
        key = parity.run_key(argv, Path(workdir))
    key_file = record.with_suffix(".key")
    if not (record.exists() and key_file.exists() and key_file.read_text() == key):
        return None
    run = json.loads(record.read_text())
    return run if run.get("finished") else None


def run(algo: str, seed: int, data_root: Path) -> bool:
    """Train one run (every rank of it), unless finished; whether its record is finished now."""
    if finished_run(algo, seed, data_root) is not None:
        return True
    with tempfile.TemporaryDirectory() as workdir:
        argv, record = argv_of(algo, seed, data_root, Path(workdir))
        key = parity.run_key(argv, Path(workdir))
        record.unlink(missing_ok=True)
        folder = common.RESULTS / "logs" / NAME
        folder.mkdir(parents=True, exist_ok=True)
        tag = record.stem
        common.console().print(f"{NAME}: {tag} (2 nodes x 2 processes)")
        codes = sharded.launch(argv[2], argv[3:], folder, tag, timeout_s=6 * 3600, **parity.run_env(TASK, 1))
        if any(code != 0 for code in codes):
            common.console().print(f"{tag} failed ({codes}):\n{common.tail(folder / f'{tag}.rank0.log', 30)}")
            return False
    done = record.exists() and json.loads(record.read_text()).get("finished")
    if done:
        record.with_suffix(".key").write_text(key)
    return bool(done)


def native_link_bytes(run: dict[str, Any]) -> float:
    """Native HSDP's bytes on a process's link over the run: the ring all-reduce of its fp32 shard across the
    nodes, every optimizer step."""
    shard = 4 * run["params"] / sharded.PER_NODE
    return ring_allreduce_volume(shard, sharded.NODES) * run["global_step"]


def report(data_root: Path) -> dict[str, Any]:
    """``results/sharded_ptb.json`` from every finished run (the others listed as pending)."""
    runs, pending = {}, []
    for seed, algo in RUNS:
        record = finished_run(algo, seed, data_root)
        if record is None:
            pending.append(f"{algo} seed {seed}")
            continue
        runs[f"{algo}_s{seed}"] = {
            "perplexity": parity.protocol_values(TASK, {"history": record.get("history")})["metric_last2"],
            "link_bytes": (record.get("compression") or {}).get("link_bytes") or record.get("link_bytes"),
            "global_step": record["global_step"], "params": record["params"],
            "train_wall_s": record.get("train_wall_s"), "median_step_s": record.get("median_step_s"),
        }  # fmt: skip
        if algo == "native_hsdp":
            runs[f"{algo}_s{seed}"]["link_bytes"] = native_link_bytes(record)
    pairs = [(runs[f"dgc_hsdp_s{s}"], runs[f"native_hsdp_s{s}"]) for s in SEEDS
             if f"dgc_hsdp_s{s}" in runs and f"native_hsdp_s{s}" in runs]  # fmt: skip
    summary: dict[str, Any] = {"pending": pending, "runs": runs, "targets": TARGETS}
    if pairs:
        gaps = [ours["perplexity"] / native["perplexity"] - 1 for ours, native in pairs]
        ratios = [native["link_bytes"] / ours["link_bytes"] for ours, native in pairs]
        mean = sum(gaps) / len(gaps)
        std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / (len(gaps) - 1)) if len(gaps) > 1 else None
        summary["dgc_hsdp"] = {
            "seeds": len(pairs), "paired_seeds": [s for s in SEEDS if f"dgc_hsdp_s{s}" in runs and f"native_hsdp_s{s}"
                                                   in runs], "relative_gaps": gaps, "mean_gap": mean, "gap_std": std,
            "fewer_bytes": min(ratios), "within": abs(mean) <= TARGETS["perplexity_within"],
            "bytes_met": min(ratios) >= TARGETS["fewer_bytes"],
        }  # fmt: skip
    if "diloco_s42" in runs and "diloco_hsdp_s42" in runs:
        gap = runs["diloco_hsdp_s42"]["perplexity"] / runs["diloco_s42"]["perplexity"] - 1
        summary["diloco_hsdp"] = {"relative_gap": gap, "within": abs(gap) <= TARGETS["diloco_within"]}
    common.write_json(f"{NAME}.json", summary)
    return summary


def sentence(record: dict[str, Any] | None = None) -> str:
    """The docs' sentence on perplexity and bytes, from ``results/sharded_ptb.json`` (the finished pairs)."""
    record = record or json.loads((common.RESULTS / f"{NAME}.json").read_text())
    dgc = record["dgc_hsdp"]
    seeds = dgc["paired_seeds"]
    if len(seeds) > 1:
        which = f"over seeds {', '.join(map(str, seeds))}"
        gap = f"{100 * dgc['mean_gap']:+.1f} ± {100 * dgc['gap_std']:.1f}% (paired by seed, ± the standard deviation)"
    else:
        which, gap = f"on seed {seeds[0]}", f"{100 * dgc['mean_gap']:+.1f}%"
    left = len(SEEDS) - len(seeds)
    out = (
        f"{which}, `dgc_hsdp` ends {gap} from native HSDP's validation perplexity (the mean of the last two"
        f" evaluations; target within {100 * TARGETS['perplexity_within']:g}% over {len(SEEDS)} seeds:"
        f" {'met' if dgc['within'] else 'missed'}" + (f" so far, {left} still to run" if left else "")
        + f") on {dgc['fewer_bytes']:.0f}x fewer bytes across the nodes over the run, warm-up included"
        f" ({'the fewest of the seeds; ' if len(seeds) > 1 else ''}target at least {TARGETS['fewer_bytes']:g}x:"
        f" {'met' if dgc['bytes_met'] else 'missed'})"
    )
    if "diloco_hsdp" in record:
        gap = record["diloco_hsdp"]
        runs = record["runs"]
        out += (f"; `diloco_hsdp` ends {100 * gap['relative_gap']:+.1f}% from `diloco` (one seed; target within"
                f" {100 * TARGETS['diloco_within']:g}%: {'met' if gap['within'] else 'missed'}), at perplexities of"
                f" {runs['diloco_hsdp_s42']['perplexity']:.0f} and {runs['diloco_s42']['perplexity']:.0f} against"
                f" native HSDP's {runs['native_hsdp_s42']['perplexity']:.0f} on the same seed: on a schedule this"
                f" short, DiLoCo's local steps cost perplexity, sharded or not")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sharded_study", description=__doc__.split("\n")[0])
    parser.add_argument("--data-root", default=str(common.REPO.parent / "shared" / "data"))
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    data_root = Path(args.data_root)
    if args.list:
        for seed, algo in RUNS:
            state = "done   " if finished_run(algo, seed, data_root) is not None else "pending"
            common.console().print(f"{state} {algo} s{seed}")
        return 0
    ok = True
    if not args.report_only:
        for seed, algo in RUNS:
            ok = run(algo, seed, data_root) and ok
            report(data_root)
    summary = report(data_root)
    common.console().print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

