"""``Trainer(strategy="dgc")`` on 2 CPU processes with ``SparsityWarmup`` and ``CompressionMonitor``
logging to a real ``TensorBoardLogger``. Run as a script, once per rank (``tests/lightning/run.py``)
or by Lightning's popen launcher, which re-executes it for rank 1; each rank writes
``<out>.rank<r>.json`` with the density it had in force at every optimizer step, for the test to compare
across ranks and with the TensorBoard event file.

    python tests/lightning/callbacks_script.py --out result --epochs 5 --log-every 2

With ``--regimes`` the model decays its learning rate 10x after every 8 optimizer steps and the run uses
``CriticalRegimes`` (window 0.1, factor 10) beside the warm-up.
"""

from __future__ import annotations

import argparse
import json
import os

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

from lightning_dgc.schedules.regimes import CriticalRegimes
from lightning_dgc.schedules.warmup import CompressionMonitor, SparsityWarmup
from tests.lightning.fit_script import Regression, dataset


class DecayingRegression(Regression):
    """The regression model with its learning rate / 10 after every 8 optimizer steps (2 epochs here)."""

    def configure_optimizers(self):
        optimizer = super().configure_optimizers()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 8, 0.1)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


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
    p.add_argument("--regimes", action="store_true")
    args = p.parse_args()

    L.seed_everything(0)
    recorder = DensityRecorder()
    callbacks = [SparsityWarmup(), CompressionMonitor(), recorder]
    if args.regimes:
        callbacks.insert(0, CriticalRegimes(window=0.1, factor=10))
    logger = TensorBoardLogger(save_dir=f"{args.out}.tb", name="run", version=0)
    trainer = L.Trainer(
        strategy="dgc", accelerator="cpu", devices=2, max_epochs=args.epochs, logger=logger,
        log_every_n_steps=args.log_every, callbacks=callbacks,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(
        (DecayingRegression if args.regimes else Regression)(),
        DataLoader(dataset(args.samples), batch_size=8, shuffle=True),
    )
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
