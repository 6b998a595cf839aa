"""Predicted speedup of DDP, DGC and DEFT at 1 to 256 workers, from a profile of one node.

    python -m benchmarks.scaling_model --model resnet50 [--profile profile.json] [--out benchmarks/results]
    python -m benchmarks.scaling_model --profile benchmarks/results/profile_resnet50.json --compute-ms 145 --batch-size 32
    python -m benchmarks.scaling_model --model resnet110 --threads 1   # then compared with slow_links.json
    python -m benchmarks.scaling_model --sanity          # the paper's gradient sizes from parameter shapes
    python -m benchmarks.scaling_model --model resnet50 --add-shapes profile.json   # see add_shapes

Without ``--profile`` the model is profiled here: a few steps on generated data in one process
(``strategy=DGCStrategy``, ``devices=1``) with :class:`lightning_dgc.front.profiler.ExchangeProfiler`,
which also writes ``<out>/profile_<model>.json``. Models: the paper's ``resnet50``, ``alexnet``
(the original two-GPU network), ``lstm_paper`` (PTB, 2 x 1500, tied) and ``deepspeech`` (7 x 1200
GRU), built from the recipes, and the synthetic workloads of :mod:`benchmarks.slow_links`
(``resnet20``, ``resnet110``, ``lstm``: 2 x 200), built exactly as that benchmark builds them. With
``--profile`` a JSON written by the callback (on your hardware, e.g. one GPU) is used instead.

:mod:`lightning_dgc.perfmodel` then models the communication for N workers (powers of two up to
256) on links of 100 Mbit/s, 1, 10 and 25 Gbit/s, with and without overlap of communication and
backward, and this script

* prints the speedups as a table (rich) and the 64-node comparison of the DGC paper's Figure 6
  (dense DDP on 10 Gbit/s against DGC on 1 Gbit/s);
* writes ``<out>/scaling_<model>.json`` (profile, network, every prediction, validation) and
  ``<out>/scaling_<model>.png`` (speedup against workers, one panel per bandwidth, one curve per
  method; needs matplotlib, the ``plots`` extra, else the plot is skipped with a message);
* compares with ``benchmarks/results/slow_links.json`` when that measurement exists.

A CPU profile has a CPU's compute time, which is far longer than a GPU's and hides the network:
``--compute-ms`` / ``--selection-ms`` replace the measured times by yours (the byte counts stay exact).
The installed package answers the same question without this checkout: ``lightning-dgc-predict``
(:mod:`lightning_dgc.perfmodel.cli`), on the profiles ``benchmarks/results/profile_*.json`` that ship with it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from lightning_dgc.perfmodel import (
    BANDWIDTHS,
    METHODS,
    NODE_METHODS,
    WORKERS,
    Network,
    Prediction,
    Profile,
    predict,
    step_time,
    validate,
)
from lightning_dgc.perfmodel.cli import speedup_over_node, with_times

RESULTS = Path(__file__).parent / "results"
METHOD_LABELS = {
    "ddp": "DDP (dense)",
    "dgc": "DGC",
    "deft": "DEFT",
    "sparse_allreduce": "sparse all-reduce (worst)",
    "dgc_node": "DGC, two-level (dense in the node)",
    "deft_node": "DEFT, two-level (dense in the node)",
    "powersgd_node": "PowerSGD, two-level (dense in the node)",
}
#: The paper's published gradient sizes (Lin et al. 2018, Tables 4-6; "MB" there is 2^20 bytes).
PAPER_GRADIENT_MB = {"resnet50": 97.0, "alexnet": 233.0, "lstm": 195.0, "deepspeech": 488.0}
PTB_VOCAB = 10_000


def _speedup(x: float) -> str:
    return f"{x:.1f}" if x >= 9.95 else f"{x:.2f}"


def _gbit(bps: float) -> str:
    return f"{bps / 1e9:g} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:g} Mbit/s"


# -- models -----------------------------------------------------------------------------------------------
def alexnet(grouped: bool = True, num_classes: int = 1000) -> Any:
    """AlexNet (Krizhevsky et al. 2012). ``grouped``: the original two-GPU network (conv2, conv4 and conv5
    in two groups; 60,965,224 parameters, input 227x227); otherwise torchvision's single-GPU variant
    (64/192/384/256/256 channels, 61,100,840 parameters, input 224x224). Local response norm is left out
    (it has no parameters)."""
    from torch import nn

    if grouped:
        channels, groups, pad1 = (96, 256, 384, 384, 256), (1, 2, 1, 2, 2), 0
    else:
        channels, groups, pad1 = (64, 192, 384, 256, 256), (1, 1, 1, 1, 1), 2
    c1, c2, c3, c4, c5 = channels
    return nn.Sequential(
        nn.Conv2d(3, c1, 11, stride=4, padding=pad1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        nn.Conv2d(c1, c2, 5, padding=2, groups=groups[1]), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        nn.Conv2d(c2, c3, 3, padding=1, groups=groups[2]), nn.ReLU(inplace=True),
        nn.Conv2d(c3, c4, 3, padding=1, groups=groups[3]), nn.ReLU(inplace=True),
        nn.Conv2d(c4, c5, 3, padding=1, groups=groups[4]), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        nn.AdaptiveAvgPool2d(6), nn.Flatten(), nn.Dropout(),
        nn.Linear(c5 * 36, 4096), nn.ReLU(inplace=True), nn.Dropout(),
        nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Linear(4096, num_classes),
    )  # fmt: skip


@dataclass(frozen=True)
class ModelSpec:
    """How to build and feed one model for a quick profile."""

    build: Callable[[], Any]  # a LightningModule
    batch: Callable[[int], tuple[Any, ...]]  # one generated batch of the given size
    batch_size: int  # default samples per worker
    description: str


def _images(size: int, classes: int) -> Callable[[int], tuple[Any, ...]]:
    def make(batch: int) -> tuple[Any, ...]:
        import torch

        return torch.randn(batch, 3, size, size), torch.randint(0, classes, (batch,))

    return make


def _classifier(arch: str, classes: int) -> Callable[[], Any]:
    def build() -> Any:
        from lightning_dgc_recipes.vision import ImageClassifier

        return ImageClassifier(arch=arch, num_classes=classes)

    return build


def _alexnet_module() -> Any:
    import lightning as L
    import torch
    import torch.nn.functional as F

    class AlexNetClassifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.network = alexnet(grouped=True)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            images, labels = batch
            return F.cross_entropy(self.network(images), labels)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)

    return AlexNetClassifier()


def _lstm_module() -> Any:
    import torch

    from lightning_dgc_recipes.language import WordLanguageModel

    class ProfiledLanguageModel(WordLanguageModel):
        def configure_optimizers(self) -> Any:  # no validation here, so no ReduceLROnPlateau
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    return ProfiledLanguageModel(vocab_size=PTB_VOCAB)  # the paper's 2 x 1500, tied


def _tokens(batch: int, bptt: int = 35) -> tuple[Any, ...]:
    import torch

    tokens = torch.randint(0, PTB_VOCAB, (batch, bptt + 1))
    return tokens[:, :-1], tokens[:, 1:]


def _speech_module() -> Any:
    from lightning_dgc_recipes.speech import SpeechRecognizer

    return SpeechRecognizer(n_mels=80, rnn_hidden=1200, rnn_layers=7)  # the paper's 7 x 1200 GRU


def _utterances(batch: int, frames: int = 200, chars: int = 30) -> tuple[Any, ...]:
    import torch

    return (
        torch.randn(batch, 80, frames), torch.full((batch,), frames), torch.randint(1, 29, (batch, chars)),
        torch.full((batch,), chars), ["" for _ in range(batch)],
    )  # fmt: skip


MODELS: dict[str, ModelSpec] = {
    "resnet50": ModelSpec(
        _classifier("resnet50", 1000), _images(224, 1000), 16, "ImageNet ResNet-50, 224 px"
    ),
    "alexnet": ModelSpec(
        _alexnet_module, _images(227, 1000), 32, "ImageNet AlexNet (two-GPU original), 227 px"
    ),
    "lstm_paper": ModelSpec(_lstm_module, _tokens, 20, "PTB 2 x 1500 LSTM, tied, 10k words, BPTT 35"),
    "deepspeech": ModelSpec(_speech_module, _utterances, 4, "DeepSpeech 7 x 1200 GRU, 200 frames"),
}


def _slow_links_workloads() -> dict[str, dict[str, Any]]:
    """The synthetic workloads of :mod:`benchmarks.slow_links` (``resnet20``, ``resnet110``, ``lstm``)."""
    try:
        from benchmarks.common import WORKLOADS
    except ImportError:
        return {}
    return WORKLOADS


def model_names() -> list[str]:
    return sorted({*MODELS, *_slow_links_workloads()})


def profile_model(
    model: str, batch_size: int | None = None, steps: int = 3, warmup: int = 1, density: float = 0.001,
    accelerator: str = "auto", path: Path | None = None,
) -> Profile:  # fmt: skip
    """Profile ``model`` for ``warmup + steps`` optimizer steps in one process under ``DGCStrategy``.

    The workloads of :mod:`benchmarks.slow_links` (same module, batch and Trainer arguments, from
    :func:`benchmarks.common.build_workload`) are profiled as that benchmark trains them, so that
    :func:`~lightning_dgc.perfmodel.validate` compares like with like; the others come from :data:`MODELS`.
    """
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_dgc import DGCStrategy
    from lightning_dgc.front.profiler import ExchangeProfiler

    workloads = _slow_links_workloads()
    extra: dict[str, Any] = {}
    if model in workloads:
        from benchmarks.common import build_workload

        batch_size = batch_size or workloads[model]["batch_size"]
        module, loader, extra = build_workload(model, batch_size, warmup + steps)
    else:
        spec = MODELS[model]
        batch_size = batch_size or spec.batch_size
        module = spec.build()
        loader = DataLoader([spec.batch(batch_size) for _ in range(warmup + steps)], batch_size=None)
    profiler = ExchangeProfiler(warmup_steps=warmup, model_name=model, path=path)
    trainer = L.Trainer(
        strategy=DGCStrategy(density=density), accelerator=accelerator, devices=1, max_steps=warmup + steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[profiler], **extra,
    )  # fmt: skip
    trainer.fit(module, loader)
    assert profiler.profile is not None
    return profiler.profile


def add_shapes(path: Path, model: str) -> Profile:
    """Rewrite the profile JSON at ``path``, written with its tensors' sizes only (``sparse_numels``), with
    every bucket's tensor shapes and names: ``model`` is run for two optimizer steps of batch 2 as
    :func:`profile_model` runs it, which gives DDP's bucket layout. Each bucket's size, DDP bytes and
    compressed tensor sizes must equal the profile's; every measured time of the profile is kept."""
    data = json.loads(path.read_text())
    old = data["buckets"]
    layout = profile_model(model, batch_size=2, steps=1, warmup=1).buckets
    for i, (new, before) in enumerate(zip(layout, old, strict=False)):
        compressed = [math.prod(s) for s in new.shapes if len(s) > 1 and math.prod(s) >= 1024]
        if (new.numel, new.dense_bytes, compressed) != (before["numel"], before["dense_bytes"], before["sparse_numels"]):
            raise ValueError(f"{path}: bucket {i} of {model!r} differs from the profile's; was it profiled from this model?")
    if len(layout) != len(old):
        raise ValueError(f"{path}: {model!r} has {len(layout)} buckets, the profile {len(old)}.")
    data["buckets"] = [asdict(b) for b in layout]
    command = f"python -m benchmarks.scaling_model --model {model} --add-shapes {path.as_posix()}"
    data["notes"] = [*data.get("notes", []), f"bucket shapes and names added by `{command}`; times as measured"]
    path.write_text(json.dumps(data, indent=1))
    return Profile.from_dict(data)


# -- sanity: the paper's gradient sizes --------------------------------------------------------------
def gradient_sizes() -> list[dict[str, Any]]:
    """Parameters and fp32 gradient size of the paper's models and the configurations around them."""
    import torch

    from lightning_dgc_recipes.language import WordLanguageModel
    from lightning_dgc_recipes.resnet import ResNet50

    def count(module: Any) -> int:
        return sum(p.numel() for p in module.parameters())

    rows: list[tuple[str, str, int]] = []
    with torch.device("meta"):
        rows.append(("resnet50", "ResNet-50, 1000 classes (lightning_dgc_recipes.resnet.ResNet50)", count(ResNet50())))
        rows.append(("alexnet", "AlexNet, original two-GPU (grouped conv2/4/5)", count(alexnet(True))))
        rows.append(("alexnet", "AlexNet, torchvision single-GPU variant", count(alexnet(False))))
        for tied in (True, False):
            lm = WordLanguageModel(vocab_size=PTB_VOCAB, tie_weights=tied)
            rows.append(("lstm", f"PTB LSTM 2 x 1500, 10k words, {'tied' if tied else 'untied'}", count(lm)))
        try:
            from lightning_dgc_recipes.speech import DeepSpeech

            for mels, what in ((80, "80 mel bands (recipe)"), (161, "161 STFT bins (20 ms window)"),
                               (264, "264 input bands (fitted to the paper's size)")):  # fmt: skip
                ds = DeepSpeech(n_mels=mels, conv_channels=32, rnn_hidden=1200, rnn_layers=7)
                rows.append(("deepspeech", f"DeepSpeech 7 x 1200 bi-GRU, {what}", count(ds)))
        except ImportError as err:  # the speech extra (torchaudio, soundfile) is missing
            rows.append(("deepspeech", f"DeepSpeech: not built ({err})", 0))
    out = []
    for key, what, params in rows:
        mib = params * 4 / 2**20
        paper = PAPER_GRADIENT_MB[key]
        out.append(
            {
                "model": key, "configuration": what, "parameters": params, "MiB": mib, "MB": params * 4 / 1e6,
                "paper_MB": paper, "difference_MiB": mib - paper, "matches": abs(mib - paper) < 0.5,
            }
        )  # fmt: skip
    return out


def print_sanity(console: Console, rows: list[dict[str, Any]]) -> None:
    table = Table(title="Gradient size per step from parameter shapes (fp32; the paper's MB are 2^20 bytes)")
    for column in ("configuration", "parameters", "MiB", "MB (10^6)", "paper", "difference"):
        table.add_column(column, justify="left" if column == "configuration" else "right")
    for r in rows:
        style = "green" if r["matches"] else None
        table.add_row(
            r["configuration"], f"{r['parameters']:,}", f"{r['MiB']:.2f}", f"{r['MB']:.1f}",
            f"{r['paper_MB']:g}", f"{r['difference_MiB']:+.2f}", style=style,
        )  # fmt: skip
    console.print(table)


# -- printing and plotting ----------------------------------------------------------------------------
def print_table(console: Console, prediction: Prediction, overlap: bool, methods: Sequence[str]) -> None:
    p = prediction.profile
    bandwidths = sorted({r["bandwidth_bps"] for r in prediction.rows})
    title = (
        f"{p.model}: speedup over one worker, {'with' if overlap else 'without'} overlap of communication and"
        f" backward (compute {p.compute_s * 1e3:.1f} ms, selection {p.selection_s * 1e3:.1f} ms per step)"
    )
    table = Table(title=title)
    table.add_column("workers", justify="right")
    for bw in bandwidths:
        for m in methods:
            table.add_column(f"{_gbit(bw)}\n{METHOD_LABELS[m].split(' (')[0]}", justify="right")
    for n in sorted({r["workers"] for r in prediction.rows}):
        cells = [
            _speedup(prediction.lookup(m, n, bw, overlap)["speedup"]) for bw in bandwidths for m in methods
        ]
        table.add_row(str(n), *cells)
    console.print(table)


def plot(prediction: Prediction, path: Path, methods: Sequence[str]) -> Path | None:
    """Speedup against workers in the style of the DGC paper's Figure 6: one panel per bandwidth, one
    curve per method (solid: with overlap of communication and backward, dashed: without)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    colors = {"ddp": "tab:gray", "dgc": "tab:red", "deft": "tab:blue", "sparse_allreduce": "tab:orange",
              "dgc_node": "tab:purple", "deft_node": "tab:cyan", "powersgd_node": "tab:green"}  # fmt: skip
    bandwidths = sorted({r["bandwidth_bps"] for r in prediction.rows})
    workers = sorted({r["workers"] for r in prediction.rows})
    fig, axes = plt.subplots(
        1, len(bandwidths), figsize=(4.2 * len(bandwidths), 4.4), sharey=True, squeeze=False
    )
    for ax, bw in zip(axes[0], bandwidths, strict=True):
        ax.plot(workers, workers, color="black", linewidth=0.8, alpha=0.35, label="linear")
        for m in methods:
            for overlap in (True, False):
                ys = [prediction.lookup(m, n, bw, overlap)["speedup"] for n in workers]
                ax.plot(workers, ys, color=colors[m], linestyle="-" if overlap else "--", marker="o", markersize=3,
                        label=f"{METHOD_LABELS[m]}{'' if overlap else ', no overlap'}")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(workers, [str(n) for n in workers])
        ax.set_ylim(0, max(workers) * 1.02)
        ax.set_xlabel("number of workers")
        ax.set_title(_gbit(bw))
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("speedup over one worker")
    axes[0][0].legend(fontsize=7, loc="upper left")
    p = prediction.profile
    source = "set" if any(n.startswith("compute_s set") for n in p.notes) else f"measured on {p.device}"
    fig.suptitle(
        f"{p.model}: predicted speedup (compute {p.compute_s * 1e3:.0f} ms/step {source}, selection"
        f" {p.selection_s * 1e3:.0f} ms, gradient {p.dense_bytes / 2**20:.1f} MiB, density {p.density:g},"
        f" {prediction.network.gpus_per_node} worker(s) per node, latency {prediction.network.latency * 1e6:g} us)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def highlights(prediction: Prediction, nodes: int = 64) -> dict[str, Any]:
    """The DGC paper's Figure 6 comparison at ``nodes`` nodes: dense on 10 Gbit/s against DGC (and DEFT)
    on 1 Gbit/s. Speedups are over one node (``gpus_per_node`` workers; one worker on a flat network),
    with and without overlap."""
    g = prediction.network.gpus_per_node
    workers = nodes * g
    out: dict[str, Any] = {"nodes": nodes, "workers": workers, "gpus_per_node": g}
    cases = [("ddp_10g", "ddp", 10e9), ("ddp_1g", "ddp", 1e9), ("dgc_1g", "dgc", 1e9), ("deft_1g", "deft", 1e9),
             ("powersgd_1g", "powersgd", 1e9), ("dgc_10g", "dgc", 10e9), ("deft_10g", "deft", 10e9),
             ("powersgd_10g", "powersgd", 10e9), ("sparse_allreduce_1g", "sparse_allreduce", 1e9)]  # fmt: skip
    if g > 1:  # the two-level exchange of every algorithm: dgc_node_1g, ...
        cases += [(f"{m}_1g", m, 1e9) for m in NODE_METHODS] + [(f"{m}_10g", m, 10e9) for m in NODE_METHODS]
    for key, method, bw in cases:
        for overlap in (True, False):
            net = prediction.network_at(bw)
            out[f"{key}{'' if overlap else '_no_overlap'}"] = speedup_over_node(prediction.profile, method, workers, net, overlap)
    if g > 1:
        out["selection_sweep"] = selection_sweep(prediction, nodes)
    out["paper"] = (
        "Lin et al. 2018, Figure 6 (nodes of 4 Titan Xp GPUs): AlexNet on 64 nodes, about 30x with dense"
        " training on 10 Gbit/s Ethernet against about 40x with DGC on 1 Gbit/s; the same figure plots"
        " ResNet-50 (compare with its curve there)."
    )
    return out


#: Selection times (ms per step, DGC's top-k over one GPU's whole gradient) of the sweep below.
SELECTION_MS = (0.0, 5.0, 10.0, 25.0, 50.0, 100.0)


def selection_sweep(prediction: Prediction, nodes: int = 64) -> list[dict[str, float]]:
    """What a GPU's selection time does at ``nodes`` nodes on 1 Gbit/s: flat DGC runs the top-k over the
    whole gradient on every GPU, the two-level exchange over a ``1/gpus_per_node`` shard. Per method, the
    step time (``<method>_ms``) and the speedup over one node that trains without any exchange (its step is
    the compute time alone, whatever the selection costs): ``nodes * compute / step``. The profile's own
    selection time is one of the rows."""
    g = prediction.network.gpus_per_node
    slow, fast = prediction.network_at(1e9), prediction.network_at(10e9)
    rows = []
    for ms in sorted({*SELECTION_MS, round(prediction.profile.selection_s * 1e3, 1)}):
        profile = replace(prediction.profile, selection_s=ms / 1e3)
        row: dict[str, float] = {"selection_ms": ms}
        for method, net in (("dgc", slow), ("dgc_node", slow), ("deft", slow), ("deft_node", slow), ("ddp", fast)):
            step = step_time(profile, method, nodes * g, net).total_s
            key = "ddp_10g" if method == "ddp" else method
            row[key] = nodes * profile.compute_s / step
            row[f"{key}_ms"] = step * 1e3
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="resnet50", choices=model_names())
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads while profiling (slow_links: 1)"
    )
    parser.add_argument("--profile", type=Path, default=None, help="a profile JSON from ExchangeProfiler")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--batch-size", type=int, default=None, help="samples per worker and step")
    parser.add_argument("--steps", type=int, default=2, help="measured steps (profiling only)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps (profiling only)")
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--compute-ms", type=float, default=None, help="replace the measured compute time")
    parser.add_argument(
        "--selection-ms", type=float, default=None, help="replace the measured selection time"
    )
    parser.add_argument("--latency-us", type=float, default=50.0, help="per message step on the slow links")
    parser.add_argument("--gpus-per-node", type=int, default=1, help="> 1: hierarchical (fast local bus)")
    parser.add_argument("--local-gbps", type=float, default=100.0, help="local bus bandwidth, Gbit/s")
    parser.add_argument("--nic", default="node", choices=["node", "gpu"],
                        help="two-level methods: one network card per node (shared by its GPUs) or per GPU")  # fmt: skip
    parser.add_argument("--algorithm", default="ring", choices=["ring", "best"],
                        help="collectives: ring, or the cheaper of ring and recursive doubling")  # fmt: skip
    parser.add_argument("--bandwidths", default=",".join(f"{b / 1e9:g}" for b in BANDWIDTHS), help="Gbit/s")
    parser.add_argument("--measured", type=Path, default=RESULTS / "slow_links.json")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--sanity", action="store_true", help="print the paper's gradient sizes and exit")
    parser.add_argument("--add-shapes", type=Path, default=None, metavar="PROFILE",
                        help="add --model's tensor shapes to a profile JSON that holds only their sizes, then exit")  # fmt: skip
    args = parser.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 180)

    if args.sanity:
        rows = gradient_sizes()
        print_sanity(console, rows)
        console.print(
            "ResNet-50, AlexNet (original) and the tied PTB LSTM reproduce the paper in 2^20-byte MB. No DeepSpeech"
            " configuration tried does: 7 x 1200 bi-GRUs after two 32-channel convolutions need 127.95 M"
            " parameters for 488.08 MiB (a 264-band input, 488.01 MiB) or 122.02 M for 488.08 decimal MB (161 STFT"
            " bins give 122.17 M, 488.68 MB); the paper does not state its input features."
        )
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gradient_sizes.json").write_text(json.dumps(rows, indent=1))
        return {"gradient_sizes": rows}

    if args.add_shapes is not None:
        profile = add_shapes(args.add_shapes, args.model)
        console.print(f"Wrote {args.add_shapes}: {sum(len(b.shapes) for b in profile.buckets)} tensors' shapes")
        return {"profile": profile.to_dict()}

    if args.profile is not None:
        profile = Profile.load(args.profile)
        if args.batch_size is not None:
            profile = replace(profile, batch_size=args.batch_size)
    else:
        what = (
            MODELS[args.model].description
            if args.model in MODELS
            else _slow_links_workloads()[args.model]["what"]
        )
        console.print(f"Profiling {what} ({args.warmup} + {args.steps} steps, one process)")
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        profile = profile_model(
            args.model, args.batch_size, args.steps, args.warmup, args.density, args.accelerator,
            path=args.out / f"profile_{args.model}.json",
        )  # fmt: skip
    profile = with_times(profile, args.compute_ms, args.selection_ms)

    bandwidths = [float(b) * 1e9 for b in args.bandwidths.split(",")]
    network = Network(
        bandwidth=bandwidths[0], latency=args.latency_us * 1e-6, gpus_per_node=args.gpus_per_node,
        local_bandwidth=args.local_gbps * 1e9, algorithm=args.algorithm, nic=args.nic,
    )  # fmt: skip
    methods = METHODS + NODE_METHODS if args.gpus_per_node > 1 else METHODS
    prediction = predict(profile, WORKERS, bandwidths, methods, network)

    console.print(
        f"[bold]{profile.model}[/bold] on {profile.device}: {profile.numel:,} values in {len(profile.buckets)}"
        f" buckets; per step and worker DDP all-reduces {profile.dense_bytes / 2**20:.2f} MiB, DGC sends"
        f" {profile.bytes_sent('dgc', 64) / 2**20:.3f} MiB (density {profile.density:g}), DEFT"
        f" {profile.bytes_sent('deft', 64) / 2**20:.3f} MiB at 64 workers. Latency {args.latency_us:g} us,"
        f" {args.gpus_per_node} worker(s) per node."
    )
    for note in profile.notes:
        console.print(f"  note: {note}")
    shown: tuple[str, ...] = ("ddp", "dgc", "deft") + (("dgc_node", "deft_node") if args.gpus_per_node > 1 else ())
    print_table(console, prediction, True, shown)
    print_table(console, prediction, False, shown)

    h = highlights(prediction)
    console.print(
        f"[bold]64 nodes[/bold] ({h['workers']} workers), speedup over one node with overlap (without):"
        f" dense DDP on 10 Gbit/s {h['ddp_10g']:.1f}x ({h['ddp_10g_no_overlap']:.1f}x), DGC on 1 Gbit/s"
        f" {h['dgc_1g']:.1f}x ({h['dgc_1g_no_overlap']:.1f}x), DEFT on 1 Gbit/s {h['deft_1g']:.1f}x"
        f" ({h['deft_1g_no_overlap']:.1f}x), PowerSGD on 1 Gbit/s {h['powersgd_1g']:.1f}x ({h['powersgd_1g_no_overlap']:.1f}x); dense on 1 Gbit/s {h['ddp_1g']:.1f}x, worst-case sparse all-reduce"
        f" on 1 Gbit/s {h['sparse_allreduce_1g']:.1f}x.\n  Paper: {h['paper']}"
    )
    if args.gpus_per_node > 1:
        console.print(
            "  Two-level (dense inside the node, the algorithm across nodes on each GPU's shard; one network card"
            f" per {'node' if args.nic == 'node' else 'GPU'}), on 1 Gbit/s (10 Gbit/s): "
            + ", ".join(f"{m} {h[m + '_1g']:.1f}x ({h[m + '_10g']:.1f}x)" for m in NODE_METHODS)
            + "."
        )
        sweep = Table(title=f"What a GPU's selection time does at 64 nodes x {args.gpus_per_node} on 1 Gbit/s: step time"
                      " and speedup over one node without exchange (its step: the compute alone), overlap")  # fmt: skip
        for column in ("selection ms/step", "DGC", "DGC two-level", "DEFT", "DEFT two-level", "DDP 10 Gbit/s"):
            sweep.add_column(column, justify="right")
        for r in h["selection_sweep"]:
            keys = ("dgc", "dgc_node", "deft", "deft_node", "ddp_10g")
            sweep.add_row(f"{r['selection_ms']:g}", *(f"{r[k + '_ms']:.0f} ms, {r[k]:.1f}x" for k in keys))
        console.print(sweep)

    rows = validate(prediction, args.measured, print_fn=console.print)
    if rows:
        table = Table(title=f"Predicted vs measured step time ({args.measured})")
        columns = ("strategy", "workers", "link", "measured", "predicted", "no overlap", "error",
                   "predicted, shared-CPU compute", "error")  # fmt: skip
        for column in columns:
            table.add_column(column, justify="right")
        for r in rows:
            shared = r.get("predicted_shared_compute_s")
            table.add_row(
                r["strategy"], str(r["workers"]), _gbit(r["bandwidth_bps"]), f"{r['measured_s'] * 1e3:.1f} ms",
                f"{r['predicted_s'] * 1e3:.1f} ms", f"{r['predicted_no_overlap_s'] * 1e3:.1f} ms", f"{r['error']:+.0%}",
                f"{shared * 1e3:.1f} ms" if shared else "-",
                f"{r['error_shared_compute']:+.0%}" if shared else "-",
            )  # fmt: skip
        console.print(table)

    args.out.mkdir(parents=True, exist_ok=True)
    result = {**prediction.to_dict(), "highlights": h, "validation": rows}
    json_path = args.out / f"scaling_{profile.model}.json"
    json_path.write_text(json.dumps(result, indent=1, default=str))
    console.print(f"Wrote {json_path}")
    if not args.no_plot:
        png = plot(prediction, args.out / f"scaling_{profile.model}.png", shown)
        console.print(
            f"Wrote {png}" if png else "matplotlib is not installed (pip install '.[plots]'): no plot."
        )
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
