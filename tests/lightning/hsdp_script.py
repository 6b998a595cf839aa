"""One rank of 2 nodes x 2 processes (ranks numbered node by node) fitting a small sharded model with a real ``Trainer``:

    RANK=r WORLD_SIZE=4 LOCAL_RANK=r%2 NODE_RANK=r//2 ... python tests/lightning/hsdp_script.py --out DIR \\
        --runs native dgc_hsdp [--steps 6] [--optimizer sgd|adamw] [--accumulate 2] [--precision 32-true|bf16-mixed]

Each of ``--runs`` fits ``--steps`` optimizer steps from the same seed in the same processes:

* ``native``: native HSDP, Lightning's ``ModelParallelStrategy`` with ``fully_shard`` on a 2-D ``(replicate, shard)``
  mesh (FSDP's own dense all-reduce across the nodes);
* ``<algorithm>_hsdp`` (``dgc_hsdp``, ``deft_hsdp``, ``powersgd_hsdp``): the sharded strategy by its registered name,
  the algorithm's options from ``--options`` (JSON); ``dense_hsdp``: DGC at density 1, exact, no masking (compression
  off); ``auto_hsdp``: DGC with ``density="auto"``.

The module shards itself as a ``LightningModule`` written for ``ModelParallelStrategy`` does: its blocks, then itself,
over ``self.device_mesh["data_parallel"]`` (native: over its 2-D mesh), with ``--mp`` a ``MixedPrecisionPolicy`` of bf16
parameters and an fp32 (``--mp bf16``) or bf16 (``--mp bf16-reduce``) reduce. ``--checkpoint-every N`` saves every N
steps; ``--resume PATH`` resumes a run. Every rank writes, per run, its losses, the full parameters (gathered from the
shards) and the exchange's statistics into ``DIR/<run>.rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dgc


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width + 1)  # an odd row count: FSDP pads it on 2 processes
        self.down = nn.Linear(2 * width + 1, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Blocks(L.LightningModule):
    def __init__(self, optimizer: str = "sgd", mp: str = "none", native: bool = False, checkpointing: bool = False,
                 width: int = 24, depth: int = 3) -> None:  # fmt: skip
        super().__init__()
        self.optimizer_name, self.mp, self.native, self.checkpointing = optimizer, mp, native, checkpointing
        self.embed = nn.Linear(12, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 5)
        self.losses: list[float] = []

    def configure_model(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if self.native:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = self.device_mesh["data_parallel"]
        kwargs: dict[str, Any] = {}
        if self.mp != "none":
            reduce = torch.bfloat16 if self.mp == "bf16-reduce" else torch.float32
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
        if self.checkpointing:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            self.blocks = nn.ModuleList([checkpoint_wrapper(b) for b in self.blocks])
        for block in self.blocks:
            fully_shard(block, mesh=mesh, **kwargs)
        fully_shard(self, mesh=mesh, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)


def dataset(samples: int = 512) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 12, generator=g)
    y = (x[:, :5] * torch.arange(1, 6)).argmax(1)
    return TensorDataset(x, y)


def make_strategy(run: str, options: dict[str, Any], resume_exchange_state: bool = True) -> Any:
    if run == "native":
        return ModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=1)
    if run == "dense_hsdp":
        return lightning_dgc.HSDPCompressionStrategy(
            "dgc", density=1.0, selection="exact", momentum_masking=False, check_ranks_every=1
        )
    if run == "auto_hsdp":
        return lightning_dgc.HSDPCompressionStrategy("dgc", density="auto", check_ranks_every=1)
    if options:
        return lightning_dgc.HSDPCompressionStrategy(run.removesuffix("_hsdp"), options, check_ranks_every=1,
                                                     resume_exchange_state=resume_exchange_state)
    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", nargs="+", default=["native", "dense_hsdp"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--options", default="{}")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--mp", default="none", choices=["none", "bf16", "bf16-reduce"])
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing of the blocks")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--samples", type=int, default=512, help="96: an epoch of 3 steps (8 samples x 4 ranks each)")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--unseeded", action="store_true", help="each process initialises the model from its own seed")
    parser.add_argument("--keep-exchange-state", default="true", help="false: resume_exchange_state=False")
    args = parser.parse_args()
    torch.set_num_threads(1)
    options = json.loads(args.options)
    for run in args.runs:
        L.seed_everything(0, verbose=False)
        callbacks: list[L.Callback] = []
        if args.checkpoint_every:
            callbacks.append(L.pytorch.callbacks.ModelCheckpoint(
                dirpath=args.out / f"{run}.ckpt", every_n_train_steps=args.checkpoint_every, save_top_k=-1,
                filename="{step}",
            ))  # fmt: skip
        trainer = L.Trainer(
            accelerator="cpu", devices=4 // args.nodes, num_nodes=args.nodes, strategy=make_strategy(run, options, args.keep_exchange_state == "true"),
            max_steps=args.steps,
            accumulate_grad_batches=args.accumulate, precision=args.precision, logger=False,
            enable_checkpointing=bool(args.checkpoint_every), enable_progress_bar=False, enable_model_summary=False,
            callbacks=callbacks, use_distributed_sampler=True,
        )  # fmt: skip
        if args.unseeded:
            torch.manual_seed(int(os.environ["RANK"]))
        model = Blocks(args.optimizer, args.mp, native=run == "native", checkpointing=args.checkpointing)
        trainer.fit(model, DataLoader(dataset(args.samples), batch_size=8, shuffle=False), ckpt_path=args.resume)
        full = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
        stats = trainer.strategy.compression_stats() if hasattr(trainer.strategy, "compression_stats") else {}
        state = getattr(trainer.strategy, "_state", None)
        memory = {f"{kind}/{name}": (str(t.dtype), t.numel()) for kind, by_name in state.memory.committed.items()
                  for name, t in by_name.items()} if state is not None else {}  # fmt: skip
        shards = {name: p.to_local().detach().clone() for name, p in model.named_parameters()}
        torch.save({"losses": model.losses, "params": full, "shards": shards, "stats": stats, "memory": memory,
                    "hook_calls": getattr(trainer.strategy, "hook_calls", 0), "global_step": trainer.global_step},
                   args.out / f"{run}.rank{trainer.global_rank}.pt")  # fmt: skip
    lightning_dgc.destroy_process_group()


if __name__ == "__main__":
    main()
