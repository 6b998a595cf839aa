"""``Trainer(strategy="dgc")`` on 2 CPU processes with ``SparsityWarmup`` and ``CompressionMonitor``
logging to a real ``TensorBoardLogger``. Run as a script, once per rank (``tests/lightning/run.py``)
or by Lightning's popen launcher, which re-executes it for rank 1; each rank writes
``<out>.rank<r>.json`` with the density it had in force at every optimizer step, for the test to compare
across ranks and with the TensorBoard event file.

    python tests/lightning/callbacks_script.py --out result --epochs 5 --log-every 2
"""

from __future__ import annotations

import argparse
import json
import os

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

from lightning_dgc.callbacks import CompressionMonitor, SparsityWarmup
from tests.lightning.fit_script import Regression, dataset


class DensityRecorder(L.Callback):
    """Records, on every rank, the density in force when each optimizer step ran."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(
            {
                "global_step": trainer.global_step,
                "epoch": trainer.current_epoch,
                "density": trainer.strategy.density,
                "stats_density": trainer.strategy.compression_stats().get("density"),
            }
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--log-every", type=int, default=2)
    p.add_argument("--samples", type=int, default=64)  # 2 ranks x batch 8 -> 4 steps per epoch
    args = p.parse_args()

    L.seed_everything(0)
    recorder = DensityRecorder()
    logger = TensorBoardLogger(save_dir=f"{args.out}.tb", name="run", version=0)
    trainer = L.Trainer(
        strategy="dgc", accelerator="cpu", devices=2, max_epochs=args.epochs, logger=logger,
        log_every_n_steps=args.log_every, callbacks=[SparsityWarmup(), CompressionMonitor(), recorder],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Regression(), DataLoader(dataset(args.samples), batch_size=8, shuffle=True))
    summary = {
        "rank": trainer.global_rank,
        "pid": os.getpid(),  # TensorBoard event file names carry the writer's pid
        "final_density": trainer.strategy.density,
        "log_dir": logger.log_dir,
        "steps": recorder.steps,
    }
    with open(f"{args.out}.rank{trainer.global_rank}.json", "w") as f:
        json.dump(summary, f)


if __name__ == "__main__":
    main()
