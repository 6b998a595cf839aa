"""The demo: the same small ResNet trained with 2 CPU processes under ``ddp``, ``dgc`` and ``deft``.

    python -m lightning_dgc_recipes.demo [--steps 350] [--density 0.001] [--algos ddp dgc deft] [--plot loss.png]

It runs offline: a small CIFAR-10-format dataset (the original pickle layout, read by the real
``CIFAR10DataModule``) is generated into a temporary folder, with a class signal the network can
learn. Each algorithm trains in its own 2-process run through Lightning's popen launcher, the
compressed ones as the DGC paper sets them up: the density warms up (0.25, 0.0625, 0.015625, 0.004,
over the first 20% of the steps) before it reaches ``--density``. A table then shows, side by side:

* the validation accuracy, and its difference to ``ddp`` (the target: within 2 points);
* the bytes each rank sent in the last step and the compression ratio;
* the step time measured here, where both processes share one machine and talk over loopback:
  communication is almost free, so the compressed runs show their selection work and none of the
  saving;
* the step time **predicted** for 2 workers on 100 Mbit/s and 1 Gbit/s links by
  :mod:`lightning_dgc.perfmodel`, from each run's measured compute and exact bytes
  (:class:`lightning_dgc.ExchangeProfiler`): a model, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ALGORITHMS = ("ddp", "dgc", "deft")
#: The paper's final density; the warm-up before it is :func:`warmup_densities`.
DEMO_DENSITY = 0.001
DEMO_STEPS = 350
DEMO_BATCH = 16  # per process
#: Pixel noise of the generated images (std, in 0-255 units): ddp is not at 100% after the first 200 steps.
DEMO_NOISE = 160.0
#: Links of the predicted step times (bits/s).
LINKS = {"100 Mbit/s": 100e6, "1 Gbit/s": 1e9}


def warmup_densities(steps: int, final: float) -> list[float]:
    """The paper's warm-up stages (0.25, 0.0625, 0.015625, 0.004) over the first 20% of ``steps``, as
    ``SparsityWarmup(run_fraction=0.2)`` spreads them, as a per-step list."""
    from lightning_dgc.schedules.warmup import spread_warmup

    return spread_warmup(steps, 0.2, final)


def write_synthetic_cifar(
    root: Path, train_per_class: int = 64, test_per_class: int = 16, seed: int = 0, noise: float = 64.0
) -> None:
    """Write ``root/cifar-10-batches-py`` in the original format: every class has its own colour pattern."""
    rng = np.random.default_rng(seed)
    patterns = rng.integers(40, 216, size=(10, 3, 8, 8)).repeat(4, axis=2).repeat(4, axis=3)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)

    def batch(per_class: int, label: str) -> dict[bytes, Any]:
        labels = np.repeat(np.arange(10), per_class)
        rng.shuffle(labels)
        pixel_noise = rng.normal(0.0, noise, size=(labels.size, 3, 32, 32))
        images = np.clip(patterns[labels] + pixel_noise, 0, 255).astype(np.uint8).reshape(labels.size, 3072)
        return {
            b"batch_label": label.encode(),
            b"labels": labels.tolist(),
            b"data": images,
            b"filenames": [f"synthetic_{i:05d}.png".encode() for i in range(labels.size)],
        }

    with open(folder / "data_batch_1", "wb") as f:
        pickle.dump(batch(train_per_class, "training batch 1 of 1"), f)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump(batch(test_per_class, "testing batch 1 of 1"), f)
    with open(folder / "batches.meta", "wb") as f:
        names = [
            b"airplane",
            b"automobile",
            b"bird",
            b"cat",
            b"deer",
            b"dog",
            b"frog",
            b"horse",
            b"ship",
            b"truck",
        ]
        pickle.dump(
            {b"label_names": names, b"num_cases_per_batch": 10 * train_per_class, b"num_vis": 3072}, f
        )


def _worker(algo: str, root: str, steps: int, density: float, out: str) -> None:
    """One training run (executed in each of the 2 processes by Lightning's launcher)."""
    import lightning as L
    import torch

    import lightning_dgc
    from lightning_dgc_recipes.vision import CIFAR10DataModule, ImageClassifier

    torch.set_num_threads(1)

    class Recorder(L.Callback):
        """Step times, the training loss per step, and the last step's compression statistics."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.selection_ms: list[float] = []  # the compressor's own work in each step, as the exchange timed it
            self.losses: list[float] = []
            self.stats: dict[str, Any] = {}
            self._start = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            self.times.append(time.perf_counter() - self._start)
            self.losses.append(float(outputs["loss"]) if isinstance(outputs, dict) else float(outputs))
            if isinstance(trainer.strategy, lightning_dgc.CompressionStrategy):
                self.stats = trainer.strategy.compression_stats()
                self.selection_ms.append(float(self.stats.get("selection_ms", 0.0)))

    L.seed_everything(0, verbose=False)
    warmup = warmup_densities(steps, density)
    callbacks: list[Any] = []
    if algo == "ddp":
        strategy: Any = "ddp"
    else:
        strategy = (lightning_dgc.DGCStrategy if algo == "dgc" else lightning_dgc.DEFTStrategy)(
            density=density
        )
        callbacks.append(lightning_dgc.SparsityWarmup(densities=warmup, interval="step"))
    recorder = Recorder()
    profile_path = Path(out).with_suffix(".profile.json")
    # timed after the warm-up, at the final density; byte counts at --density under ddp too
    profiler = lightning_dgc.ExchangeProfiler(warmup_steps=len(warmup), path=profile_path, density=density)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=10_000,  # validate once, after training
        callbacks=[*callbacks, recorder, profiler],
    )
    model = ImageClassifier(arch="resnet20", lr=0.05, milestones=())
    data = CIFAR10DataModule(root=root, batch_size=DEMO_BATCH, num_workers=0, download=False, augment=False)
    trainer.fit(model, data)
    metrics = trainer.validate(model, data, verbose=False)[0]
    lightning_dgc.destroy_process_group()  # "ddp" runs too: gloo can abort at exit with its group alive
    if trainer.global_rank == 0:
        dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        measured = recorder.times[len(warmup) :] or recorder.times
        result = {
            "algo": algo,
            "steps": steps,
            "warmup_steps": len(warmup) if algo != "ddp" else 0,
            "val_acc": metrics["val_acc"],
            "val_loss": metrics["val_loss"],
            "step_ms": statistics.median(measured) * 1e3,
            "selection_ms": statistics.median(recorder.selection_ms[len(warmup) :] or [0.0]),
            "bytes_sent": recorder.stats.get("bytes_sent", dense_bytes),
            "compression_ratio": recorder.stats.get("compression_ratio", 1.0),
            "density": recorder.stats.get("density", 1.0),
            "losses": recorder.losses,
            "profile": str(profile_path),
        }
        Path(out).write_text(json.dumps(result))


def predicted_steps(result: dict[str, Any]) -> dict[str, float]:
    """Milliseconds per step of ``result``'s algorithm for 2 workers on each of :data:`LINKS`."""
    from lightning_dgc.perfmodel import Network, Profile, step_time

    profile = Profile.load(result["profile"])
    return {
        # no overlap: DDP's first bucket (1 MB) holds 97% of ResNet-20's gradients and is ready only at the
        # end of the backward pass, so the exchange cannot hide behind it
        link: step_time(profile, result["algo"], 2, Network(bandwidth=bits), overlap=False).total_s * 1e3
        for link, bits in LINKS.items()
    }


def run(algos: list[str], steps: int, density: float, console: Any) -> list[dict[str, Any]]:
    """Train every algorithm in its own 2-process run on generated data; their results, with predictions."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_synthetic_cifar(root, test_per_class=50, noise=DEMO_NOISE)
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK")}
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        for algo in algos:
            out = root / f"{algo}.json"
            console.print(f"[bold]training ResNet-20 with 2 processes under {algo}[/bold] ({steps} steps)")
            cmd = [
                sys.executable,
                "-m",
                "lightning_dgc_recipes.demo",
                "--worker",
                algo,
                "--root",
                str(root),
                "--out",
                str(out),
            ]
            cmd += ["--steps", str(steps), "--density", str(density)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                console.print(proc.stdout[-2000:], proc.stderr[-4000:])
                raise SystemExit(f"the {algo} run failed (exit code {proc.returncode}); its output is above")
            result = json.loads(out.read_text())
            result["predicted_ms"] = predicted_steps(result)
            results.append(result)
    return results


def table(results: list[dict[str, Any]], density: float) -> Any:
    from rich.table import Table

    steps = results[0]["steps"] if results else 0
    warmup = next((r["warmup_steps"] for r in results if r["warmup_steps"]), 0)
    out = Table(
        title=f"ResNet-20, generated CIFAR-10-format data, 2 CPU processes, {steps} steps",
        caption=(
            f"density: after a warm-up of {warmup} steps (0.25, 0.0625, 0.015625, 0.004). sent/step: bytes"
            " each rank sent in the last step; ratio: dense bytes / sent. step (here): measured on this machine,"
            " both processes over loopback, where communication is nearly free, so compression shows only"
            f" its extra work, of which selection: the exchange's own timing. At {DEMO_BATCH} images per process"
            " a step computes a quarter of the CIFAR recipe's 64, while the compressor's work per step is the"
            " same: its share of the step is about four times the recipe's (benchmarks/results/"
            "overhead_recipe.json). *: the step PREDICTED for 2 workers on that link by lightning_dgc.perfmodel"
            " from each run's measured compute and exact bytes, the exchange after the backward pass (DDP's"
            " first bucket holds nearly all of ResNet-20): a model, not a measurement."
        ),
    )
    base = next((r["val_acc"] for r in results if r["algo"] == "ddp"), None)
    columns = ["algorithm", "density", "val acc", "vs ddp", "sent/step", "ratio", "step (here)", "selection",
               *[f"{link}*" for link in LINKS]]  # fmt: skip
    for column in columns:
        out.add_column(column, justify="right")
    for r in results:
        out.add_row(
            r["algo"],
            f"{r['density']:g}",
            f"{100 * r['val_acc']:.1f}%",
            "" if base is None or r["algo"] == "ddp" else f"{100 * (r['val_acc'] - base):+.1f} pt",
            f"{r['bytes_sent'] / 1e3:,.1f} kB",
            f"{r['compression_ratio']:.0f}x",
            f"{r['step_ms']:.0f} ms",
            f"{r.get('selection_ms', 0.0):.1f} ms" if r["algo"] != "ddp" else "",
            *[f"{r['predicted_ms'][link]:.0f} ms" for link in LINKS],
        )
    return out


def plot(results: list[dict[str, Any]], path: Path) -> Path:
    """Training loss (rank 0) against the optimizer step, one line per algorithm."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise SystemExit("--plot needs matplotlib: pip install 'lightning-dgc[plots]'") from error
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in results:
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["algo"], linewidth=1)
    warmup = next((r["warmup_steps"] for r in results if r["warmup_steps"]), 0)
    if warmup:
        ax.axvline(warmup, color="grey", linestyle=":", linewidth=1, label="end of warm-up")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (rank 0)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=DEMO_STEPS, help="optimizer steps per algorithm")
    parser.add_argument("--density", type=float, default=DEMO_DENSITY, help="density after the warm-up")
    parser.add_argument("--algos", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument("--plot", type=Path, default=None, help="write the loss curves to this PNG")
    parser.add_argument("--worker", choices=ALGORITHMS, help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 20:
        parser.error("--steps must be at least 20 (the warm-up takes 20% of them)")
    if args.worker:
        _worker(args.worker, args.root, args.steps, args.density, args.out)
        return []

    from rich.console import Console

    from lightning_dgc.algorithms.checks import check_density

    check_density(args.density, "--density")
    console = Console() if sys.stdout.isatty() else Console(width=150)  # (a pipe: the whole table)
    results = run(args.algos, args.steps, args.density, console)
    console.print(table(results, args.density))
    if args.plot is not None:
        console.print(f"wrote {plot(results, args.plot)}")
    return results


if __name__ == "__main__":
    main()
