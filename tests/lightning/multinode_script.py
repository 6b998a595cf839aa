"""One node of a multi-node run, launched by ``torchrun`` (one agent per node, c10d rendezvous) or
by ``srun`` (the SLURM variables set for each task):

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID \\
        tests/lightning/multinode_script.py --out DIR [--strategies dgc deft]

For ``dgc`` and then ``deft`` (``--strategies``), in the same processes: ``Trainer(num_nodes=2)`` fits 4 steps and saves
a checkpoint, then a new Trainer resumes from it to step 8. Every rank writes what it saw (world size,
node rank, the strategy's ranks, global steps) and its parameters after each fit.

With ``--devices 2`` (nodes of two processes: the two-level exchange, ``hierarchical="auto"``) the strategies may also be
``powersgd``, ``ddp`` and ``dgc_exact`` (DGC at density 1, exact selection, no masking: 4 steps, compared with ``ddp``),
and ``dgc`` also dumps its memory at the end of the first fit and at the start of the resumed one, and resumes its
checkpoint once more with ``hierarchical=False`` (``dgc_flat``: another topology).
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


def make_strategy(name: str) -> str | lightning_dgc.CompressionStrategy:
    if name == "dgc_exact":
        return lightning_dgc.DGCStrategy(density=1.0, selection="exact", momentum_masking=False)
    if name == "dgc_flat":
        return lightning_dgc.DGCStrategy(hierarchical=False)
    if name == "powersgd":
        return lightning_dgc.CompressionStrategy("powersgd", {"start_iter": 2, "matrix_approximation_rank": 2})
    return name


class MemoryDump(L.Callback):
    """Saves the exchange's committed memory at the start (``at="start"``) or end of ``fit``."""

    def __init__(self, path: Path, at: str) -> None:
        self.path, self.at = path, at

    def _dump(self, trainer: L.Trainer) -> None:
        memory = trainer.strategy.exchange_state.memory.state_dict()
        torch.save(memory, self.path.with_name(f"{self.path.name}.rank{trainer.global_rank}.{self.at}.pt"))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.at == "start":
            self._dump(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.at == "end":
            self._dump(trainer)


def fit(strategy: str, steps: int, out: Path, ckpt: Path | None, devices: int = 1,
        dump: str | None = None) -> L.Trainer:  # fmt: skip
    L.seed_everything(0, verbose=False)
    callbacks = [MemoryDump(out / strategy, dump)] if dump else []
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, num_nodes=2, strategy=make_strategy(strategy), max_steps=steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks,
    )  # fmt: skip
    loader = DataLoader(dataset(), batch_size=16, shuffle=False)
    trainer.fit(Regression(), loader, ckpt_path=ckpt)
    return trainer


def loss_of(module: L.LightningModule) -> float:
    x, y = dataset().tensors
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(module.net(x), y))


def save_params(trainer: L.Trainer, path: Path) -> None:
    torch.save(torch.cat([p.detach().flatten() for p in trainer.lightning_module.parameters()]), path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategies", nargs="+", default=["dgc", "deft"])
    parser.add_argument("--devices", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    report: dict = {}
    L.seed_everything(0, verbose=False)
    initial_loss = loss_of(Regression())
    for name in args.strategies:
        if name in ("ddp", "dgc_exact"):  # 4 steps, for the comparison at density 1
            trainer = fit(name, 4, args.out, None, args.devices)
            rank = trainer.global_rank
            save_params(trainer, args.out / f"{name}.rank{trainer.global_rank}.params.pt")
            stats = trainer.strategy.compression_stats() if name != "ddp" else {}
            report[name] = {"loss": loss_of(trainer.lightning_module), "inter_node_bytes": stats.get("inter_node_bytes")}
            continue
        ckpt = args.out / f"{name}.ckpt"
        dump = args.devices > 1 and name == "dgc"
        first = fit(name, 4, args.out, None, args.devices, dump="end" if dump else None)
        first.save_checkpoint(ckpt)  # (a collective: every rank's exchange state is gathered to rank 0)
        resumed = fit(name, 8, args.out, ckpt, args.devices, dump="start" if dump else None)
        strategy = resumed.strategy
        assert isinstance(strategy, lightning_dgc.CompressionStrategy)
        rank = resumed.global_rank
        if dump:  # the same checkpoint, resumed by a flat exchange over the same processes
            flat = fit("dgc_flat", 8, args.out, ckpt, args.devices)
            report["dgc_flat"] = {
                "resumed_steps": flat.global_step, "hierarchical": flat.strategy.exchange_state.topology is not None,
                "loss": loss_of(flat.lightning_module),
            }  # fmt: skip
            save_params(flat, args.out / f"dgc_flat.rank{rank}.params.pt")
        report[name] = {
            "world_size": resumed.world_size, "node_rank": resumed.node_rank, "global_rank": rank,
            "num_nodes": resumed.num_nodes, "strategy_world_size": strategy.world_size,
            "cluster_environment": type(strategy.cluster_environment).__name__,
            "first_steps": first.global_step, "resumed_steps": resumed.global_step,
            "exchange_step": strategy.compression_stats().get("step"),
            "local_rank": resumed.local_rank, "hierarchical": strategy.exchange_state.topology is not None,
            "inter_node_bytes": strategy.compression_stats().get("inter_node_bytes"),
            "link_bytes": strategy.compression_stats().get("link_bytes"),
            "initial_loss": initial_loss, "loss": loss_of(resumed.lightning_module),
            "momentum_handed_back": [  # SGD's momentum buffers after fit (the exchange's momentum, handed back)
                list(optimizer.state.get(p, {}).get("momentum_buffer", torch.empty(0)).shape)
                for optimizer in resumed.optimizers for group in optimizer.param_groups for p in group["params"]
            ],
        }  # fmt: skip
        params = torch.cat([p.detach().flatten() for p in resumed.lightning_module.parameters()])
        torch.save(params, args.out / f"{name}.rank{rank}.params.pt")
    (args.out / f"rank{rank}.json").write_text(json.dumps(report))
    lightning_dgc.destroy_process_group()


if __name__ == "__main__":
    main()
