"""``Trainer(strategy="randomk")`` with an algorithm from the user's own module, imported after Lightning.

python tests/lightning/randomk_script.py --out result --max-steps 6
"""

from __future__ import annotations

import argparse
import json

import lightning.pytorch as pl  # first: the user's module registers its strategy name afterwards
import torch
from torch.utils.data import DataLoader

import tests.extending.randomk  # noqa: F401  (registers "randomk")
from tests.lightning.fit_script import HookProbe, Regression, dataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=6)
    args = p.parse_args()
    pl.seed_everything(0)
    probe = HookProbe()
    trainer = pl.Trainer(
        strategy="randomk", accelerator="cpu", devices=2, max_steps=args.max_steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[probe],
    )  # fmt: skip
    model = Regression(momentum=0.0)
    trainer.fit(model, DataLoader(dataset(256), batch_size=16))
    rank = trainer.global_rank
    torch.save(
        torch.cat([p.detach().reshape(-1) for p in model.parameters()]), f"{args.out}.rank{rank}.params.pt"
    )
    summary = {
        "strategy": type(trainer.strategy).__name__, "hook_calls": trainer.strategy.hook_calls,
        "stats": probe.stats, "residual_norm": trainer.strategy.residual_norm(),
    }  # fmt: skip
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump(summary, f)


if __name__ == "__main__":
    main()
