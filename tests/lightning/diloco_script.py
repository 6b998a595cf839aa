"""``Trainer(strategy=DiLoCoStrategy(...))`` on 2 CPU processes, run once per rank (``tests/lightning/run.py``).
Writes each rank's initial and final parameters and a JSON summary.

    python tests/lightning/diloco_script.py --out DIR/run --sync-every 4 --max-steps 10 [options]
    torchrun --nnodes 2 --nproc-per-node 2 ... tests/lightning/diloco_script.py --num-nodes 2 --devices 2 ...
"""

from __future__ import annotations

import argparse
import json

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_dgc import DiLoCoStrategy

INNER_LR, INNER_MOMENTUM, BATCH = 0.1, 0.9, 8


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def dataset(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, torch.sin(x[:, :2] * 2))


class Module(L.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.net = model()
        self.automatic_optimization = not manual

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=INNER_LR, momentum=INNER_MOMENTUM)

    def on_train_start(self) -> None:
        self.wrapped_as = type(self.trainer.strategy.model).__name__  # (teardown unwraps it)


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--hierarchical", default="auto", choices=["auto", "true", "false"])
    p.add_argument("--samples", type=int, default=32, help="the data set (BATCH per batch and rank)")
    p.add_argument("--algorithm", default="dense")
    p.add_argument("--options", default=None, help="JSON: the algorithm's settings")
    p.add_argument("--offload", action="store_true")
    p.add_argument("--fragments", type=int, default=1)
    p.add_argument("--overlap-steps", type=int, default=0)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--resume", default=None)
    p.add_argument("--manual", action="store_true")
    p.add_argument("--ddp", action="store_true", help="Lightning's plain DDPStrategy instead")
    args = p.parse_args()

    L.seed_everything(0)
    strategy = DiLoCoStrategy(
        sync_every=args.sync_every, algorithm=args.algorithm, options=json.loads(args.options or "null"),
        offload=args.offload, hierarchical={"true": True, "false": False}.get(args.hierarchical, "auto"),
        fragments=args.fragments, overlap_steps=args.overlap_steps,
    )  # fmt: skip
    trainer_strategy = "ddp" if args.ddp else strategy
    callbacks = []
    if args.ckpt_every:
        callbacks.append(ModelCheckpoint(dirpath=f"{args.out}.ckpts", every_n_train_steps=args.ckpt_every, save_top_k=-1))
    trainer = L.Trainer(
        strategy=trainer_strategy, accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes,
        max_steps=args.max_steps, logger=False,
        enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks, use_distributed_sampler=False,
    )  # fmt: skip
    module = Module(args.manual)
    rank = trainer.global_rank
    torch.save(flat(module), f"{args.out}.rank{rank}.init.pt")
    # each rank's shard in a fixed order (Lightning's own sampler shuffles), for the test's hand-written reference
    shard = DistributedSampler(dataset(args.samples), num_replicas=trainer.world_size, rank=rank, shuffle=False)
    data = DataLoader(dataset(args.samples), batch_size=BATCH, sampler=shard)
    trainer.fit(module, data, ckpt_path=args.resume)
    torch.save(flat(module), f"{args.out}.rank{rank}.params.pt")
    stats = strategy.compression_stats()
    summary = {
        "rank": rank, "global_step": trainer.global_step,
        "outer_steps": strategy.outer.outer_steps if strategy._outer is not None else 0,
        "stats": {k: v for k, v in stats.items() if isinstance(v, int | float | str | bool)},
        "ddp_wrapped": getattr(module, "wrapped_as", None),
        "leader": strategy.outer.leader if strategy._outer is not None else None,
    }  # fmt: skip
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump(summary, f)


if __name__ == "__main__":
    main()
