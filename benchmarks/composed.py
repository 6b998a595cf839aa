"""Composed time to accuracy: the long protocol's steps to a target, priced by a short shaped run of each method.

    python -m benchmarks.composed                      # validate on time_to_accuracy.json, compose the long protocol
    sudo .venv/bin/python -m benchmarks.time_to_accuracy --tasks cifar10_full --rates 20mbit,1gbit,none \\
        --methods ddp,dgc_1pct_int8,auto,dgc_warmup,deft,powersgd --name time_to_accuracy_full_steps --val-batches 4
                                                       # the short shaped runs (312 steps)

A 7,820-step run on a shaped link takes hours; its time is composed instead, from two measured parts:

- **the curve**, from the unshaped long runs (``parity_full_cifar2.json``): at each evaluation, the optimizer
  steps so far, the link bytes so far and the metric;
- **the price**, from a short shaped run of the same method on each link (a few hundred steps,
  :mod:`benchmarks.time_to_accuracy`): its start-up and its seconds per step less its bytes at the link's
  measured goodput (:func:`price`).

The composed time to an evaluation is ``start + steps x step_s + 8 x link_bytes / goodput`` (:func:`compose`):
a stretch that sends more bytes, like the warm-up, costs its bytes at the link's rate. The time to target is
the composed time of the first evaluation at the target (DDP's final metric, mean over its seeds, less 0.5
points), mean over the method's seeds.

**Validation** (:func:`validate`): the same composition must predict the measured short-protocol records
(``time_to_accuracy.json``), each priced by the first :data:`WINDOW` steps of the method's first seed on that
link and applied to every seed's curve. The record keeps each row's error and the largest.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.long_study import LEAN_TARGETS, final_metric
from benchmarks.time_to_accuracy import METHOD_LABELS, link_label
from lightning_dgc.algorithms.base import ring_allreduce_volume

#: the steps of a shaped run that price it (4 of the short protocol's 10 epochs of 78 steps)
WINDOW = 312
#: the accuracy below DDP's final the target allows
TOLERANCE = 0.005
#: the long protocol's methods: the name of the unshaped long run -> the method of the short shaped run
LONG_METHODS = {"ddp": "ddp", "dgc_1pct_int8": "dgc_1pct_int8", "dgc": "dgc_warmup", "deft": "deft", "powersgd": "powersgd"}
#: ``density="auto"`` follows DDP's curve where its shaped run chose density 1 (it then trains as DDP does)
AUTO_CURVE = "ddp"
RECORD = "composed_time.json"
#: the accuracies the short protocol's records are validated at, besides DDP's final less 0.5 points
LEVELS = (0.45, 0.5, 0.55, 0.58, 0.6)


@dataclass(frozen=True)
class Price:
    """A method's cost on a link, from a shaped run: ``start_s`` before its first step (launch, data, the first
    steps' warm-up of the process), ``step_s`` a step less its bytes, ``goodput_mbit`` the link's TCP goodput."""

    start_s: float
    step_s: float
    goodput_mbit: float | None
    steps: int  # the steps that priced it

    def bytes_s(self, link_bytes: float) -> float:
        return 0.0 if self.goodput_mbit is None else 8 * link_bytes / (self.goodput_mbit * 1e6)


def _train_s(entry: dict[str, Any]) -> float:
    """Wall-clock since launch less the evaluations', at an evaluation."""
    return entry["wall_s"] - entry.get("val_s", 0.0)


def price(history: Sequence[dict[str, Any]], goodput_mbit: float | None, window: int = WINDOW) -> Price:
    """The price of a shaped run's first ``window`` steps (at least its first two evaluations): the stretches
    after the first evaluation give the seconds a step takes less its bytes at ``goodput_mbit``; the first
    evaluation's time less its steps at that price is the start-up."""
    points = [e for e in history if e["step"] <= window] or list(history[:2])
    if len(points) < 2:
        points = list(history[:2])
    if len(points) < 2:
        raise ValueError(f"pricing needs a shaped run with at least two evaluations, got {len(history)}")
    first, last = points[0], points[-1]
    steps = last["step"] - first["step"]
    link_bytes = last.get("link_bytes", 0.0) - first.get("link_bytes", 0.0)
    zero = Price(0.0, 0.0, goodput_mbit, 0)
    step_s = (_train_s(last) - _train_s(first) - zero.bytes_s(link_bytes)) / steps
    start_s = _train_s(first) - first["step"] * step_s - zero.bytes_s(first.get("link_bytes", 0.0))
    return Price(start_s, step_s, goodput_mbit, last["step"])


def compose(history: Sequence[dict[str, Any]], cost: Price, metric: str, goal: float) -> float | None:
    """The composed time (seconds, evaluations excluded) to the first evaluation of ``history`` (an unshaped
    run's) whose ``metric`` reaches ``goal`` (higher is better), or ``None`` where none does."""
    for entry in history:
        if entry.get(metric) is not None and entry[metric] >= goal:
            return cost.start_s + entry["step"] * cost.step_s + cost.bytes_s(entry.get("link_bytes", 0.0))
    return None


def measured(history: Sequence[dict[str, Any]], metric: str, goal: float) -> float | None:
    """The measured time (evaluations excluded) to the first evaluation that reaches ``goal``."""
    for entry in history:
        if entry.get(metric) is not None and entry[metric] >= goal:
            return _train_s(entry)
    return None


def _goodputs(record: dict[str, Any]) -> dict[str, float | None]:
    return {lk["link"]: lk["measured_goodput_mbit"] for lk in record.get("links", [])}


def _ddp_target(finals: Sequence[float]) -> float:
    return statistics.mean(finals) - TOLERANCE


def validate(record: dict[str, Any], metric: str = "val_acc", window: int = WINDOW,
             levels: Sequence[float] = LEVELS) -> list[dict[str, Any]]:  # fmt: skip
    """Per shaped link, method and goal (each of ``levels``, then DDP's final less 0.5 points) of a time-to-accuracy
    record: the composed time to the goal (each seed's curve, priced by the first ``window`` steps of the method's
    first seed on that link) against the measured one, means over the seeds that reached it."""
    runs = [r for r in record["runs"] if r["task"] == "cifar10"]
    ddp = {}
    for r in runs:  # DDP's final per seed (every link trains the same run)
        if r["method"] == "ddp" and metric in r["final"]:
            ddp.setdefault(r["seed"], r["final"][metric])
    goals = [*levels, _ddp_target(list(ddp.values()))]
    goodput = _goodputs(record)
    rows = []
    for link in dict.fromkeys(r["link"] for r in runs if r["link"] != "none"):
        for method in dict.fromkeys(r["method"] for r in runs):
            mine = sorted((r for r in runs if (r["link"], r["method"]) == (link, method)), key=lambda r: r["seed"])
            if not mine:
                continue
            cost = price(mine[0]["history"], goodput.get(link), window)
            for i, goal in enumerate(goals):
                pairs = [(compose(r["history"], cost, metric, goal), measured(r["history"], metric, goal)) for r in mine]
                pairs = [(c, m) for c, m in pairs if c is not None and m is not None]
                if not pairs:
                    continue
                composed_s = statistics.mean(c for c, _ in pairs)
                measured_s = statistics.mean(m for _, m in pairs)
                rows.append({"link": link, "method": method, "goal": goal, "ddp_target": i == len(goals) - 1,
                             "seeds": [r["seed"] for r in mine], "priced_by_seed": mine[0]["seed"],
                             "reached": len(pairs), "price": asdict(cost), "composed_s": composed_s,
                             "measured_s": measured_s, "error": composed_s / measured_s - 1})  # fmt: skip
    return rows


def compose_long(long_runs: dict[str, list[dict[str, Any]]], shaped: dict[str, Any], metric: str = "val_acc",
                 ) -> list[dict[str, Any]]:  # fmt: skip
    """Per shaped link and method: the composed time to DDP's final less 0.5 points on the long protocol.

    ``long_runs``: the unshaped long runs' records by algorithm (each with ``history`` and ``final``);
    ``shaped``: the record of the short shaped runs (:mod:`benchmarks.time_to_accuracy`, task ``cifar10_full``)."""
    finals = [final_metric(r, metric) for r in long_runs.get("ddp", [])]
    if not finals:
        raise ValueError("composing the long protocol needs DDP's long runs (parity_full_cifar2)")
    goal = _ddp_target(finals)
    goodput = _goodputs(shaped)
    runs = [r for r in shaped["runs"] if r["task"] == "cifar10_full"]
    rows = []
    for link in dict.fromkeys(r["link"] for r in runs if r["link"] != "none"):
        for r in (r for r in runs if r["link"] == link):
            method, curve = r["method"], None
            if method == "auto":  # DDP's curve where the link made it choose dense, else none of ours
                chose = (r.get("auto") or {}).get("auto_density")
                curve = AUTO_CURVE if chose == 1.0 else None
            else:
                curve = next((name for name, m in LONG_METHODS.items() if m == method), None)
            if curve is None or not long_runs.get(curve):
                continue
            cost = price(r["history"], goodput.get(link))
            times = [compose(run["history"], cost, metric, goal) for run in long_runs[curve]]
            reached = [t for t in times if t is not None]
            rows.append({"link": link, "method": method, "curve": curve,
                         "seeds": [run.get("seed") for run in long_runs[curve]], "target": goal,
                         "reached": len(reached), "price": asdict(cost), "density": (r.get("auto") or {}).get("auto_density"),
                         "composed_s": statistics.mean(reached) if len(reached) == len(times) else None,
                         "composed_reached_s": statistics.mean(reached) if reached else None})  # fmt: skip
    for row in rows:  # x sooner than DDP on the same link; for the seeds that reached the goal, too
        base = next((b for b in rows if (b["link"], b["method"]) == (row["link"], "ddp")), None)
        ok = base is not None and base["composed_s"] and row["composed_s"]
        row["speedup_vs_ddp"] = base["composed_s"] / row["composed_s"] if ok else None
        ok = base is not None and base["composed_s"] and row["composed_reached_s"]
        row["speedup_reached_vs_ddp"] = base["composed_s"] / row["composed_reached_s"] if ok else None
    for r in runs:  # density="auto" that chose a density no long run has: said, not composed
        chose = (r.get("auto") or {}).get("auto_density")
        if r["method"] == "auto" and r["link"] != "none" and chose is not None and chose != 1.0:
            rows.append({"link": r["link"], "method": "auto", "curve": None, "seeds": [], "target": goal, "reached": 0,
                         "density": chose, "composed_s": None, "composed_reached_s": None, "speedup_vs_ddp": None,
                         "speedup_reached_vs_ddp": None})  # fmt: skip
    return rows


def load_long_runs(study: str = "parity_full_cifar2", root: Path = common.RESULTS) -> dict[str, list[dict[str, Any]]]:
    """The finished unshaped long runs of ``study`` by algorithm, each with its seed; DDP's evaluations get the
    link bytes its ring all-reduce carried, which its record leaves at zero (the shaped runs count them)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for path in sorted((root / "parity_runs" / study).glob("cifar10_full_*_s*.json")):
        run = json.loads(path.read_text())
        if not run.get("finished"):
            continue
        algo, seed = path.stem.removeprefix("cifar10_full_").rsplit("_s", 1)
        if algo.startswith("ddp"):  # DDP records no bytes: its ring all-reduce of the fp32 gradient, as the shaped run's
            for entry in run["history"]:
                entry["link_bytes"] = entry["step"] * ring_allreduce_volume(4 * run["params"], run["world_size"])
        out.setdefault(algo, []).append({**run, "seed": int(seed)})
    return out


LABELS = {"ddp": "DDP", "dgc_1pct_int8": "`algo/dgc_1pct_int8`", "auto": '`density="auto"`', "dgc": "DGC at 0.001",
          "deft": "`algo/deft`", "powersgd": "`algo/powersgd`"}  # fmt: skip
LINKS = ("20mbit", "1gbit")
#: what the bracket after a composed time is: DDP's time over the method's, so that above 1 is faster than DDP (a
#: bare "Nx DDP's" reads as a speed-up in one cell and as a time ratio in the next)
SPEED = "DDP's speed"


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.0f} MB"


def _minutes(row: dict[str, Any] | None) -> str:
    if row is None:
        return "not measured"
    if row["method"] == "auto" and row.get("curve", AUTO_CURVE) is None:
        return f"chose density {row['density']:.3g}: no long run of it"
    if row["composed_s"] is None and row.get("composed_reached_s") is not None:
        speed = "" if row["speedup_reached_vs_ddp"] is None else f" ({row['speedup_reached_vs_ddp']:.2f}x {SPEED})"
        return f"{row['reached']} of {len(row['seeds'])} seeds reach it: {row['composed_reached_s'] / 60:.1f} min{speed}"
    if row["composed_s"] is None:
        return f"not reached ({row['reached']} of {len(row['seeds'])} seeds)"
    notes = [] if row["method"] == "ddp" or row["speedup_vs_ddp"] is None else [f"{row['speedup_vs_ddp']:.2f}x {SPEED}"]
    if row["method"] == "auto":  # it chose dense: its time is DDP's curve priced at auto's step, not a run of auto
        notes.append("DDP's curve at auto's step: it chose dense")
    return f"{row['composed_s'] / 60:.1f} min" + (f" ({'; '.join(notes)})" if notes else "")


def _standard_error(row: dict[str, Any]) -> float | None:
    """The standard error of a summary row's difference to DDP, paired by seed (``None`` with one pair)."""
    n = row["paired_seeds"]
    return row["difference_std"] / n**0.5 if n > 1 else None


def markdown_headline(study: dict[str, Any], composed_record: dict[str, Any]) -> list[str]:
    """The README's headline table: per method of the long study, its final top-1 and its gap to DDP paired by seed,
    each the mean ± the standard deviation over seeds (one statistic in the whole table), the link bytes over the run
    and the composed time to DDP's final less 0.5 points on each link (in brackets: :data:`SPEED`, DDP's time over
    the method's)."""
    rows = {r["algo"]: r for r in study["summary"]}
    steps = max(run["global_step"] for run in study["runs"] if run.get("global_step")) if study.get("runs") else None
    long = {(r["link"], r["method"]): r for r in composed_record.get("long", [])}
    target = next(iter(long.values()))["target"] if long else None
    goal = f"to {100 * target:.2f}%" if target is not None else "to DDP's final - 0.5 points"
    lines = [f"| method | top-1 | gap to DDP | link bytes over the run | {goal}, 20 Mbit/s | {goal}, 1 Gbit/s |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for algo in [a for a in LABELS if a in rows] + (["auto"] if any(m == "auto" for _, m in long) else []):
        times = " | ".join(_minutes(long.get((link, LONG_METHODS.get(algo, algo)))) for link in LINKS)
        if algo == "auto":
            lines.append(f"| {LABELS[algo]} | as DDP where it chooses dense | | | {times} |")
            continue
        r = rows[algo]
        n = len(r["seeds"])
        top1 = f"{100 * r['metric']:.2f} ± {100 * r['metric_std']:.2f}% ({n} seeds)" if n > 1 else f"{100 * r['metric']:.2f}% (1 seed)"
        gap = ""
        if "difference" in r:
            spread = r["difference_std"] if r["paired_seeds"] > 1 else None
            gap = f"{100 * r['difference']:+.2f}" + (f" ± {100 * spread:.2f} pp" if spread is not None else " pp")
        sent = r["link_kb_per_step"] * 1e3 * steps if steps else None
        volume = "-" if sent is None else _size(sent) + ("" if algo == "ddp" else f" ({r['compression']:.1f}x fewer)")
        lines.append(f"| {LABELS[algo]} | {top1} | {gap} | {volume} | {times} |")
    return lines


#: the long protocol's targets at 2 workers: the gap to DDP (points), DDP's link bytes over the method's, the
#: composed time to DDP's final less 0.5 points at 20 Mbit/s (x sooner than DDP) and at 1 Gbit/s (at most this much
#: slower than DDP, ``density="auto"``)
TARGETS = {"gap_pp": 0.3, "fewer": 50.0, "sooner_20mbit": 2.0, "slower_1gbit": 0.05}
#: at 8 workers: the gap to DDP (points) and DDP's link bytes over the method's
TARGETS_8 = {"gap_pp": 0.5, "fewer": 20.0}
#: DGC at the paper's density (``algo/dgc``, 0.001), 2 workers: the gap to DDP (points) and DDP's bytes over its
TARGETS_PAPER = {"gap_pp": 0.5, "fewer": 200.0}


def markdown_verdict(study: dict[str, Any], composed_record: dict[str, Any], method: str = "dgc_1pct_int8",
                     study_8: dict[str, Any] | None = None) -> str:  # fmt: skip
    """The README's plain sentence on the long protocol's targets (:data:`TARGETS`; at 8 workers, ``study_8``,
    :data:`TARGETS_8`): each met or missed, with its figure, from the studies' reports and the composed record. A gap
    over several seeds gives its standard error in words, not after a "±": the tables beside it give ± the standard
    deviation."""
    row = next(r for r in study["summary"] if r["algo"] == method)
    long = {(r["link"], r["method"]): r for r in composed_record.get("long", [])}
    gap, se = -100 * row["difference"], 100 * _standard_error(row)
    met = lambda ok: "meets" if ok else "misses"  # noqa: E731
    side = lambda gap: "below" if gap > 0 else "above"  # noqa: E731  (gap: points below DDP)
    seeds = lambda n: f"{n} seed{'s' if n > 1 else ''}"  # noqa: E731
    parts = [f"{abs(gap):.2f} points {side(gap)} DDP (standard error {se:.2f}, {row['paired_seeds']} paired seeds)"
             f" {met(gap <= TARGETS['gap_pp'])} the target of at most {TARGETS['gap_pp']:g}",
             f"{row['compression']:.1f}x fewer link bytes {met(row['compression'] >= TARGETS['fewer'])}"
             f" at least {TARGETS['fewer']:g}x"]  # fmt: skip
    slow = long.get(("20mbit", method))
    if slow is not None and slow["composed_s"] is not None:
        x = slow["speedup_vs_ddp"]
        parts.append(f"at 20 Mbit/s it reaches DDP's final less 0.5 points {x:.2f}x sooner than DDP, which"
                     f" {met(x >= TARGETS['sooner_20mbit'])} at least {TARGETS['sooner_20mbit']:g}x")
    elif slow is not None and slow.get("composed_reached_s") is not None:
        x, n = slow["speedup_reached_vs_ddp"], len(slow["seeds"])
        parts.append(f"at 20 Mbit/s {slow['reached']} of {n} seeds reach DDP's final less 0.5 points"
                     f" {x:.2f}x sooner than DDP and {n - slow['reached']} never reaches it, so"
                     f" {TARGETS['sooner_20mbit']:g}x sooner is missed on {n - slow['reached']} seed"
                     f"{'s' if n - slow['reached'] > 1 else ''}")
    auto = long.get(("1gbit", "auto"))
    if auto is not None and auto["speedup_vs_ddp"] is not None:
        time_ratio = 1 / auto["speedup_vs_ddp"]
        dense = " (it chose dense: DDP's curve priced at its step)" if auto.get("density") == 1.0 else ""
        parts.append(f'at 1 Gbit/s `density="auto"`{dense} takes {time_ratio:.2f}x DDP\'s time, which'
                     f" {met(time_ratio - 1 <= TARGETS['slower_1gbit'])} at most {100 * TARGETS['slower_1gbit']:g}% slower")
    eight = next((r for r in (study_8 or {}).get("summary", []) if r["algo"] == method and "difference" in r), None)
    if eight is not None:
        gap8 = -100 * eight["difference"]
        parts.append(f"at 8 workers {abs(gap8):.2f} points {side(gap8)} DDP ({seeds(eight['paired_seeds'])})"
                     f" {met(gap8 <= TARGETS_8['gap_pp'])} at most {TARGETS_8['gap_pp']:g}, on"
                     f" {eight['compression']:.1f}x fewer link bytes ({met(eight['compression'] >= TARGETS_8['fewer'])}"
                     f" at least {TARGETS_8['fewer']:g}x)")  # fmt: skip
    paper = next((r for r in study["summary"] if r["algo"] == "dgc" and "difference" in r), None)
    if paper is not None:
        gap, se_paper = -100 * paper["difference"], _standard_error(paper)
        spread = "" if se_paper is None else f" (standard error {100 * se_paper:.2f})"
        parts.append(f"DGC at the paper's density 0.001 (`algo/dgc`, {seeds(paper['paired_seeds'])}) ends {abs(gap):.2f}"
                     f" points {side(gap)} DDP{spread}, which {met(gap <= TARGETS_PAPER['gap_pp'])} at"
                     f" most {TARGETS_PAPER['gap_pp']:g}, on {paper['compression']:.1f}x fewer link bytes"
                     f" ({met(paper['compression'] >= TARGETS_PAPER['fewer'])} at least {TARGETS_PAPER['fewer']:g}x)")  # fmt: skip
    light = [r for r in study["summary"] if r["algo"].startswith("dgc_lean") and "difference" in r
             and r["compression"] >= LEAN_TARGETS["fewer_bytes"]]  # fmt: skip
    if light:  # the configurations light in bytes (the DGC page's): the one closest to DDP
        closest = max(light, key=lambda r: r["difference"])
        gap = -100 * closest["difference"]
        parts.append(f"at {LEAN_TARGETS['fewer_bytes']:g}x fewer or more the closest DGC ends {abs(gap):.2f} points"
                     f" {side(gap)} DDP ({seeds(closest['paired_seeds'])}), which"
                     f" {met(gap <= LEAN_TARGETS['within_points'])} at most {LEAN_TARGETS['within_points']:g}")  # fmt: skip
    return f"Against the targets, `algo/{method}`: " + "; ".join(parts) + "."


def markdown_validation(record: dict[str, Any]) -> list[str]:
    """The time-to-accuracy page's table of the validation: per link and method, the goals it reached and the
    composition's error at each, in the order of :data:`LEVELS` then DDP's final less 0.5 points."""
    lines = ["| link | method | goals reached | composed against measured, per goal |", "| --- | --- | --- | --- |"]
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in record["validation"]:
        rows.setdefault((r["link"], r["method"]), []).append(r)
    for (link, method), goals in rows.items():
        errors = ", ".join(f"{100 * g['error']:+.1f}%" for g in goals)
        lines.append(f"| {link_label(link)} | {METHOD_LABELS.get(method, method)} | {len(goals)} | {errors} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--validate-on", default="time_to_accuracy.json", help="a short-protocol record (results/)")
    parser.add_argument("--shaped", default="time_to_accuracy_full_steps.json",
                        help="the long protocol's short shaped runs (results/)")  # fmt: skip
    parser.add_argument("--study", default="parity_full_cifar2")
    args = parser.parse_args(argv)
    con = common.console()
    check = validate(json.loads((common.RESULTS / args.validate_on).read_text()))
    errors = [abs(r["error"]) for r in check if r["error"] is not None]
    for r in check:
        err = "-" if r["error"] is None else f"{100 * r['error']:+.1f}%"
        con.print(f"validate {r['link']:>7} {r['method']:>10} to {100 * r['goal']:.2f}%: composed {r['composed_s']:.0f} s,"
                  f" measured {r['measured_s']:.0f} s, error {err} ({r['reached']} of {len(r['seeds'])} seeds)")  # fmt: skip
    out: dict[str, Any] = {"validation": check, "validation_max_error": max(errors) if errors else None,
                           "validated_on": args.validate_on, "window_steps": WINDOW, "tolerance": TOLERANCE}  # fmt: skip
    shaped_path = common.RESULTS / args.shaped
    if shaped_path.exists():
        out["long"] = compose_long(load_long_runs(args.study), json.loads(shaped_path.read_text()))
        out["shaped"], out["study"] = args.shaped, args.study
        for r in out["long"]:
            con.print(f"long {r['link']:>7} {r['method']:>14}: composed {r['composed_s']} s, x{r['speedup_vs_ddp']}"
                      f" vs DDP ({r['reached']} of {len(r['seeds'])} seeds reached)")  # fmt: skip
    else:
        con.print(f"no {shaped_path.name}: the long protocol's shaped runs are not measured yet")
    study = json.loads((common.RESULTS / f"{args.study}.json").read_text())
    con.print("\n".join(markdown_headline(study, out)))
    common.write_json(RECORD, out)
    worst = out["validation_max_error"]
    con.print(f"largest validation error {'-' if worst is None else f'{100 * worst:.1f}%'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
