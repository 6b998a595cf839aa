"""``ExchangeProfiler`` in a real ``Trainer.fit`` with 2 CPU processes (run as a script, once per
rank or by Lightning's popen launcher). Writes ``<out>.rank<r>.json``.

    python tests/lightning/profile_script.py --strategy dgc --out result
"""

from __future__ import annotations

import argparse
import json

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dgc
from lightning_dgc.front.profiler import ExchangeProfiler


class MLP(L.LightningModule):
    """Large enough that its weights are compressed and, with small buckets, spread over several buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 96), nn.Tanh(), nn.Linear(96, 96), nn.Tanh(), nn.Linear(96, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class LastStats(L.Callback):
    """Every step's ``compression_stats()``, to compare with the profile."""

    def __init__(self) -> None:
        self.stats: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.stats.append(dict(trainer.strategy.compression_stats()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="dgc", choices=["dgc", "deft"])
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    L.seed_everything(0)
    cls = lightning_dgc.DGCStrategy if args.strategy == "dgc" else lightning_dgc.DEFTStrategy
    strategy = cls(density=0.01, bucket_cap_mb=0.02)  # several buckets even for this small model
    profiler = ExchangeProfiler(warmup_steps=2, model_name="mlp", path=f"{args.out}.profile.json")
    last = LastStats()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=args.max_steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[profiler, last],
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=g)
    data = TensorDataset(x, torch.tanh(x @ torch.randn(32, 4, generator=g)))
    trainer.fit(MLP(), DataLoader(data, batch_size=16, shuffle=True))
    profile = profiler.profile
    assert profile is not None
    summary = {
        "rank": trainer.global_rank,
        "profile": profile.to_dict(),
        "totals": profile.totals(args.strategy),
        "stats": last.stats[-1],
        "hook_calls": strategy.hook_calls,
    }
    with open(f"{args.out}.rank{trainer.global_rank}.json", "w") as f:
        json.dump(summary, f)


if __name__ == "__main__":
    main()
