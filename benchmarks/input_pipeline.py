"""Where the CIFAR recipe's input pipeline costs: the long protocol's step under each way of augmenting.

    nice -n 0 .venv/bin/python -m benchmarks.input_pipeline --steps 160 --rounds 2

The long protocol (``benchmarks.parity`` task ``cifar10_full``: all of CIFAR-10, bf16 autocast, 2 processes of 64
images, one compute thread each, plain DDP) trained for ``--steps`` steps without evaluation, once per variant
and round, the variants interleaved in each round (so that a drift of the machine spreads over all of them):

- ``batch``: ``augment="batch"``, the crop and flip on each batch after it reaches its device, no loader
  processes (the long protocol's setting; exact on resume);
- ``workers``: ``augment=True``, per image in 2 loader worker processes per rank (the config's default), which
  compete with the training processes for the cores;
- ``inline``: ``augment=True``, per image in the training process (``num_workers=0``).

Each run's step is :class:`benchmarks.common.RunRecorder`'s median (the sixth step on); the record gives each
variant's median over rounds and its ratio to ``batch``. Timings compare only within one record.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

from benchmarks import common, parity

#: variant -> (augment, loader workers per rank)
VARIANTS = {"batch": ("batch", 0), "workers": ("true", 2), "inline": ("true", 0)}
RECORD = "input_pipeline.json"


def overrides(variant: str) -> tuple[str, ...]:
    """The long protocol's overrides with the variant's augmentation and loader workers, evaluation off."""
    augment, workers = VARIANTS[variant]
    base = list(parity.TASKS["cifar10_full"].overrides)
    for flag, value in (("--data.augment", augment), ("--data.num_workers", str(workers))):
        base[base.index(flag) + 1] = value
    return (*base, "--trainer.limit_val_batches", "0")


def run(variant: str, steps: int, data_root: Path, timeout_s: float) -> float | None:
    """One run of ``steps`` steps; its median step in seconds (``None`` where it failed)."""
    task = replace(parity.TASKS["cifar10_full"], overrides=overrides(variant), resumable=False)
    workdir = Path(tempfile.mkdtemp(prefix="dgc_input_"))
    try:
        argv, record = parity.command(task, "ddp", data_root, 1, steps, workdir, name="input_pipeline", seed=42)
        record.unlink(missing_ok=True)
        code, _ = common.run_command(argv, parity.run_env(task, 1), workdir / "run.log", timeout_s)
        if code != 0 or not record.exists():
            common.console().print(f"[red]{variant} failed[/red]\n{common.tail(workdir / 'run.log', 20)}")
            return None
        return json.loads(record.read_text()).get("median_step_s")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(parity.RUNS_DIR / "input_pipeline", ignore_errors=True)
        shutil.rmtree(parity.CONFIG_DIR / "input_pipeline", ignore_errors=True)


def summary(steps: dict[str, list[float]]) -> dict[str, dict[str, float | None]]:
    """Per variant: the median of its runs' steps and its ratio to ``batch``'s."""
    medians = {v: statistics.median(s) if s else None for v, s in steps.items()}
    base = medians.get("batch")
    return {v: {"step_s": m, "ratio_to_batch": m / base if m and base else None} for v, m in medians.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.input_pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    parser.add_argument("--data-root", type=Path, default=common.REPO.parent / "shared" / "data")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    steps: dict[str, list[float]] = {v: [] for v in args.variants}
    for _ in range(args.rounds):
        for variant in args.variants:
            step = run(variant, args.steps, args.data_root, args.timeout)
            common.console().print(f"{variant}: median step {step} s")
            if step is not None:
                steps[variant].append(step)
    result = summary(steps)
    for variant, row in result.items():
        common.console().print(f"{variant}: {row}")
    common.write_json(RECORD, {"runs": steps, "summary": result, "settings": vars(args) | {"data_root": "<data>"}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
