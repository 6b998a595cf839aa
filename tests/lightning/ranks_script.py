"""Ranks that stop agreeing, as a script for 2 real processes (``tests/lightning/run.py``'s ``run_script``).

    python tests/lightning/ranks_script.py --out result [--strategy NAME] [--density-on RANK:STEP:DENSITY]
        [--check-ranks-every N] [--timeout SECONDS]
"""

from __future__ import annotations

import argparse
import json
from datetime import timedelta

import lightning as L
import torch
from torch.utils.data import DataLoader

import lightning_dgc
import tests.extending.hashseeded  # noqa: F401  (registers "hashseeded_randomk": draws seeded with hash(name))
from tests.lightning.fit_script import Regression, StepLog, dataset


class DensityOnOneRank(L.Callback):
    """Sets ``trainer.strategy.density`` on one rank only, at the start of one step."""

    def __init__(self, rank: int, step: int, density: float) -> None:
        self.rank, self.step, self.density = rank, step, density

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            trainer.strategy.density = self.density


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", default="dgc")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--density-on", default=None, help="RANK:STEP:DENSITY set on that rank only")
    p.add_argument("--check-ranks-every", default="default", help="the strategy's check_ranks_every ('none': off)")
    p.add_argument("--timeout", type=float, default=60.0, help="the process group's timeout, in seconds")
    args = p.parse_args()
    L.seed_everything(0)
    options = {} if args.check_ranks_every == "default" else {
        "check_ranks_every": None if args.check_ranks_every == "none" else int(args.check_ranks_every)
    }  # fmt: skip
    strategy = lightning_dgc.CompressionStrategy(
        args.strategy, {"density": args.density}, timeout=timedelta(seconds=args.timeout), **options
    )
    callbacks: list[L.Callback] = [StepLog()]
    if args.density_on:
        rank, step, density = args.density_on.split(":")
        callbacks.append(DensityOnOneRank(int(rank), int(step), float(density)))
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=args.max_steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    model = Regression(momentum=0.0)
    trainer.fit(model, DataLoader(dataset(256), batch_size=16))
    params = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    torch.save(params, f"{args.out}.rank{trainer.global_rank}.params.pt")
    with open(f"{args.out}.rank{trainer.global_rank}.json", "w") as f:
        json.dump({"global_step": trainer.global_step}, f)


if __name__ == "__main__":
    main()
