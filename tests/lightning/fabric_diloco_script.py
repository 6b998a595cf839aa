"""``Fabric(strategy=FabricDiLoCoStrategy(...))`` on 2 CPU processes, run once per rank (``tests/lightning/run.py``):
the loop ``diloco_script.py`` runs under the Trainer (the same model, data, seed and optimizer), written out by
hand. Writes each rank's initial and final parameters and a JSON summary, as ``diloco_script.py`` does.

    python tests/lightning/fabric_diloco_script.py --out DIR/run --sync-every 4 --max-steps 10 [options]
    torchrun --nnodes 2 --nproc-per-node 2 ... tests/lightning/fabric_diloco_script.py --num-nodes 2 --devices 2 ...
"""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from lightning_dgc import FabricDiLoCoStrategy
from tests.lightning.diloco_script import BATCH, INNER_LR, INNER_MOMENTUM, dataset, flat, model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--samples", type=int, default=32, help="the data set (BATCH per batch and rank)")
    p.add_argument("--algorithm", default="dense")
    p.add_argument("--options", default=None, help="JSON: the algorithm's settings")
    p.add_argument("--offload", action="store_true")
    p.add_argument("--fragments", type=int, default=1)
    p.add_argument("--overlap-steps", type=int, default=0)
    p.add_argument("--save-at", type=int, default=0, help="fabric.save after this many steps, to OUT.ckpt")
    p.add_argument("--resume", default=None)
    args = p.parse_args()

    L.seed_everything(0)
    options = json.loads(args.options or "null")
    strategy = FabricDiLoCoStrategy(
        sync_every=args.sync_every, algorithm=args.algorithm, options=options, offload=args.offload,
        fragments=args.fragments, overlap_steps=args.overlap_steps,
    )
    fabric = L.Fabric(accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy=strategy)
    fabric.launch()
    net = model()
    rank = fabric.global_rank
    torch.save(flat(net), f"{args.out}.rank{rank}.init.pt")
    optimizer = torch.optim.SGD(net.parameters(), lr=INNER_LR, momentum=INNER_MOMENTUM)
    module, optimizer = fabric.setup(net, optimizer)
    # each rank's shard in a fixed order, as diloco_script.py gives the Trainer
    shard = DistributedSampler(dataset(args.samples), num_replicas=fabric.world_size, rank=rank, shuffle=False)
    batches = list(DataLoader(dataset(args.samples), batch_size=BATCH, sampler=shard))
    start = 0
    if args.resume:
        start = fabric.load(args.resume, {"model": module, "optimizer": optimizer})["step"]
    for step in range(start, args.max_steps):
        x, y = batches[step % len(batches)]  # the epochs of the Trainer's loop
        optimizer.zero_grad()
        # flat: nothing to skip, a no-op; across nodes it would skip DDP's all-reduce inside the node, as under DDP
        with fabric.no_backward_sync(module) if args.num_nodes == 1 else nullcontext():
            fabric.backward(nn.functional.mse_loss(module(x), y))
        optimizer.step()
        if step + 1 == args.save_at:
            fabric.save(f"{args.out}.ckpt", {"model": module, "optimizer": optimizer, "step": step + 1})
    inner = fabric.strategy
    assert isinstance(inner, FabricDiLoCoStrategy)
    inner.finish()  # the last round, cut short
    torch.save(flat(net), f"{args.out}.rank{rank}.params.pt")
    stats = inner.compression_stats()
    summary = {
        "rank": rank, "outer_steps": inner.outer.outer_steps,
        "stats": {k: v for k, v in stats.items() if isinstance(v, int | float | str | bool)},
        "wrapped": type(module._forward_module).__name__, "leader": inner.outer.leader,
    }  # fmt: skip
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump(summary, f)


if __name__ == "__main__":
    main()
