"""The long CIFAR-10 study: every run of ``benchmarks.parity``'s task ``cifar10_full``, in the order that answers the
most first, resumable across sittings.

    nice -n 19 .venv/bin/python -m benchmarks.long_study            # run (or resume) what is left, then report
    .venv/bin/python -m benchmarks.long_study --list                # each run and whether its record is finished
    .venv/bin/python -m benchmarks.long_study --report-only         # rebuild the records' reports, train nothing

Each run writes its own record under ``benchmarks/results/parity_runs/<study>/``; a finished record of the same
command is skipped (``parity --reuse``), and a run stopped part-way resumes from its last epoch end's checkpoint
(``parity``'s resumable tasks: the record of a resumed run is that of an uninterrupted one). A study's report
(``benchmarks/results/<study>.json``) pools only finished runs: one still running or stopped is listed as pending.

The studies (:data:`STUDIES`): 2 workers (DDP and the recommended DGC, 3 seeds; DGC at the paper's density 0.001,
3 seeds; DEFT, PowerSGD and DDP in fp32, one seed; ``algo/dgc_lean``, one seed, three if within half a point, and
with its int8 values or its compressed vectors taken back, one seed each; ``algo/dgc_lean_small``, one seed, three if
within half a point, and without momentum factor masking, one seed; ``algo/dgc_lean_every``, one seed, three if within
half a point), 8 workers (DDP, DGC and DEFT, 3
seeds; for DEFT's gap, seed 42: the norm-proportional k, ``selectors="all"``, DEFT as published, and DGC at the
paper's density 0.001), and the same recipe at about 1k, 2k and 4k optimizer steps (3, 5 and 10 epochs, the learning-rate drops
at the same fractions), DDP and DGC, one seed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from statistics import fmean

from benchmarks import common, parity

TASK = "cifar10_full"
RECOMMENDED = "dgc_1pct_int8"


@dataclass(frozen=True)
class Study:
    """One record of runs: ``name`` (``results/<name>.json``), its workers and epochs, and its runs as
    ``(seed, algorithm)`` in the order they are trained."""

    name: str
    devices: int
    epochs: int
    runs: tuple[tuple[int, str], ...]

    @property
    def seeds(self) -> list[int]:
        return sorted({seed for seed, _ in self.runs})

    @property
    def algos(self) -> list[str]:
        return list(dict.fromkeys(algo for _, algo in self.runs))

    def arguments(self, seeds: list[int], algos: list[str]) -> list[str]:
        """``benchmarks.parity``'s arguments for ``seeds`` x ``algos`` of this study."""
        return [
            "--tasks", TASK, "--full", "--epochs", str(self.epochs), "--devices", str(self.devices),
            "--name", self.name, "--seeds", ",".join(map(str, seeds)), "--algos", ",".join(algos), "--reuse",
        ]  # fmt: skip


PAIR = ("ddp", RECOMMENDED)
STUDIES = (
    Study("parity_full_cifar2", 2, 20, (
        *((s, a) for s in (42, 43, 44) for a in PAIR),
        (42, "dgc"), (42, "deft"), (42, "powersgd"), (42, "ddp_fp32"), (43, "dgc"), (44, "dgc"), (42, "dgc_lean"),
        (42, "dgc_lean_fp32"), (42, "dgc_lean_vectors_dense"), (42, "dgc_lean_small"),
        (42, "dgc_lean_small_nomask"), (42, "dgc_lean_every"),
    )),
    Study("parity_full_cifar8", 8, 20, (*((s, a) for s in (42, 43, 44) for a in (*PAIR, "deft")), (42, "deft_norm_k"), (42, "deft_all_selectors"), (42, "deft_paper"), (42, "dgc"))),
    *(Study(f"parity_full_length_e{e}", 2, e, tuple((42, a) for a in PAIR)) for e in (3, 5, 10)),
)  # fmt: skip
#: the order of the runs across studies: the headline pair first, then the seeds, the length figure, 8 workers, peers
ORDER: tuple[tuple[str, int, str], ...] = (
    *(("parity_full_cifar2", s, a) for s in (42, 43, 44) for a in PAIR),
    *((f"parity_full_length_e{e}", 42, a) for e in (3, 5, 10) for a in PAIR),
    *(("parity_full_cifar8", 42, a) for a in PAIR),
    *(("parity_full_cifar2", 42, a) for a in ("dgc", "deft", "powersgd", "ddp_fp32")),
    *(("parity_full_cifar2", s, "dgc") for s in (43, 44)),  # the paper's density was within 1 point on seed 42
    ("parity_full_cifar2", 42, "dgc_lean"),  # DGC light in bytes (>= 200x over the run): one seed first
    ("parity_full_cifar8", 42, "deft"),  # DEFT's scaling claim, at 8 workers (longer: resumes across sittings)
    # which lever costs algo/dgc_lean its accuracy: its int8 values or its compressed vectors
    *(("parity_full_cifar2", 42, a) for a in ("dgc_lean_fp32", "dgc_lean_vectors_dense")),
    # the compressed small tensors cost it: dgc_lean with them at density 1/8 (>= 200x over the run): one seed first
    ("parity_full_cifar2", 42, "dgc_lean_small"),
    ("parity_full_cifar8", 43, RECOMMENDED),  # the recommended DGC's second pair at 8 workers
    # the small tensors sent whole every 8 steps instead, none late by more than 7 (>= 200x): one seed first
    ("parity_full_cifar2", 42, "dgc_lean_every"),
    # why the small tensors' compression costs accuracy even at 1/8: their momentum, cleared each time one is sent?
    ("parity_full_cifar2", 42, "dgc_lean_small_nomask"),
    *(("parity_full_cifar8", s, a) for s in (43, 44) for a in PAIR if (s, a) != (43, RECOMMENDED)),
    *(("parity_full_cifar8", s, "deft") for s in (43, 44)),  # DEFT at 8 workers was within 1 point on seed 42
    # DEFT's seeds 42-43 miss 0.5 at 8 workers: the published norm-proportional k against algo/deft's k by size
    ("parity_full_cifar8", 42, "deft_norm_k"),
    # ... and every rank selecting in every fragment, which closed most of DEFT's gap to DGC on the subset at 8 workers: if
    # it closes it here too, the gap is DEFT's owner-only selection, a property of the method at this scale
    ("parity_full_cifar8", 42, "deft_all_selectors"),
    # neither closed it: DEFT as published (no warm-up, no momentum correction, k by norm, budget k, the published
    # wire). If it ends closer to DDP, what the shipped config adds costs the accuracy; if not, the method does
    ("parity_full_cifar8", 42, "deft_paper"),
    # ... and DGC at DEFT's density (0.001, the paper's warm-up): whether any selection at 0.1% shows the gap at 8
    # workers on this protocol, or DEFT's alone
    ("parity_full_cifar8", 42, "dgc"),
)  # fmt: skip


def study(name: str) -> Study:
    return next(s for s in STUDIES if s.name == name)


def finished_run(name: str, seed: int, algo: str, runs_dir=None) -> dict | None:
    """The run's record if it says it finished, else ``None`` (the command's key is checked by ``parity --reuse``)."""
    record = (runs_dir or parity.RUNS_DIR) / name / f"{TASK}_{algo}_s{seed}.json"
    run = json.loads(record.read_text()) if record.is_file() else {}
    return run if run.get("finished") else None


def finished(name: str, seed: int, algo: str) -> bool:
    """Whether the run's record says it finished."""
    return finished_run(name, seed, algo) is not None


#: the length figure's studies: epochs -> study (20 epochs: the headline's)
LENGTHS = {3: "parity_full_length_e3", 5: "parity_full_length_e5", 10: "parity_full_length_e10", 20: "parity_full_cifar2"}
LENGTH_RECORD = "parity_full_length"
LENGTH_SEED = 42


def final_metric(run: dict, metric: str = "val_acc") -> float:
    """A run's final top-1 as the studies report it: the mean of its last two evaluations."""
    values = [e[metric] for e in run["history"] if metric in e][-2:]
    return sum(values) / len(values)


def length_summary(runs_dir=None) -> list[dict]:
    """The gap against the schedule's length: per length whose DDP and DGC runs of seed :data:`LENGTH_SEED` are both
    finished, their steps, final top-1 and the difference (DGC less DDP)."""
    rows = []
    for epochs, name in LENGTHS.items():
        runs = {algo: run for algo in PAIR if (run := finished_run(name, LENGTH_SEED, algo, runs_dir)) is not None}
        if len(runs) == len(PAIR):
            ddp, dgc = (final_metric(runs[a]) for a in PAIR)
            rows.append({"epochs": epochs, "steps": runs["ddp"]["global_step"], "study": name, "seed": LENGTH_SEED,
                         "ddp": ddp, RECOMMENDED: dgc, "difference": dgc - ddp,
                         "compression": runs[RECOMMENDED]["compression"]["compression_ratio"]})  # fmt: skip
    return rows


def length_sentence(rows: list[dict]) -> str:
    """The docs' sentence on where the gap goes: the recommended DGC (the length record's, :data:`RECOMMENDED`) less
    DDP at each length of the length record. It names the configuration: on the pages it follows a paragraph on
    another one (``algo/dgc``, at the paper's density)."""
    gaps = ", ".join(f"{100 * r['difference']:+.2f} at {r['steps']:,}" for r in rows)
    return f"`algo/{RECOMMENDED}` less DDP, seed {LENGTH_SEED}, in points at each length's steps: {gaps}"


def precision_sentence(runs_dir=None) -> str | None:
    """The docs' sentence on the protocol's bf16 autocast: DDP's final top-1 on seed :data:`LENGTH_SEED` under it and
    in fp32 (``ddp_fp32``), or ``None`` until both runs are finished."""
    runs = [finished_run(LENGTHS[20], LENGTH_SEED, algo, runs_dir) for algo in ("ddp", "ddp_fp32")]
    if None in runs:
        return None
    bf16, fp32 = (final_metric(run) for run in runs)
    return (f"DDP, seed {LENGTH_SEED}: {100 * bf16:.2f}% under bf16 autocast, {100 * fp32:.2f}% in fp32"
            f" ({100 * (bf16 - fp32):+.2f} points)")  # fmt: skip


#: ``algo/dgc_lean``'s targets on the long protocol at 2 workers: the gap to DDP's top-1 (paired seeds, points) and
#: DDP's link bytes over its own over the run, warm-up included
LEAN_TARGETS = {"within_points": 0.3, "fewer_bytes": 200.0, "seeds": 3, "more_seeds_within": 0.5}


def lean_sentence(record: dict, algo: str = "dgc_lean") -> str | None:
    """The DGC page's sentence on ``algo/<algo>``'s (a configuration light in bytes) accuracy and bytes from the
    2-worker study's report (``parity_full_cifar2.json``), or ``None`` until a run of it finished."""
    rows = {row["algo"]: row for row in record["summary"]}
    if algo not in rows:
        return None
    lean, t = rows[algo], LEAN_TARGETS
    n, gap = lean["paired_seeds"], 100 * lean["difference"]
    seeds = seed_list(lean["seeds"])
    spread = f" ± {100 * lean['difference_std']:.2f} (paired by seed, ± the standard deviation)" if n > 1 else ""
    within = lambda points: parity.within_tolerance(-lean["difference"], points / 100)  # noqa: E731
    close = within(t["within_points"]) if n >= t["seeds"] else None
    verdict = {True: "met", False: "missed", None: (
        f"{t['seeds'] - n} more seeds to run" if within(t["more_seeds_within"])
        else f"missed: more than {t['more_seeds_within']:g} points on the first seed")}[close]  # fmt: skip
    fewer = lean["compression"]
    return (f"`algo/{algo}` on the long protocol (2 workers, {seeds}): {100 * lean['metric']:.2f}%, a gap of"
            f" {gap:+.2f}{spread} points against DDP (target within {t['within_points']:g} points over {t['seeds']}"
            f" seeds: {verdict}), on {fewer:.1f}x fewer link bytes over the run, warm-up included (target at least"
            f" {t['fewer_bytes']:g}x: {'met' if fewer >= t['fewer_bytes'] else 'missed'})")  # fmt: skip


#: ``algo/dgc_lean`` with one lever taken back (the study's diagnostics) -> the words for the lever
LEAN_DIAGNOSTICS = {
    "dgc_lean_fp32": "fp32 values instead of int8",
    "dgc_lean_vectors_dense": "the 1-D and small tensors averaged dense (in fp16) instead of compressed",
}


#: ``algo/dgc_lean_small`` with one setting changed -> the words for it
SMALL_DIAGNOSTICS = {"dgc_lean_small_nomask": "`algo/dgc_lean_small` without momentum factor masking"}


def lean_diagnostics_sentence(
    record: dict, diagnostics: dict[str, str] = LEAN_DIAGNOSTICS, lead: str = "Each lever taken back alone, on the same seed"
) -> str | None:
    """The DGC page's sentence on diagnostics of a light configuration (``algo/dgc_lean``'s by default: one lever taken
    back each, seed 42): each one's top-1, gap to DDP and bytes, from ``parity_full_cifar2.json``; ``None`` until
    every one of them finished."""
    rows = {row["algo"]: row for row in record["summary"]}
    if any(algo not in rows for algo in diagnostics):
        return None
    parts = [f"{words} (`{algo}`): {100 * rows[algo]['metric']:.2f}%, {100 * rows[algo]['difference']:+.2f} points,"
             f" {rows[algo]['compression']:.1f}x fewer link bytes" for algo, words in diagnostics.items()]  # fmt: skip
    return f"{lead}: " + "; ".join(parts)


#: ``algo/deft``'s targets on the long protocol at 8 workers: the gap to DDP (points), DDP's link bytes over its own
DEFT_EIGHT_TARGETS = {"within_points": 0.5, "fewer_bytes": 20.0}


def seed_list(seeds: list[int]) -> str:
    """How the pages name the seeds a figure comes from: ``seed 42``, or ``seeds 42, 43, 44``."""
    return f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {', '.join(map(str, seeds))}"


def selection_ms_per_step(run: dict) -> float:
    """The slowest rank's selection time per optimizer step of a finished run (``rank_selection_ms``), or rank 0's
    where the record has no other rank's (runs recorded before it gathered them)."""
    compression = run["compression"]
    return max(compression.get("rank_selection_ms") or [compression["selection_ms"]]) / compression["steps"]


def warmup_split(run: dict, ddp_step_bytes: float, warmup_epochs: int = 4, epochs: int = 20) -> tuple[float, float]:
    """A finished run's link bytes around its warm-up (the first ``warmup_epochs`` of ``epochs``): the share the
    warm-up sent, up to the evaluation at its end, and how many times fewer than ``ddp_step_bytes`` a step sent
    after it."""
    steps, total = run["global_step"], run["compression"]["link_bytes"]
    at = next(e for e in run["history"] if e["step"] >= warmup_epochs * steps // epochs - 1)
    return at["link_bytes"] / total, (steps - at["step"]) * ddp_step_bytes / (total - at["link_bytes"])


def deft_eight_sentence(record: dict, runs_dir=None) -> str | None:
    """The DEFT page's sentence on ``algo/deft`` at 8 workers (``parity_full_cifar8.json``): its gap to DDP, its
    bytes, and its slowest rank's selection time a step against the recommended DGC's on the same seed; ``None``
    until DEFT's run finished."""
    rows = {row["algo"]: row for row in record["summary"]}
    if "deft" not in rows:
        return None
    deft, t = rows["deft"], DEFT_EIGHT_TARGETS
    seed = deft["seeds"][0]  # (the run whose record gives the warm-up's share and the selection times)
    gap, fewer = 100 * deft["difference"], deft["compression"]
    runs = {algo: finished_run("parity_full_cifar8", seed, algo, runs_dir) for algo in ("deft", RECOMMENDED)}
    within = parity.within_tolerance(-deft["difference"], t["within_points"] / 100)
    if deft["paired_seeds"] == 1:
        figures = f"{100 * deft['metric']:.2f}%, {gap:+.2f} points against DDP ("
    else:
        figures = (f"{100 * deft['metric']:.2f} ± {100 * deft['metric_std']:.2f}%, {gap:+.2f} ±"
                   f" {100 * deft['difference_std']:.2f} points against DDP (paired by seed, ± the standard deviation; ")
    out = (f"At 8 workers of 16 images (`parity_full_cifar8.json`, {seed_list(deft['seeds'])}), `algo/deft` ends at"
           f" {figures}target"
           f" within {t['within_points']:g}: {'met' if within else 'missed'}), on {fewer:.1f}x fewer link bytes over"
           f" the run (target at least {t['fewer_bytes']:g}x: {'met' if fewer >= t['fewer_bytes'] else 'missed'})")
    if runs["deft"] is not None:  # the warm-up's epochs (from 0.25, as DGC's paper) against the rest of the run
        share, after = warmup_split(runs["deft"], 1e3 * rows["ddp"]["link_kb_per_step"])
        out += (f"; {'its' if deft['paired_seeds'] == 1 else f'in seed {seed}, its'} warm-up, the first 4 of the 20"
                f" epochs, sent {100 * share:.0f}% of those bytes, and after it a step sends {after:.1f}x fewer than"
                f" DDP's")  # fmt: skip
    if all(runs.values()):
        deft_ms, dgc_ms = (selection_ms_per_step(runs[a]) for a in ("deft", RECOMMENDED))
        who = lambda run: "slowest rank" if run["compression"].get("rank_selection_ms") else "rank 0"  # noqa: E731
        out += (f"; its {who(runs['deft'])} selected for {deft_ms:.1f} ms a step, `algo/{RECOMMENDED}`'s (density"
                f" 0.01) {who(runs[RECOMMENDED])} for {dgc_ms:.1f} ms")
    return out


def gaps_around_first_step(runs: dict[str, dict], epochs: int = 20) -> tuple[dict[str, list], dict[str, list]]:
    """Each run's gap to ``runs["ddp"]`` (points) at every evaluation, split at the first learning-rate step: the
    gaps before it and those from it to the end, by algorithm (DDP's own left out)."""
    first = parity.milestones(parity.TASKS[TASK], epochs)[0]
    after = first * runs["ddp"]["global_step"] // epochs  # the step the learning rate first drops at
    acc = {a: [e["val_acc"] for e in r["history"] if "val_acc" in e] for a, r in runs.items()}
    steps = [e["step"] for e in runs["ddp"]["history"] if "val_acc" in e]
    gap = {a: [100 * (x - y) for x, y in zip(acc[a], acc["ddp"], strict=True)] for a in runs if a != "ddp"}
    split = lambda late: {a: [d for d, t in zip(g, steps, strict=True) if (t >= after) == late]  # noqa: E731
                          for a, g in gap.items()}  # fmt: skip
    return split(False), split(True)


def deft_decay_sentence(record: dict, runs_dir=None, epochs: int = 20) -> str | None:
    """The DEFT page's sentence on where its gap at 8 workers lies: per seed, over the evaluations from the first
    learning-rate step on, how many of DEFT's are below DDP's and their mean gap, and the recommended DGC's mean
    gap; ``None`` until a seed has all three runs."""
    rows = {row["algo"]: row for row in record["summary"]}
    if "deft" not in rows:
        return None
    gaps: dict[int, dict[str, list[float]]] = {}
    swing = 0.0  # DEFT's largest gap either side of DDP's before the first step
    for seed in rows["deft"]["seeds"]:
        runs = {a: finished_run("parity_full_cifar8", seed, a, runs_dir) for a in ("ddp", "deft", RECOMMENDED)}
        if all(runs.values()):
            before, gaps[seed] = gaps_around_first_step(runs, epochs)  # type: ignore[arg-type]
            swing = max([swing, *map(abs, before["deft"])])
    if not gaps:
        return None
    below = sum(sum(d < 0 for d in g["deft"]) for g in gaps.values())
    count = sum(len(g["deft"]) for g in gaps.values())
    means = lambda algo: ", ".join(f"{fmean(g[algo]):+.2f}" for g in gaps.values())  # noqa: E731
    first = parity.milestones(parity.TASKS[TASK], epochs)[0]
    return (f"Evaluated every half epoch, DEFT's runs are up to {swing:.1f} points either side of DDP's before the"
            f" first learning-rate step (epoch {first}); from it to the end {below} of their {count} evaluations are below"
            f" DDP's, and their mean gap there is {means('deft')} points on {seed_list(list(gaps))}"
            f" (`algo/{RECOMMENDED}`'s: {means(RECOMMENDED)})")  # fmt: skip


#: the changes to ``algo/deft`` run at 8 workers (seed 42) to find where its gap comes from: the name the DEFT
#: page's verdict gives each, and its words for the change
DEFT_CAUSES = {
    "deft_norm_k": ('`k_allocation="norm"`', 'with the published norm-proportional k (`k_allocation="norm"`)'),
    "deft_all_selectors": ('`selectors="all"`', 'with every rank selecting in every fragment (`selectors="all"`)'),
    "deft_paper": ("`deft_paper`", "as published throughout (`deft_paper`: no warm-up, no momentum correction, k by"
                                   ' norm, `budget="k"`, the all-reduce wire)'),
}


def late_gaps(seed: int, algos, runs_dir=None, epochs: int = 20) -> tuple[dict[str, dict], dict[str, list]] | None:
    """``seed``'s finished runs at 8 workers of DDP and of ``algos``, and each algorithm's gaps to DDP (points) at
    the evaluations from the first learning-rate step on; ``None`` until all of them finished."""
    runs = {a: finished_run("parity_full_cifar8", seed, a, runs_dir) for a in ("ddp", *algos)}
    if not all(runs.values()):
        return None
    return runs, gaps_around_first_step(runs, epochs)[1]  # type: ignore[arg-type]


def late_figures(record: dict, runs: dict[str, dict], late: dict[str, list]) -> dict[str, tuple[float, str]]:
    """Each run's mean gap to DDP from the first learning-rate step on, and how the DEFT page words it: that mean,
    the gap over the last two evaluations (the study's metric) and the run's link bytes against DDP's (a step's, in
    kB to 0.1, as the study's record gives them)."""
    ddp_kb = next(row for row in record["summary"] if row["algo"] == "ddp")["link_kb_per_step"]
    out = {}
    for algo, gaps in late.items():
        run = runs[algo]
        fewer = ddp_kb / parity.link_kb_per_step({"link_bytes": run["compression"]["link_bytes"], "global_step": run["global_step"]})
        out[algo] = fmean(gaps), f"{fmean(gaps):+.2f} ({fmean(gaps[-2:]):+.2f} over the last two; {fewer:.1f}x fewer link bytes)"
    return out


def closes_half(gap: float, deft_gap: float) -> bool:
    """Whether a run whose mean gap to DDP is ``gap`` closes at least half of ``algo/deft``'s ``deft_gap`` (both
    in points, negative below DDP): it ends no further below DDP than half of DEFT's gap; above DDP it closes all of
    it."""
    return gap >= deft_gap / 2


def deft_cause_sentence(record: dict, runs_dir=None, seed: int = 42, epochs: int = 20) -> tuple[str, list[str]] | None:
    """The DEFT page's sentence on which change accounts for ``algo/deft``'s gap at 8 workers, and those changes: on
    ``seed``, the mean gap to DDP from the first learning-rate step on of ``algo/deft`` and of each change, with the
    gap over the last two evaluations (the study's metric) and the bytes; a change accounts for the gap if it closes
    at least half of that mean gap. With how much that mean gap varies over ``algo/deft``'s seeds (the standard
    deviation). ``None`` until DDP, ``algo/deft`` and every change have finished ``seed``."""
    found = late_gaps(seed, ("deft", *DEFT_CAUSES), runs_dir, epochs)
    if found is None:
        return None
    figures = late_figures(record, *found)
    closes = [a for a in DEFT_CAUSES if closes_half(figures[a][0], figures["deft"][0])]
    verdict = (" and ".join(DEFT_CAUSES[a][0] for a in closes) + f" close{'s' if len(closes) == 1 else ''}"
               if closes else "none closes")  # fmt: skip
    seeds = {}  # algo/deft's mean gap from the step on, on each of its seeds with DDP's run finished
    for other in next(row for row in record["summary"] if row["algo"] == "deft")["seeds"]:
        if (pair := found if other == seed else late_gaps(other, ("deft",), runs_dir, epochs)) is not None:
            seeds[other] = fmean(pair[1]["deft"])
    _, std = parity.mean_std(list(seeds.values()))
    spread = "" if std is None else f" (over {seed_list(list(seeds))}, `algo/deft`'s varies by {std:.2f}, a standard deviation)"
    return (
        f"On seed {seed}, the mean gap to DDP over the evaluations from the first learning-rate step on is, in"
        f" points, {figures['deft'][1]} for `algo/deft`, "
        + ", ".join(f"{figures[a][1]} {words}" for a, (_, words) in DEFT_CAUSES.items())
        + f"; {verdict} at least half of `algo/deft`'s gap there{spread}"
    ), closes


def deft_density_sentence(record: dict, runs_dir=None, seed: int = 42, epochs: int = 20) -> tuple[str, bool] | None:
    """The DEFT page's sentence on whether DGC at DEFT's density (the study's ``dgc``, ``algo/dgc_warmup``) shows
    ``algo/deft``'s gap at 8 workers too, and whether DGC closes at least half of it (:func:`closes_half`, the rule
    of :func:`deft_cause_sentence`); ``None`` until DDP, ``algo/deft`` and DGC have finished ``seed``."""
    found = late_gaps(seed, ("deft", "dgc"), runs_dir, epochs)
    if found is None:
        return None
    runs, _ = found
    figures = late_figures(record, *found)
    density = {a: runs[a]["densities"][-1] for a in ("deft", "dgc")}
    if density["dgc"] != density["deft"]:
        raise ValueError(f"algo/dgc_warmup ended at density {density['dgc']:g}, algo/deft at {density['deft']:g}: not a control")
    closes = closes_half(figures["dgc"][0], figures["deft"][0])
    return (f"DGC at the same density, {density['dgc']:g}, with its paper's warm-up (`algo/dgc_warmup`), on seed {seed}:"
            f" {figures['dgc'][1]}; it {'closes' if closes else 'does not close'} at least half of `algo/deft`'s"
            f" gap there"), closes  # fmt: skip


def write_length(rows: list[dict]) -> None:
    """``results/parity_full_length.json`` and its figure: top-1 and the gap against the optimizer steps."""
    path = common.write_json(f"{LENGTH_RECORD}.json", {"rows": rows, "seed": LENGTH_SEED})  # the machine's paths out
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["steps"] for r in rows]
    fig, (top, gap) = plt.subplots(2, 1, figsize=(6, 5.2), sharex=True, height_ratios=(2, 1))
    top.plot(steps, [100 * r["ddp"] for r in rows], "o-", label="DDP")
    top.plot(steps, [100 * r[RECOMMENDED] for r in rows], "s-", label=f"algo/{RECOMMENDED}")
    top.set_ylabel("top-1, %")
    top.legend()
    top.set_title(f"ResNet-20, all of CIFAR-10, 2 workers, seed {LENGTH_SEED}: the same recipe at each length")
    gap.axhline(0, color="grey", lw=0.8)
    gap.plot(steps, [100 * r["difference"] for r in rows], "s-", color="C1")
    gap.set_ylabel("DGC - DDP, points")
    gap.set_xlabel("optimizer steps (3, 5, 10, 20 epochs)")
    gap.set_xscale("log")
    gap.set_xticks(steps, [f"{s:,}" for s in steps])
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.long_study", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-root", default=str(common.REPO.parent / "shared" / "data"))
    parser.add_argument("--list", action="store_true", help="list the runs and which are finished")
    parser.add_argument("--report-only", action="store_true", help="rebuild every study's report, train nothing")
    parser.add_argument("--stop-after", default=None, metavar="STUDY:SEED:ALGO",
                        help="stop once this run is done (to train something else before the rest)")
    args = parser.parse_args(argv)
    con = common.console()
    if args.list:
        for name, seed, algo in ORDER:
            con.print(f"{'done   ' if finished(name, seed, algo) else 'pending'} {name} s{seed} {algo}")
        return 0
    code = 0
    if not args.report_only:
        for name, seed, algo in ORDER:  # parity skips a finished run of the same command, resumes a stopped one
            s = study(name)
            code |= parity.main([*s.arguments([seed], [algo]), "--data-root", args.data_root])
            report(s, args.data_root)  # the study's report again: the run's own call wrote it for that run alone
            write_length(length_summary())
            if args.stop_after == f"{name}:{seed}:{algo}":
                break
    for s in STUDIES:
        report(s, args.data_root)
    write_length(length_summary())
    return code


def report(s: Study, data_root: str) -> None:
    """``results/<study>.json`` from every finished record of the study (a run not finished is listed as pending)."""
    pairs = ",".join(f"{seed}:{algo}" for seed, algo in s.runs)  # its planned runs, not every seed x algorithm
    parity.main([*s.arguments(s.seeds, s.algos), "--pairs", pairs, "--data-root", data_root, "--report-only"])


if __name__ == "__main__":
    sys.exit(main())
