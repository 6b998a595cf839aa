"""The frontier a user chooses on: accuracy gap to DDP against the compression over the whole run.

One point per algorithm and schedule of each seeded parity record (``benchmarks.parity --seeds``): x is
DDP's link bytes over the algorithm's, every step of the run counted (warm-up and critical windows
included), y the difference to DDP paired by seed, with the seeds' standard deviation as the error bar.
Nothing is trained: the points come from the records' summaries.

    python -m benchmarks.frontier                      # the default records
    python -m benchmarks.frontier --records parity_seeds_cifar8,parity_seeds_cifar2
"""

from __future__ import annotations

import argparse
import json
import shutil
from typing import Any

from benchmarks import common

#: The records drawn by default: one panel each.
RECORDS = (
    "parity_seeds_cifar8",
    "parity_seeds_cifar2",
    "parity_seeds_ptb8",
    "parity_seeds_xfmr2",
)


def points(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The record's compressed rows that have a paired difference and a run-average compression."""
    out = []
    for row in record.get("summary", []):
        if row.get("difference") is None or row.get("compression") is None:
            continue
        out.append(
            {
                "task": row["task"],
                "workers": row["devices"],
                "algo": row["algo"],
                "seeds": len(row["seeds"]),
                "compression": row["compression"],
                "difference": row["difference"],
                "difference_std": row.get("difference_std"),
            }
        )
    return out


def load(name: str) -> dict[str, Any]:
    """A parity record's summary, with the run-average compression filled in for records written before
    the summary carried it."""
    record = json.loads((common.RESULTS / f"{name}.json").read_text())
    ddp = next((r for r in record.get("summary", []) if r["algo"] == "ddp"), None)
    for row in record.get("summary", []):
        if "compression" not in row and ddp and ddp.get("link_kb_per_step") and row.get("link_kb_per_step"):
            row["compression"] = round(ddp["link_kb_per_step"] / row["link_kb_per_step"], 2)
    return record


def plot(panels: dict[str, list[dict[str, Any]]]) -> None:
    plt = common.pyplot()
    if plt is None or not panels:
        return
    from matplotlib.ticker import ScalarFormatter

    # each panel's legend below it, one line per point: the figure grows with the longest legend
    longest = max(len(pts) for pts in panels.values())
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6 + 0.12 * longest), squeeze=False)
    algos = list(dict.fromkeys(p["algo"] for pts in panels.values() for p in pts))
    # 40 colours (tab20, then tab20b): more algorithms and schedules than one map holds, none repeated
    palette = plt.get_cmap("tab20").colors + plt.get_cmap("tab20b").colors
    colour = {algo: palette[i % len(palette)] for i, algo in enumerate(algos)}  # one per algorithm, every panel
    for ax, (name, pts) in zip(axes[0], panels.items(), strict=True):
        relative = pts and pts[0]["task"].startswith("ptb")
        scale = 100.0
        for p in pts:
            error = (p["difference_std"] or 0.0) * scale
            ax.errorbar(p["compression"], p["difference"] * scale, yerr=error, fmt="o", color=colour[p["algo"]],
                        capsize=3, label=p["algo"] + ("" if p["seeds"] > 1 else " (1 seed)"))  # fmt: skip
        ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(ScalarFormatter())
        ax.tick_params(axis="x", which="minor", labelsize=7)
        ax.set_xlabel("DDP's link bytes / the algorithm's, whole run")
        ax.set_ylabel("perplexity vs DDP (%, lower is better)" if relative else "top-1 vs DDP (pp)")
        if pts:
            ax.set_title(f"{pts[0]['task']}, {pts[0]['workers']} workers ({name})", fontsize=9)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)
    common.save_figure(fig, "frontier.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.frontier", description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=lambda s: s.split(","), default=list(RECORDS))
    args = parser.parse_args(argv)
    panels = {name: points(load(name)) for name in args.records}
    rows = [
        [p["task"], p["workers"], p["algo"], p["seeds"], f"{p['compression']:.1f}x",
         f"{p['difference'] * 100:+.2f} ± {(p['difference_std'] or 0) * 100:.2f}"]
        for pts in panels.values() for p in pts
    ]  # fmt: skip
    common.print_table(
        "Accuracy against compression over the whole run",
        ["task", "workers", "algo", "seeds", "compression", "vs ddp (pp or %)"],
        rows,
    )
    common.write_json("frontier.json", {"records": args.records, "points": panels})
    plot(panels)
    figure = common.RESULTS / "frontier.png"
    if figure.exists():  # the docs site shows benchmarks/README.md, its figures from docs/benchmarks/results/
        shutil.copyfile(figure, common.REPO / "docs" / "benchmarks" / "results" / "frontier.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
