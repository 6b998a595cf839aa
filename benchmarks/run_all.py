"""Run every benchmark, then write the per-run tables page ``docs/benchmarks/results.md``.

    sudo .venv/bin/python -m benchmarks.run_all --quick     # under 20 minutes on 2 CPU cores
    sudo .venv/bin/python -m benchmarks.run_all             # longer runs; parity's full schedules take hours
    .venv/bin/python -m benchmarks.run_all --quick --only overhead,parity

Each benchmark runs in its own process (``main(argv)`` of its module, bounded by a timeout, so one
that fails or hangs does not stop the others); modules that do not exist (yet) are skipped with a
message. Order: the CPU microbenchmarks first (selection, traffic, shapes), then overhead and slow
links, the performance model (which compares itself with ``slow_links.json``), and the parity runs,
which get what is left of the quick mode's time budget. The run's summary goes to
``benchmarks/results/run_all.json`` and into that page.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from benchmarks import common, report

#: Quick mode's total budget; parity is told the deadline and skips what would not fit.
QUICK_BUDGET_S = 19 * 60


@dataclass(frozen=True)
class Bench:
    name: str
    module: str
    quick_args: tuple[str, ...]
    full_args: tuple[str, ...]
    timeout_s: float  # quick mode
    full_timeout_s: float
    env: tuple[tuple[str, str], ...] = ()


BENCHMARKS: tuple[Bench, ...] = (
    Bench(
        "selection", "benchmarks.selection", ("--quick",), (), 300, 3600, (("OMP_WAIT_POLICY", "PASSIVE"),)
    ),
    Bench("traffic", "benchmarks.traffic", ("--quick",), (), 300, 3600, (("OMP_WAIT_POLICY", "PASSIVE"),)),
    Bench("shapes", "benchmarks.shapes", (), (), 120, 600),
    Bench("overhead", "benchmarks.overhead", ("--quick",), (), 300, 3600),
    Bench("slow_links", "benchmarks.slow_links", ("--quick",), (), 600, 7200),
    Bench(
        "scaling_resnet50",
        "benchmarks.scaling_model",
        ("--model", "resnet50"),
        ("--model", "resnet50"),
        240,
        1800,
    ),
    Bench(
        "scaling_resnet110",
        "benchmarks.scaling_model",
        ("--model", "resnet110", "--threads", "1"),
        ("--model", "resnet110", "--threads", "1"),
        180,
        1800,
    ),  # fmt: skip
    Bench(
        "scaling_lstm",
        "benchmarks.scaling_model",
        ("--model", "lstm", "--threads", "1"),
        ("--model", "lstm", "--threads", "1"),
        180,
        1800,
    ),  # fmt: skip
    Bench("parity", "benchmarks.parity", ("--quick",), ("--full",), 1200, 48 * 3600),
)

_RUNNER = (
    "import sys, importlib\n"
    "module = importlib.import_module(sys.argv[1])\n"
    "result = module.main(sys.argv[2:])\n"
    "sys.exit(result if isinstance(result, int) else 0)\n"
)


def available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run_all", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"small budgets, {QUICK_BUDGET_S // 60} minutes at most"
    )
    parser.add_argument(
        "--only", type=lambda s: s.split(","), default=None, help="comma-separated benchmark names"
    )
    parser.add_argument(
        "--skip", type=lambda s: s.split(","), default=[], help="comma-separated benchmark names"
    )
    args = parser.parse_args(argv)
    con = common.console()
    t0 = time.perf_counter()
    deadline = t0 + QUICK_BUDGET_S if args.quick else None
    summary: list[dict[str, Any]] = []
    for bench in BENCHMARKS:
        if (args.only and bench.name not in args.only) or bench.name in args.skip:
            continue
        bench_args = list(bench.quick_args if args.quick else bench.full_args)
        entry: dict[str, Any] = {"name": bench.name, "module": bench.module, "argv": bench_args}
        summary.append(entry)
        if not available(bench.module):
            entry["status"] = "missing"
            con.print(f"[yellow]{bench.name}: {bench.module} not found, skipped[/yellow]")
            continue
        timeout = bench.timeout_s if args.quick else bench.full_timeout_s
        if deadline is not None:
            left = deadline - time.perf_counter()
            if bench.name == "parity":
                bench_args += ["--deadline", f"{time.time() + left - 15:.0f}"]
                entry["argv"] = bench_args
            timeout = min(timeout, max(0.0, left))
            if timeout < 30:
                entry["status"] = "skipped: quick-mode time budget spent"
                con.print(f"[yellow]{bench.name}: skipped, the quick-mode time budget is spent[/yellow]")
                continue
        con.rule(f"{bench.name}: python -m {bench.module} {' '.join(bench_args)}")
        env = common.worker_env(
            threads=int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or (os.cpu_count() or 1)
        )
        env.update(dict(bench.env))
        log = common.RESULTS / "logs" / f"{bench.name}.log"
        # 60 s of grace after SIGTERM: slow_links stops its workers and deletes its namespaces then
        code, wall = common.run_command(
            [common.python(), "-c", _RUNNER, bench.module, *bench_args], env, log, timeout, grace_s=60
        )
        entry.update(wall_s=wall, exit_code=code, log=str(log.relative_to(common.REPO)))
        entry["status"] = "ok" if code == 0 else ("timed out" if code is None else f"failed (exit {code})")
        con.print(common.tail(log, 60))
        style = "green" if code == 0 else "red"
        con.print(f"[{style}]{bench.name}: {entry['status']} in {wall:.0f} s[/{style}]")
    total = time.perf_counter() - t0
    common.write_json("run_all.json", {"quick": args.quick, "wall_s": total, "benchmarks": summary})
    report.main([])
    table = [[e["name"], e.get("status"), e.get("wall_s")] for e in summary]
    common.print_table(
        f"run_all{' --quick' if args.quick else ''}: {total / 60:.1f} min",
        ["benchmark", "status", "wall s"],
        table,
    )
    return 0 if all(e.get("status") in ("ok", "missing") for e in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
