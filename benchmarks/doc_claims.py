"""The docs' claims that stand on several pages, or whose words a reader checks against a number ("flat in N",
"recommended", "±", the paper's ratios, a GPU's targets), each generated from its committed records.

    python -m benchmarks.doc_claims      # print every generated sentence and table, to paste where the docs quote it

Nothing here trains or measures: it reads ``benchmarks/results/``. ``tests/test_doc_claims.py`` holds every page
to these sentences and to the words around them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.long_study import RECOMMENDED

RESULTS = Path(__file__).resolve().parent / "results"

#: the one recommended DGC configuration that every page names
RECOMMENDED_DGC = f"algo/{RECOMMENDED}"


def record(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{name}.json").read_text())


def summary(name: str) -> dict[str, dict[str, Any]]:
    return {row["algo"]: row for row in record(name)["summary"]}


# -- link bytes as the workers grow --------------------------------------------------------------------------------
#: each column of the README's "Which algorithm?" table: its run in the CIFAR-10 subset studies and its config
CONFIGS = {
    "DDP": ("ddp", "DDP"),
    "DGC": ("dgc_density_0.01_int8_light_warmup", f"`{RECOMMENDED_DGC}`"),
    "DEFT": ("deft", "`algo/deft`"),
    "PowerSGD": ("powersgd", "`algo/powersgd`"),
    "DiLoCo": ("diloco_streaming", "`algo/diloco_streaming`"),
}
#: the studies at 2 and at 8 workers (the same recipe, seeds and schedule)
GROWTH_STUDIES = ("parity_seeds_cifar2", "parity_seeds_cifar8")
#: "flat in N": a method's link bytes grow from 2 to 8 workers by at most this much more than DDP's ring all-reduce's,
#: which never passes twice the message whatever N
FLAT_TOLERANCE = 0.05
FLAT, GROWS = "flat in N", "grow with N"


def growth() -> dict[str, dict[str, Any]]:
    """Per column of :data:`CONFIGS`: link kB a step at 2 and at 8 workers, their ratio, and the words that ratio
    allows (:data:`FLAT` where it grows as DDP's does, else :data:`GROWS`)."""
    two, eight = (summary(name) for name in GROWTH_STUDIES)
    ddp = eight["ddp"]["link_kb_per_step"] / two["ddp"]["link_kb_per_step"]
    out = {}
    for column, (algo, label) in CONFIGS.items():
        kb_2, kb_8 = two[algo]["link_kb_per_step"], eight[algo]["link_kb_per_step"]
        factor = kb_8 / kb_2
        words = FLAT if factor <= ddp * (1 + FLAT_TOLERANCE) else GROWS
        out[column] = {"label": label, "kb_2": kb_2, "kb_8": kb_8, "growth": factor, "words": words}
    return out


def growth_sentence() -> str:
    """The guide's sentence on what "flat in N" means, with each recommended configuration's bytes at 2 and 8 workers."""
    rows = growth()
    kb = ", ".join(f"{r['label']} {r['kb_2']:,.0f} and {r['kb_8']:,.0f}" for r in rows.values())
    flat = [r for c, r in rows.items() if r["words"] == FLAT and c != "DDP"]
    grows = [r for r in rows.values() if r["words"] == GROWS]
    return (f"Link kB a step on the CIFAR-10 subset at 2 and at 8 workers (`{GROWTH_STUDIES[0]}.json`,"
            f" `{GROWTH_STUDIES[1]}.json`): {kb}. DDP's ring all-reduce grows {rows['DDP']['growth']:.2f}x from 2 to 8"
            f" workers and never past twice the gradient: \"{FLAT}\" is a method that grows as DDP's does ("
            + ", ".join(f"{r['label']} {r['growth']:.2f}x" for r in flat)
            + "); "
            + " and ".join(f"{r['label']} {r['growth']:.1f}x" for r in grows)
            + " grow with N")  # fmt: skip


# -- memory: the CPU path's against a GPU's ------------------------------------------------------------------------
GPU_MEMORY = (("dgc", "DGC"), ("deft", "DEFT"), ("powersgd", "PowerSGD"), ("diloco", "DiLoCo"))


def gpu_memory_peaks() -> dict[str, float]:
    """Rank 0's CUDA training peak over DDP's, in model sizes, per strategy of ``gpu_check.json``."""
    columns = record("gpu_check")["parts"]["checkpoint_memory"]["result"]["cuda_columns"]
    return {c["strategy"]: c["cuda peak - ddp"] for c in columns if c["rank"] == 0}


def gpu_memory_note(every: bool = True) -> str:
    """The words that label a memory figure as the CPU path's: the GPU's peaks, which are larger (``every``: each
    strategy's; else DGC's alone, for the README)."""
    peaks = gpu_memory_peaks()
    shown = GPU_MEMORY if every else GPU_MEMORY[:1]
    figures = ", ".join(f"{label} {peaks[name]:+.2f}" for name, label in shown)
    return f"the CPU path's; on a GPU the peaks are larger (`gpu_check.json`): {figures}"


# -- the paper's compression beside the project's ------------------------------------------------------------------
#: the DGC paper's gradient reduction at density 0.001, one worker's step after its warm-up (Lin et al. 2018, Table 4)
PAPER = {"resnet50": 277, "lstm": 462, "alexnet": 597, "deepspeech": 608}
#: the paper's models in ``gradient_sizes.json``: the configuration whose gradient is the paper's
PAPER_MODELS = {
    "resnet50": ("ResNet-50, ImageNet", "ResNet-50, 1000 classes (lightning_dgc_recipes.resnet.ResNet50)"),
    "lstm": ("LSTM, PTB, 2 x 1500", "PTB LSTM 2 x 1500, 10k words, tied"),
    "alexnet": ("AlexNet, ImageNet", "AlexNet, original two-GPU (grouped conv2/4/5)"),
    "deepspeech": ("DeepSpeech, 7 x 1200 bi-GRU", "DeepSpeech 7 x 1200 bi-GRU, 264 input bands (fitted to the paper's size)"),
}
RUN_BYTES_PAPER = "the paper's DGC (algo/dgc)"
RUN_BYTES_EVERY_TENSOR = "+ every tensor compressed"
RUN_BYTES_RECOMMENDED = "algo/dgc_1pct_int8"


def _traffic(model: str, density: float, value_dtype: str) -> dict[str, Any]:
    (row,) = [r for r in record("traffic")["rows"] if (r["model"], r["algorithm"], r["density"], r["value_dtype"])
              == (model, "dgc", density, value_dtype)]  # fmt: skip
    return row


def _x(ratio: float) -> str:
    return f"{ratio:,.0f}x" if ratio >= 100 else f"{ratio:.1f}x"


def _run_bytes(lever: str) -> dict[str, Any]:
    (row,) = [r for r in record("run_bytes")["rows"] if r["lever"].startswith(lever)]
    return row


def paper_table() -> list[str]:
    """One table: the paper's ratio per model beside this project's, a step at the paper's density (one worker's
    gradient bytes) and over whole runs of the recipes (DDP's link bytes over DGC's, the warm-up included)."""
    sizes = {row["configuration"]: row for row in json.loads((RESULTS / "gradient_sizes.json").read_text())}
    step = lambda model, d, v: _traffic(model, d, v)["dense_bytes"] / _traffic(model, d, v)["bytes_sent"]  # noqa: E731
    full2, full8 = summary("parity_full_cifar2"), summary("parity_full_cifar8")
    ptb2, ptb8 = summary("parity_seeds_ptb2"), summary("parity_seeds_ptb8")
    lstm = record("profile_lstm")["stats"]
    paper_lever, recommended_lever = _run_bytes(RUN_BYTES_PAPER), _run_bytes(RUN_BYTES_RECOMMENDED)
    here = {
        "resnet50": (f"{_x(step('resnet50', 0.001, 'fp32'))} (fp32 values), {_x(step('resnet50', 0.001, 'int8'))}"
                     f" (int8); `{RECOMMENDED_DGC}` (0.01, int8): {_x(step('resnet50', 0.01, 'int8'))}"
                     " (`traffic.json`, one worker)", "no ImageNet run"),
        "lstm": ("not measured (the recipe's 2 x 200 LSTM: below)", "no run"),
        "alexnet": ("not measured", "no run"),
        "deepspeech": ("not measured", "no run"),
    }  # fmt: skip
    lines = ["| model (gradient) | the paper: a step at 0.001 | here: a step at 0.001 | here: over a run, DDP's link bytes"
             " / DGC's |", "| --- | --- | --- | --- |"]  # fmt: skip
    for model, ratio in PAPER.items():
        name, configuration = PAPER_MODELS[model]
        mib = sizes[configuration]["MiB"]
        lines.append(f"| {name} ({mib:.1f} MiB) | {ratio}x | {here[model][0]} | {here[model][1]} |")
    lines.append(
        f"| ResNet-20, CIFAR-10 (the long protocol's) | not in the paper's table | after the warm-up, 2 workers:"
        f" {_x(paper_lever['2_workers']['final_step_ratio'])}; `{RECOMMENDED_DGC}` at 0.01:"
        f" {_x(recommended_lever['2_workers']['final_step_ratio'])} (`run_bytes.json`) | `algo/dgc`:"
        f" {_x(full2['dgc']['compression'])} at 2 workers; `{RECOMMENDED_DGC}`:"
        f" {_x(full2[RECOMMENDED]['compression'])} at 2, {_x(full8[RECOMMENDED]['compression'])} at 8"
        " (`parity_full_cifar2.json`, `parity_full_cifar8.json`) |")  # fmt: skip
    lines.append(
        f"| LSTM, PTB, 2 x 200 (the recipe's) | not in the paper's table |"
        f" {_x(lstm['dense_bytes'] / lstm['bytes_sent'])} (fp32; `profile_lstm.json`, one worker) | `algo/dgc_warmup`,"
        f" 4 epochs: {_x(ptb2['dgc']['compression'])} at 2 workers, {_x(ptb8['dgc']['compression'])} at 8"
        " (`parity_seeds_ptb2.json`, `parity_seeds_ptb8.json`) |")  # fmt: skip
    return lines


def paper_why() -> list[str]:
    """Why the ratios differ: a list, each reason with its figure from the records of :func:`paper_table`."""
    resnet50 = _traffic("resnet50", 0.001, "fp32")
    lstm = record("profile_lstm")["stats"]
    paper_lever, every = _run_bytes(RUN_BYTES_PAPER), _run_bytes(RUN_BYTES_EVERY_TENSOR)
    full2, full8 = summary("parity_full_cifar2"), summary("parity_full_cifar8")
    dense = lambda s: s["dense_exchange_bytes"] / s["bytes_sent"]  # noqa: E731
    return [
        f"- **The same step gives the same ratio**: ResNet-50 at 0.001 sends"
        f" {_x(resnet50['dense_bytes'] / resnet50['bytes_sent'])} fewer bytes than DDP's gradient, the paper's"
        f" {PAPER['resnet50']}x.",
        f"- **1-D tensors travel dense** (biases, norms: averaged, not selected): {dense(resnet50):.0%} of ResNet-50's"
        f" step bytes, {dense(lstm):.0%} of the 2 x 200 LSTM's. With them compressed too"
        f" (`compress_vectors=True, min_compress_numel=1`) and int8 values, ResNet-20's step after the warm-up goes"
        f" from {_x(paper_lever['2_workers']['final_step_ratio'])} to {_x(every['2_workers']['final_step_ratio'])}.",
        f"- **A run pays for its warm-up**: the paper's four warm-up epochs (0.25 to 0.004) sent"
        f" {paper_lever['2_workers']['warmup_share']:.0%} of `algo/dgc`'s bytes over 20 epochs of ResNet-20, so the"
        f" run sent {_x(full2['dgc']['compression'])} fewer than DDP.",
        f"- **Workers multiply an all-gather**: every link carries the other N - 1 workers' selections, where DDP's"
        f" all-reduce stays near twice the gradient: `{RECOMMENDED_DGC}` sent {_x(full2[RECOMMENDED]['compression'])}"
        f" fewer bytes than DDP at 2 workers and {_x(full8[RECOMMENDED]['compression'])} at 8.",
        "",
        "The paper's ratios are one worker's step at the final density; the README's are the links' bytes over the"
        " whole run.",
    ]  # fmt: skip


# -- a GPU's targets -----------------------------------------------------------------------------------------------
#: the targets of ``benchmarks.selection`` that ``gpu_check.json`` records, in the docs' words
GPU_TARGET_WORDS = {
    "DGC batched, ms (ResNet-50)": "DGC's selection for ResNet-50, batched, ms per step",
    "exact time / DGC batched (ResNet-50)": "exact `torch.topk`'s time over DGC's batched selection",
    "fragment norms batched, ms (ResNet-50)": "DEFT's fragment norms for ResNet-50, batched, ms",
    "DEFT batched slowest of 8, ms (ResNet-50)": "DEFT's slowest rank of 8 (ResNet-50), batched, ms",
}
#: ``benchmarks.checkpoint_memory``'s training-peak targets, model sizes over DDP's (its docstring's)
MEMORY_TARGETS = {"dgc": ("DGC", 1.5), "deft": ("DEFT", 1.0)}


def gpu_targets_table() -> list[str]:
    """``docs/gpus.md``'s targets: every target of the GPU record's selection part, as recorded, then the memory
    targets against the record's CUDA peaks; each row says whether it is met."""
    selection = record("gpu_check")["parts"]["selection"]["result"]
    lines = ["| target | source | measured | met |", "| --- | --- | --- | --- |"]
    for t in selection["targets"]:
        op = {"<=": "≤", ">=": "≥"}[t["op"]]
        value = f"{t['value']:.2f}"
        lines.append(f"| {GPU_TARGET_WORDS[t['target']]} {op} {t['limit']:.1f} | `gpu_check.json`, part `selection` |"
                     f" {value} | {'yes' if t['met'] else 'no'} |")  # fmt: skip
    peaks = gpu_memory_peaks()
    for name, (label, limit) in MEMORY_TARGETS.items():
        met = peaks[name] <= limit
        lines.append(f"| CUDA peak memory over DDP, {label}, model sizes ≤ +{limit:.1f} | `gpu_check.json`, part"
                     f" `checkpoint_memory` | {peaks[name]:+.2f} | {'yes' if met else 'no'} |")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    print(growth_sentence() + ".\n")
    print(gpu_memory_note() + ".\n")
    print("\n".join(paper_table()) + "\n")
    print("\n".join(paper_why()) + "\n")
    print("\n".join(gpu_targets_table()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
