"""One rank of nodes x processes (ranks numbered node by node) fitting the sharded model of ``hsdp_script.py`` with
DiLoCo across the nodes, and a real ``Trainer``:

    RANK=r WORLD_SIZE=4 LOCAL_RANK=r%2 NODE_RANK=r//2 ... python tests/lightning/diloco_hsdp_script.py --out DIR \\
        --runs native diloco_hsdp diloco_hsdp@dgc [--sync-every 1 --outer-lr 1 --outer-momentum 0] [--options JSON]

Each of ``--runs`` fits ``--steps`` optimizer steps from the same seed in the same processes:

* ``native``: native HSDP (``ModelParallelStrategy``, ``fully_shard`` on a 2-D ``(replicate, shard)`` mesh);
* ``diloco_hsdp``: :class:`~lightning_dgc.HSDPDiLoCoStrategy` with the outer settings, a dense outer exchange;
  ``diloco_hsdp@dgc``: through an algorithm, its settings from ``--options`` (``{"dgc": {...}}``);
* ``diloco``, ``diloco@dgc``: the replicated :class:`~lightning_dgc.DiLoCoStrategy` (DDP inside the node) on the same
  model, unsharded.

After every outer step each rank gathers its shards from the other nodes and notes whether they are identical.
Every rank writes, per run, its losses, full parameters, local shards, statistics, outer state bytes, outer momentum
and those notes into ``DIR/<run>.rank<r>.pt`` (``@`` written ``_``). ``--bad`` instead fits each bad input in turn and writes the error each
raised into ``DIR/bad.rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader

import lightning_dgc
from lightning_dgc import comm
from lightning_dgc.local_steps.sharded import outer_state_bytes
from tests.lightning.hsdp_script import Blocks, dataset


class Replicated(Blocks):
    """The same model, not sharded: for the replicated DiLoCo."""

    def configure_model(self) -> None:
        pass


class Offloaded(Blocks):
    """Sharded over the node with FSDP2's CPU offload."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        fully_shard(self, mesh=self.device_mesh["data_parallel"], offload_policy=CPUOffloadPolicy(pin_memory=False))


class Unsharded(L.LightningModule):
    """No ``configure_model``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(12, 5)

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self.layer(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ReplicaCheck(L.Callback):
    """After every optimizer step that ended an outer step: whether this rank's shards equal those of the same local
    rank on every node (all-gathered over the mesh's ``replicate`` dimension)."""

    def __init__(self) -> None:
        self.identical: list[bool] = []
        self.outer_steps = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.outer_steps = trainer.strategy.outer.outer_steps  # (a resumed run's)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.strategy.outer.outer_steps == self.outer_steps:  # a micro-batch, or inside a round
            return
        self.outer_steps = trainer.strategy.outer.outer_steps
        group = trainer.strategy.device_mesh["replicate"].get_group()
        same = True
        for _, p in pl_module.named_parameters():
            local = p.to_local().detach()
            gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, local.contiguous(), group=group)
            same = same and all(torch.equal(gathered[0], g) for g in gathered)
        self.identical.append(same)


def make_strategy(run: str, args: argparse.Namespace) -> Any:
    if run == "native":
        return ModelParallelStrategy(data_parallel_size=args.nodes * args.per_node, tensor_parallel_size=1)
    outer = {"sync_every": args.sync_every, "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum,
             "outer_nesterov": args.outer_momentum > 0, "fragments": args.fragments,
             "overlap_steps": args.overlap_steps}  # fmt: skip
    door, _, algorithm = run.partition("@")
    options = json.loads(args.options).get(algorithm) if algorithm else None
    strategy = lightning_dgc.DiLoCoStrategy if door == "diloco" else lightning_dgc.HSDPDiLoCoStrategy
    return strategy(algorithm=algorithm or "dense", options=options, **outer)


def model_for(run: str, optimizer: str) -> Blocks:
    if run.partition("@")[0] == "diloco":
        return Replicated(optimizer)
    return Blocks(optimizer, native=run == "native")


def fit(args: argparse.Namespace, run: str) -> None:
    L.seed_everything(0, verbose=False)
    name = run.replace("@", "_")
    check = ReplicaCheck()
    sharded = run.startswith("diloco_hsdp")
    callbacks: list[L.Callback] = [check] if sharded else []
    if args.checkpoint_every:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(
            dirpath=args.out / f"{name}.ckpt", every_n_train_steps=args.checkpoint_every, save_top_k=-1,
            filename="{step}",
        ))  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=args.per_node, num_nodes=args.nodes, strategy=make_strategy(run, args),
        max_steps=args.steps, accumulate_grad_batches=args.accumulate, logger=False,
        enable_checkpointing=bool(args.checkpoint_every), enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks, use_distributed_sampler=True,
    )  # fmt: skip
    model = model_for(run, args.optimizer)
    trainer.fit(model, DataLoader(dataset(args.samples), batch_size=8, shuffle=False), ckpt_path=args.resume)
    strategy = trainer.strategy
    params = dict(model.named_parameters())
    record = {
        "losses": model.losses, "global_step": trainer.global_step, "identical": check.identical,
        "full": {n: (p.full_tensor() if sharded or run == "native" else p).detach().clone() for n, p in params.items()},
        "shards": {n: (p.to_local() if sharded or run == "native" else p).detach().clone() for n, p in params.items()},
    }  # fmt: skip
    if run != "native":
        outer = strategy.outer
        record.update(stats=strategy.compression_stats(), state_bytes=outer_state_bytes(outer),
                      outer_steps=outer.outer_steps)  # fmt: skip
        momentum = {n: outer.outer_optimizer.state.get(g, {}).get("momentum_buffer") for n, g in
                    zip(outer.names, outer.global_params, strict=True)}  # fmt: skip
        record["momentum"] = {n: m.detach().clone() for n, m in momentum.items() if m is not None}
    torch.save(record, args.out / f"{name}.rank{trainer.global_rank}.pt")


def bad_inputs(args: argparse.Namespace) -> None:
    """Fit each bad input with ``strategy="diloco_hsdp"``; note the error each raised (every rank raises it, none
    hangs)."""
    rank = int(os.environ["RANK"])
    errors: dict[str, str] = {}

    def attempt(case: str, model: L.LightningModule, **trainer_kwargs: Any) -> None:
        L.seed_everything(0, verbose=False)
        trainer_kwargs = {"devices": args.per_node, "num_nodes": args.nodes, **trainer_kwargs}
        trainer = L.Trainer(
            accelerator="cpu", strategy="diloco_hsdp", max_steps=2, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs,
        )  # fmt: skip
        try:
            trainer.fit(model, DataLoader(dataset(64), batch_size=8))
            errors[case] = "no error"
        except Exception as error:  # noqa: BLE001 (the test reads which error each case raised)
            errors[case] = f"{type(error).__name__}: {error}"

    attempt("not sharded", Unsharded())
    attempt("HSDP mesh", Blocks(native=True))
    attempt("CPU offload", Offloaded())
    host_key = comm.host_key
    comm.host_key = lambda: float(rank)  # every process on a host of its own
    attempt("node across hosts", Blocks())
    comm.host_key = host_key
    # torchelastic's environment takes the global rank as given: node n holds ranks n, n + 2 (not node by node)
    os.environ.update(GROUP_RANK=str(rank % args.nodes), LOCAL_RANK=str(rank // args.nodes),
                      LOCAL_WORLD_SIZE=str(args.per_node))  # fmt: skip
    attempt("ranks not node by node", Blocks(), plugins=[TorchElasticEnvironment()])
    (args.out / f"bad.rank{rank}.json").write_text(json.dumps(errors))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", nargs="+", default=["native", "diloco_hsdp"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--sync-every", type=int, default=2)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--fragments", type=int, default=1)
    parser.add_argument("--overlap-steps", type=int, default=0)
    parser.add_argument("--options", default="{}", help="JSON: each algorithm's settings, by name")
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--samples", type=int, default=512, help="96: an epoch of 3 steps (8 samples x 4 ranks each)")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--per-node", type=int, default=2)
    parser.add_argument("--bad", action="store_true", help="fit each bad input instead of --runs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.bad:
        bad_inputs(args)
    else:
        for run in args.runs:
            fit(args, run)
    lightning_dgc.destroy_process_group()


if __name__ == "__main__":
    main()
