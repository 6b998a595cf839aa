"""The demo: the same small ResNet trained with 2 CPU processes under ``ddp``, ``dgc`` and ``deft``.

    python -m recipes.demo [--steps 40] [--algos ddp dgc deft]

It runs offline: a small CIFAR-10-format dataset (the original pickle layout, read by the real
``CIFAR10DataModule``) is generated into a temporary folder, with a class signal the network can
learn. Each algorithm trains in its own 2-process run through Lightning's popen launcher, and a
rich table shows, side by side, the validation accuracy, the bytes each rank sent per step, the
compression ratio and the median step time.
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
#: 1% rather than the paper's 0.1%: the demo trains for a few dozen steps only, without warm-up.
DEMO_DENSITY = 0.01


def write_synthetic_cifar(
    root: Path, train_per_class: int = 64, test_per_class: int = 16, seed: int = 0
) -> None:
    """Write ``root/cifar-10-batches-py`` in the original format: every class has its own colour pattern."""
    rng = np.random.default_rng(seed)
    patterns = rng.integers(40, 216, size=(10, 3, 8, 8)).repeat(4, axis=2).repeat(4, axis=3)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)

    def batch(per_class: int, label: str) -> dict[bytes, Any]:
        labels = np.repeat(np.arange(10), per_class)
        rng.shuffle(labels)
        noise = rng.normal(0.0, 64.0, size=(labels.size, 3, 32, 32))
        images = np.clip(patterns[labels] + noise, 0, 255).astype(np.uint8).reshape(labels.size, 3072)
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


def _worker(algo: str, root: str, steps: int, out: str) -> None:
    """One training run (executed in each of the 2 processes by Lightning's launcher)."""
    import lightning as L
    import torch

    import lightning_dgc
    from recipes.vision import CIFAR10DataModule, ImageClassifier

    torch.set_num_threads(1)

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.stats: dict[str, Any] = {}
            self._start = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # type: ignore[no-untyped-def]
            self._start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
            self.times.append(time.perf_counter() - self._start)
            if isinstance(trainer.strategy, lightning_dgc.DGCStrategy):
                self.stats = trainer.strategy.compression_stats()

    L.seed_everything(0, verbose=False)
    strategies = {
        "ddp": lambda: "ddp",
        "dgc": lambda: lightning_dgc.DGCStrategy(density=DEMO_DENSITY),
        "deft": lambda: lightning_dgc.DEFTStrategy(density=DEMO_DENSITY),
    }
    strategy: Any = strategies[algo]()
    timer = StepTimer()
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
        callbacks=[timer],
    )
    model = ImageClassifier(arch="resnet20", lr=0.05, milestones=())
    data = CIFAR10DataModule(root=root, batch_size=32, num_workers=0, download=False, augment=False)
    trainer.fit(model, data)
    metrics = trainer.validate(model, data, verbose=False)[0]
    lightning_dgc.destroy_process_group()  # "ddp" runs too: gloo can abort at exit with its group alive
    if trainer.global_rank == 0:
        dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        result = {
            "algo": algo,
            "val_acc": metrics["val_acc"],
            "val_loss": metrics["val_loss"],
            "step_ms": statistics.median(timer.times[5:] or timer.times) * 1e3,
            "bytes_sent": timer.stats.get("bytes_sent", dense_bytes),
            "compression_ratio": timer.stats.get("compression_ratio", 1.0),
            "density": timer.stats.get("density", 1.0),
        }
        Path(out).write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per algorithm")
    parser.add_argument("--algos", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument("--worker", choices=ALGORITHMS, help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.root, args.steps, args.out)
        return []

    from rich.console import Console
    from rich.table import Table

    console = Console()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_synthetic_cifar(root)
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK")}
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        for algo in args.algos:
            out = root / f"{algo}.json"
            console.print(
                f"[bold]training ResNet-20 with 2 processes under {algo}[/bold] ({args.steps} steps)"
            )
            cmd = [sys.executable, "-m", "recipes.demo", "--worker", algo, "--root", str(root)]
            cmd += ["--out", str(out), "--steps", str(args.steps)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                console.print(proc.stdout[-2000:], proc.stderr[-4000:])
                raise SystemExit(f"the {algo} run failed")
            results.append(json.loads(out.read_text()))

    table = Table(title="ResNet-20 on generated CIFAR-10-format data, 2 CPU processes")
    for column in (
        "algorithm",
        "density",
        "val accuracy",
        "bytes sent / step / rank",
        "compression",
        "step time",
    ):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            r["algo"],
            f"{r['density']:g}",
            f"{100 * r['val_acc']:.1f}%",
            f"{r['bytes_sent'] / 1e3:,.1f} kB",
            f"{r['compression_ratio']:.1f}x",
            f"{r['step_ms']:.0f} ms",
        )
    console.print(table)
    return results


if __name__ == "__main__":
    main()
