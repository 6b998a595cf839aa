"""One rank of 2 nodes x 2 processes running Fabric loops over a sharded model (``FabricHSDPCompressionStrategy``), and
native HSDP beside them (Fabric's ``ModelParallelStrategy``, ``fully_shard`` on a 2-D ``(replicate, shard)`` mesh):

    ... python tests/lightning/fabric_hsdp_script.py --out DIR

Phases, in the same processes: ``native``, ``dense`` (DGC at density 1, exact, no masking), ``dgc`` (density 0.05),
``dgc_saved`` (the same, saved at step 3) and ``dgc_loaded`` (loaded at step 3 and run to the end), all with SGD
(momentum and weight decay), 2 micro-batches a step under ``no_backward_sync``. Every rank writes
``DIR/fabric.rank<r>.pt``: per phase, the full parameters (gathered from the shards) and the losses.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn

import lightning_dgc
from tests.lightning.hsdp_script import Block

STEPS, SAVE_AT, MICRO = 6, 3, 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(12, 24)
        self.blocks = nn.ModuleList([Block(24) for _ in range(2)])
        self.head = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def shard_over_node(module: Net, mesh: Any) -> Net:
    """What a ``parallelize_fn`` written for Fabric's ``ModelParallelStrategy`` does: FSDP2 over the data-parallel
    dimension (here: the node's processes)."""
    from torch.distributed.fsdp import fully_shard

    for block in module.blocks:
        fully_shard(block, mesh=mesh["data_parallel"])
    return fully_shard(module, mesh=mesh["data_parallel"])


def shard_native_hsdp(module: Net, mesh: Any) -> Net:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for block in module.blocks:
        fully_shard(block, mesh=hsdp)
    return fully_shard(module, mesh=hsdp)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 12, generator=g)
    return x, (x[:, :5] * torch.arange(1, 6)).argmax(1)


def _loop(strategy: Any, start: int = 0, stop: int = STEPS, save: Path | None = None,
          load: Path | None = None) -> dict[str, Any]:  # fmt: skip
    fabric = L.Fabric(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(Net())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4))
    if load is not None:
        start = fabric.load(load, {"model": model, "optimizer": optimizer})["step"]
    losses = []
    for step in range(start, stop):
        optimizer.zero_grad()
        for micro in range(MICRO):
            x, y = _batch(step * MICRO + micro, fabric.global_rank)
            with fabric.no_backward_sync(model, enabled=micro < MICRO - 1):
                loss = nn.functional.cross_entropy(model(x), y) / MICRO
                fabric.backward(loss)
            losses.append(float(loss))
        optimizer.step()
        if save is not None and step + 1 == SAVE_AT:
            fabric.save(save, {"model": model, "optimizer": optimizer, "step": step + 1})
    if hasattr(fabric.strategy, "release_optimizers"):
        fabric.strategy.release_optimizers()
    return {
        "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
        "losses": losses, "rank": fabric.global_rank,
        "momentum": optimizer.param_groups[0]["momentum"],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ours = lightning_dgc.FabricHSDPCompressionStrategy

    def compressed() -> Any:
        return ours("dgc", density=0.05, min_compress_numel=64, parallelize_fn=shard_over_node, check_ranks_every=1)

    phases = {
        "native": _loop(ModelParallelStrategy(shard_native_hsdp, data_parallel_size=4, tensor_parallel_size=1)),
        "dense": _loop(ours("dgc", density=1.0, selection="exact", momentum_masking=False,
                            parallelize_fn=shard_over_node, check_ranks_every=1)),  # fmt: skip
        "dgc": _loop(compressed()),
    }
    checkpoint = args.out / "dgc.ckpt"
    phases["dgc_saved"] = _loop(compressed(), stop=SAVE_AT, save=checkpoint)
    phases["dgc_loaded"] = _loop(compressed(), load=checkpoint)
    torch.save(phases, args.out / f"fabric.rank{phases['dgc']['rank']}.pt")
    lightning_dgc.destroy_process_group()


if __name__ == "__main__":
    main()
