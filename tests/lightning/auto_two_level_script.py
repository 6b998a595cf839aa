"""One node of 2 nodes x 2 processes fitting an MLP with ``DGCStrategy(density="auto")`` under the two-level exchange
(``hierarchical="auto"``), launched by one ``torchrun`` agent per node:

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank N --master-addr HOST --master-port PORT \\
        tests/lightning/auto_two_level_script.py --out DIR [--strategies ddp auto] [--width 64] [--steps 10]

For each of ``--strategies`` (``ddp``; ``auto``: ``DGCStrategy(density="auto", auto_every=0)``), in the same
processes, ``Trainer(num_nodes=2, devices=2)`` fits ``--steps`` steps from the same seed. Every rank writes its
parameters after each fit, and what ``density="auto"`` chose: the decision after the measuring phase (density,
reason, link) and the statistics at the end.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dgc


class MLP(L.LightningModule):
    def __init__(self, width: int, features: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                                 nn.Linear(width, features))  # fmt: skip

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Decision(L.Callback):
    """The choice ``density="auto"`` made once its measuring phase ended (before the check of a compressed one)."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] | None = None

    def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
        auto = trainer.strategy.auto_density
        if self.seen is None and auto is not None and auto.choice is not None:
            state = trainer.strategy.exchange_state
            self.seen = {"density": auto.choice.density, "reason": auto.choice.reason, "step": auto.steps,
                         "link_mbit_s": auto.link.throughput_bps / 1e6 if auto.link.measurable else None,
                         "window_ms": auto.link.window_s * 1e3,
                         # what the choice was made from, so that a test can make it again from the figures
                         "link": [auto.link.throughput_bps, auto.link.latency_s, auto.link.window_s],
                         "world_size": state.world_size, "min_density": auto.min_density,
                         "check_s": auto.priced_check_s,
                         "buckets": [[[[s.name, list(s.shape), s.offset, s.numel] for s in layout], dense_bytes]
                                     for layout, dense_bytes in auto.priced]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategies", nargs="+", default=["ddp", "auto"])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64 * args.batch_size, args.features, generator=g)
    data = TensorDataset(x, torch.tanh(x.roll(1, dims=1)))
    report: dict[str, Any] = {}
    for name in args.strategies:
        L.seed_everything(0, verbose=False)
        strategy = lightning_dgc.DGCStrategy(density="auto", auto_every=0) if name == "auto" else name
        decision = Decision()
        trainer = L.Trainer(
            accelerator="cpu", devices=2, num_nodes=2, strategy=strategy, max_steps=args.steps, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[decision] if name == "auto" else [],
        )  # fmt: skip
        trainer.fit(MLP(args.width, args.features), DataLoader(data, batch_size=args.batch_size))
        rank = trainer.global_rank
        params = torch.cat([p.detach().flatten() for p in trainer.lightning_module.parameters()])
        torch.save(params, args.out / f"{name}.rank{rank}.params.pt")
        if name == "auto":
            stats = trainer.strategy.compression_stats()
            report[name] = {
                "decision": decision.seen, "hierarchical": trainer.strategy.exchange_state.topology is not None,
                "steps": trainer.global_step,
                **{k: stats.get(k) for k in ("auto_density", "auto_measuring", "density", "inter_node_bytes",
                                             "link_bytes", "checked_step_ms", "dense_step_ms")},
            }  # fmt: skip
    (args.out / f"rank{rank}.json").write_text(json.dumps(report))
    lightning_dgc.destroy_process_group()


if __name__ == "__main__":
    main()
