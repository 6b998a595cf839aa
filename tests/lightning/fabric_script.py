"""Fabric loops with 2 CPU processes, run as a script so that Fabric's popen launcher can re-execute it for
rank 1. One launch runs every phase (each a new ``Fabric`` in the same process group) and writes, per rank,
``{out}.rank{r}.pt``: each phase's final parameters (flat), and what the test checks besides.

    python tests/lightning/fabric_script.py --out /tmp/fabric
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from lightning_dgc.front.fabric import FabricCompressionStrategy

STEPS, SAVE_AT, BATCH = 10, 5, 16


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``rank`` at ``step``: a function of both, so that a resumed loop replays it exactly."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, 32, generator=g)
    return x, torch.tanh(x[:, :4] * 2) + 0.1 * x[:, 4:8]


def _loop(
    strategy: Any, stop: int = STEPS, save: Path | None = None, load: Path | None = None, accumulate: int = 1
) -> dict[str, Any]:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    model, optimizer = fabric.setup(model, optimizer)
    start = 0
    if load is not None:
        start = fabric.load(load, {"model": model, "optimizer": optimizer})["step"]
    during = None
    for step in range(start, stop):
        optimizer.zero_grad()
        for micro in range(accumulate):  # gradient accumulation: DDP's no_sync until the last micro-batch
            x, y = _batch(step * accumulate + micro, fabric.global_rank, fabric.world_size)
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                fabric.backward(nn.functional.mse_loss(model(x), y) / accumulate)
        optimizer.step()
        group = optimizer.param_groups[0]
        during = (group["momentum"], group["nesterov"], group["weight_decay"])
        if save is not None and step + 1 == SAVE_AT:
            fabric.save(save, {"model": model, "optimizer": optimizer, "step": step + 1})
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    inner = fabric.strategy
    if isinstance(inner, FabricCompressionStrategy):
        inner.release_optimizers()
    group = optimizer.param_groups[0]
    return {
        "params": flat,
        "group_after": (group["momentum"], group["nesterov"], group["weight_decay"]),
        "momentum_buffer": optimizer.state[group["params"][0]].get("momentum_buffer"),
        "hook_calls": getattr(inner, "hook_calls", 0),
        "group_during": during,
        "skipped": getattr(getattr(inner, "_state", None), "skipped_steps", 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    compressed = {"density": 0.05, "min_compress_numel": 512}
    results = {
        "ddp": _loop("ddp"),
        "dgc_density_1": _loop(FabricCompressionStrategy("dgc", {"density": 1.0})),
        "dgc": _loop(FabricCompressionStrategy("dgc", **compressed)),  # the same settings as keywords
    }
    ckpt = Path(f"{out}.dgc.ckpt")
    results["dgc_first_half"] = _loop(FabricCompressionStrategy("dgc", compressed), stop=SAVE_AT, save=ckpt)
    results["dgc_resumed"] = _loop(FabricCompressionStrategy("dgc", compressed), load=ckpt)
    dense_ckpt = Path(f"{out}.dgc_density_1.ckpt")
    results["dgc_density_1_first_half"] = _loop(
        FabricCompressionStrategy("dgc", {"density": 1.0}), stop=SAVE_AT, save=dense_ckpt
    )
    results["ddp_resumed_from_dgc_density_1"] = _loop("ddp", load=dense_ckpt)
    results["ddp_accumulate_3"] = _loop("ddp", stop=4, accumulate=3)
    results["dgc_density_1_accumulate_3"] = _loop(
        FabricCompressionStrategy("dgc", {"density": 1.0}), stop=4, accumulate=3
    )
    results["deft"] = _loop("deft", stop=4)
    results["powersgd"] = _loop("powersgd", stop=4)
    rank = torch.distributed.get_rank()
    torch.save(results, f"{out}.rank{rank}.pt")


if __name__ == "__main__":
    main()
