"""What a checkpoint without the exchange memory costs: a run resumed at mid-training with its memory, and
the same checkpoint resumed without it (as ``save_exchange_state=False`` saves it: the model, the optimizer
and the exchange's mean momentum as SGD's buffers; the residuals start from zero), against the run that
never stopped.

The CIFAR-10 subset recipe (ResNet-20) under ``algo/dgc_warmup``, 2 processes, as ``benchmarks.parity``
runs it, with a checkpoint at every epoch. The metric is the parity protocol's (the mean of the last two
evaluations). One seed: the difference is one run's, not a mean.

    python -m benchmarks.resume_without_memory --data-root ../shared/data [--epochs 10 --resume-after 5]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from benchmarks import common, parity

CHECKPOINT_KEY = "lightning_dgc"


def _run(argv: list[str], record: Path, workdir: Path, timeout_s: float) -> dict[str, Any]:
    log = workdir / f"{record.stem}.log"
    record.unlink(missing_ok=True)
    code, wall = common.run_command(argv, parity.run_env(parity.TASKS["cifar10"], 1), log, timeout_s)
    if code != 0 or not record.exists():
        raise SystemExit(f"run failed ({code}): {' '.join(argv)}\n{common.tail(log, 30)}")
    rec = json.loads(record.read_text())
    task = parity.TASKS["cifar10"]
    last2 = parity.protocol_values(task, {"history": rec.get("history")})["metric_last2"]
    return {"metric": last2, "final": (rec.get("final") or {}).get(task.metric), "wall_s": wall,
            "global_step": rec.get("global_step"), "history": rec.get("history"),
            "command": parity.display_command(argv, workdir)}  # fmt: skip


def without_memory(checkpoint: Path, out: Path) -> Path:
    """A copy of ``checkpoint`` as ``save_exchange_state=False`` writes it: the manifest names no rank files."""
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    saved[CHECKPOINT_KEY] = dict(saved[CHECKPOINT_KEY], files=None)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(saved, out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-root", type=Path, required=True, help="holds cifar10-subset/")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--resume-after", type=int, default=5, help="resume from the checkpoint of this epoch's end")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--timeout", type=float, default=3600.0)
    args = p.parse_args(argv)
    task = parity.TASKS["cifar10"]
    workdir = Path(common.REPO / ".resume_without_memory")
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir()
    runs: dict[str, Any] = {}

    # the straight run, a checkpoint at every epoch's end
    argv_a, record_a = parity.command(task, "dgc", args.data_root, args.epochs, None, workdir / "straight",
                                      "resume_without_memory", 2, args.seed)  # fmt: skip
    checkpoints = workdir / "checkpoints"
    argv_a = [("true" if a == "false" and argv_a[i - 1] == "--trainer.enable_checkpointing" else a)
              for i, a in enumerate(argv_a)]  # fmt: skip
    argv_a += ["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.dirpath", str(checkpoints),
               "--trainer.callbacks.save_top_k", "-1", "--trainer.callbacks.every_n_epochs", "1"]  # fmt: skip
    runs["straight"] = _run(argv_a, record_a, workdir, args.timeout)
    middle = next(checkpoints.glob(f"epoch={args.resume_after - 1}-*.ckpt"))

    for name, checkpoint in (("with_memory", middle),
                             ("without_memory", without_memory(middle, workdir / "stripped" / middle.name))):
        argv_r, record_r = parity.command(task, "dgc", args.data_root, args.epochs, None, workdir / name,
                                          f"resume_without_memory_{name}", 2, args.seed)  # fmt: skip
        runs[name] = _run([*argv_r, "--ckpt_path", str(checkpoint)], record_r, workdir, args.timeout)

    straight = runs["straight"]["metric"]
    result = {
        "task": "cifar10 subset, ResNet-20, algo/dgc_warmup, 2 processes",
        "epochs": args.epochs,
        "resumed_after_epoch": args.resume_after,
        "seed": args.seed,
        "metric": "top-1, mean of the last two evaluations",
        "runs": runs,
        "difference_pp": {n: 100 * (runs[n]["metric"] - straight) for n in ("with_memory", "without_memory")},
    }
    common.print_table(
        "Resuming at mid-training with and without the exchange memory",
        ["run", "top-1", "vs straight (pp)"],
        [["straight", f"{100 * straight:.2f}%", "-"]]
        + [[n, f"{100 * runs[n]['metric']:.2f}%", f"{result['difference_pp'][n]:+.2f}"]
           for n in ("with_memory", "without_memory")],  # fmt: skip
    )
    common.write_json("resume_without_memory.json", result)
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
