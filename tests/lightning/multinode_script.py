"""One node of a multi-node run, launched by ``torchrun`` (one agent per node, c10d rendezvous) or
by ``srun`` (the SLURM variables set for each task):

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID \\
        tests/lightning/multinode_script.py --out DIR [--strategies dgc deft]

For ``dgc`` and then ``deft`` (``--strategies``), in the same processes: ``Trainer(num_nodes=2)`` fits 4 steps and saves
a checkpoint, then a new Trainer resumes from it to step 8. Every rank writes what it saw (world size,
node rank, the strategy's ranks, global steps) and its parameters after each fit.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

import lightning_dgc
from tests.lightning.fit_script import Regression, dataset


def fit(strategy: str, steps: int, out: Path, ckpt: Path | None) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, num_nodes=2, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    loader = DataLoader(dataset(), batch_size=16, shuffle=False)
    trainer.fit(Regression(), loader, ckpt_path=ckpt)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategies", nargs="+", default=["dgc", "deft"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    report: dict = {}
    for name in args.strategies:
        ckpt = args.out / f"{name}.ckpt"
        first = fit(name, 4, args.out, None)
        first.save_checkpoint(ckpt)  # (a collective: every rank's exchange state is gathered to rank 0)
        resumed = fit(name, 8, args.out, ckpt)
        strategy = resumed.strategy
        assert isinstance(strategy, lightning_dgc.CompressionStrategy)
        rank = resumed.global_rank
        report[name] = {
            "world_size": resumed.world_size, "node_rank": resumed.node_rank, "global_rank": rank,
            "num_nodes": resumed.num_nodes, "strategy_world_size": strategy.world_size,
            "cluster_environment": type(strategy.cluster_environment).__name__,
            "first_steps": first.global_step, "resumed_steps": resumed.global_step,
            "exchange_step": strategy.compression_stats().get("step"),
        }  # fmt: skip
        params = torch.cat([p.detach().flatten() for p in resumed.lightning_module.parameters()])
        torch.save(params, args.out / f"{name}.rank{rank}.params.pt")
    (args.out / f"rank{rank}.json").write_text(json.dumps(report))
    lightning_dgc.destroy_process_group()


if __name__ == "__main__":
    main()
