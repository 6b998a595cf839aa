"""One rank of 2 nodes x 2 processes fitting the misuses of the sharded strategies, one after the other in the same
processes (each fails at setup, on every rank alike), and a module without ``configure_model`` sharded by the
strategy's ``sharded_modules``:

    ... python tests/lightning/hsdp_misuse_script.py --out DIR

Every rank writes ``DIR/misuse.rank<r>.json``: per case, the error's type and message (or ``"trained"`` and the
steps taken).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

import lightning_dgc
from tests.lightning.hsdp_script import Block, Blocks, dataset


class Unsharded(Blocks):
    """Written for DDP: no ``configure_model``."""

    configure_model = L.LightningModule.configure_model


class BlocksOnly(Blocks):
    """Shards its blocks but not itself: the embedding and the head stay unsharded."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        for block in self.blocks:
            fully_shard(block, mesh=self.device_mesh["data_parallel"])


class OnTheWholeWorld(Blocks):
    """Shards over all 4 processes (a 1-D mesh across the nodes) instead of the node's."""

    def configure_model(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(self, mesh=init_device_mesh("cpu", (4,)))


class HSDPItself(Blocks):
    """Native HSDP on the strategy's own 2-D sub-mesh: FSDP would all-reduce across the nodes itself."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self, mesh=self.device_mesh["replicate", "data_parallel"])


class Offloaded(Blocks):
    def configure_model(self) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        fully_shard(self, mesh=self.device_mesh["data_parallel"], offload_policy=CPUOffloadPolicy(pin_memory=False))


class HalfReduce(Blocks):
    """fp16 parameters reduced in fp16: FSDP2 divides that reduce after the hook."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)
        fully_shard(self, mesh=self.device_mesh["data_parallel"], mp_policy=policy)


CASES: dict[str, tuple[type[L.LightningModule], dict[str, Any]]] = {
    "no configure_model": (Unsharded, {}),
    "blocks only": (BlocksOnly, {}),
    "over the whole world": (OnTheWholeWorld, {}),
    "HSDP of FSDP's own": (HSDPItself, {}),
    "CPU offload": (Offloaded, {}),
    "fp16 reduce": (HalfReduce, {}),
    "sharded_modules": (Unsharded, {"sharded_modules": [Block]}),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    seen: dict[str, Any] = {}
    rank = 0
    for case, (module_class, kwargs) in CASES.items():
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, num_nodes=2, max_steps=3, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
            strategy=lightning_dgc.HSDPCompressionStrategy("dgc", density=0.05, **kwargs),
        )  # fmt: skip
        rank = trainer.global_rank
        model = module_class()
        try:
            trainer.fit(model, DataLoader(dataset(), batch_size=8))
            seen[case] = {"trained": trainer.global_step,
                          "sharded": all(type(p).__name__ == "DTensor" for p in model.parameters())}  # fmt: skip
        except (TypeError, ValueError, RuntimeError) as error:
            seen[case] = {"error": type(error).__name__, "message": str(error)}
        nn.Module.zero_grad(model)
    (args.out / f"misuse.rank{rank}.json").write_text(json.dumps(seen))
    lightning_dgc.destroy_process_group()


if __name__ == "__main__":
    main()
