"""The compression scalars a user sees in TensorBoard, drawn from a real recipe run's event file.

    python -m benchmarks.tensorboard_figure [--data-root ../shared/data] [--epochs 6]
    python -m benchmarks.tensorboard_figure --logdir lightning_logs/cifar10_resnet20_cpu/version_0

Without ``--logdir`` it runs the CIFAR-10 recipe under DGC with the paper's warm-up, as a user would
(``python -m lightning_dgc_recipes fit --config configs/cifar10_resnet20_cpu.yaml --config
configs/algo/dgc_warmup.yaml``, 2 CPU processes, ``--epochs`` epochs, ``CompressionMonitor`` every 10
steps), on ``<data-root>/cifar10-subset`` or, with ``--data-root`` absent, on the demo's generated
CIFAR-10-format data. It then reads the TensorBoard event file with TensorBoard's own reader and plots
``compression/ratio``, ``compression/density`` (the warm-up: one density per epoch) and
``compression/residual_norm`` against the optimizer step into
``benchmarks/results/tensorboard_compression.png`` (the README shows it), with the values in
``tensorboard_compression.json``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import common

SCALARS = {
    "compression/ratio": "compression ratio (dense bytes / bytes sent)",
    "compression/density": "density (warm-up, then 0.001)",
    "compression/residual_norm": "residual norm (rank 0's memory)",
}
FIGURE = "tensorboard_compression.png"


def run_recipe(data_root: Path | None, epochs: int, workdir: Path) -> Path:
    """Train the CIFAR-10 recipe under DGC with the warm-up; the folder of its TensorBoard events."""
    if data_root is None:
        from lightning_dgc_recipes.demo import write_synthetic_cifar

        data = workdir / "data"
        write_synthetic_cifar(data, train_per_class=500, test_per_class=100)
    else:
        data = data_root / "cifar10-subset"
    argv = [
        common.python(), "-m", "lightning_dgc_recipes", "fit",
        "--config", "configs/cifar10_resnet20_cpu.yaml", "--config", "configs/algo/dgc_warmup.yaml",
        "--data.root", str(data), "--data.download", "false", "--trainer.max_epochs", str(epochs),
        "--trainer.log_every_n_steps", "10", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_checkpointing", "false", "--trainer.default_root_dir", str(workdir / "root"),
        "--trainer.logger.init_args.save_dir", str(workdir / "logs"),
        "--trainer.logger.init_args.version", "dgc",
    ]  # fmt: skip
    log = workdir / "recipe.log"
    code, wall = common.run_command(argv, common.worker_env(), log, timeout_s=3600)
    if code != 0:
        raise SystemExit(f"the recipe run failed ({code}):\n{common.tail(log, 40)}")
    common.console().print(f"recipe run: {wall:.0f} s")
    return workdir / "logs" / "cifar10_resnet20_cpu" / "dgc"


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """``(step, value)`` of every scalar of :data:`SCALARS` in the event files under ``logdir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted(logdir.rglob("events.out.tfevents.*"))
    if not events:
        raise SystemExit(f"no TensorBoard event file under {logdir}")
    out: dict[str, list[tuple[int, float]]] = {}
    for path in events:
        accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in SCALARS:
            if tag in accumulator.Tags()["scalars"]:
                out.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    missing = [tag for tag in SCALARS if tag not in out]
    if missing:
        raise SystemExit(f"{logdir} has no {missing}: was CompressionMonitor among the callbacks?")
    return {tag: sorted(points) for tag, points in out.items()}


def plot(scalars: dict[str, list[tuple[int, float]]]) -> Path | None:
    plt = common.pyplot()
    if plt is None:
        common.console().print(
            "[yellow]matplotlib is not installed: no figure (pip install -e '.[plots]')[/yellow]"
        )
        return None
    fig, axes = plt.subplots(1, len(SCALARS), figsize=(11, 2.8))
    for ax, (tag, label) in zip(axes, SCALARS.items(), strict=True):
        steps, values = zip(*scalars[tag], strict=True)
        ax.plot(steps, values, linewidth=1.2, marker="." if len(steps) < 60 else None)
        ax.set_title(tag, fontsize=9)
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.set_ylabel(label, fontsize=8)
        if tag == "compression/density":
            ax.set_yscale("log")
        ax.tick_params(labelsize=7)
    return common.save_figure(fig, FIGURE)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.tensorboard_figure", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--logdir", type=Path, default=None, help="an existing run's TensorBoard folder")
    parser.add_argument("--data-root", type=Path, default=common.REPO.parent / "shared" / "data",
                        help="holds cifar10-subset/ (absent: the demo's generated data)")  # fmt: skip
    parser.add_argument("--epochs", type=int, default=6, help="epochs of the run (the warm-up takes 4)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dgc_tensorboard_") as tmp:
        if args.logdir is not None:
            logdir = args.logdir
            source = str(args.logdir)
        else:
            root = args.data_root if (args.data_root / "cifar10-subset").is_dir() else None
            logdir = run_recipe(root, args.epochs, Path(tmp))
            source = f"CIFAR-10 recipe under dgc_warmup.yaml, {args.epochs} epochs, data: " + (
                "cifar10-subset" if root else "generated CIFAR-10-format data"
            )
        scalars = read_scalars(logdir)
    result = {
        "command": "python -m benchmarks.tensorboard_figure "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "source": source,
        "scalars": {tag: [{"step": s, "value": v} for s, v in points] for tag, points in scalars.items()},
    }
    common.write_json("tensorboard_compression.json", result)
    plot(scalars)
    return result


def tables(result: dict[str, Any]) -> list[tuple[str, list[str], list[list[Any]]]]:
    """For the benchmarks README: first and last value of each scalar."""
    rows = []
    for tag, points in result["scalars"].items():
        if points:
            rows.append([tag, len(points), points[0]["value"], points[-1]["value"]])
    return [(f"Scalars of {result['source']}", ["scalar", "points", "first", "last"], rows)]


if __name__ == "__main__":
    main()
