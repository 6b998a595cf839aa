"""``Trainer(strategy="dgc")`` under ``torchrun --max-restarts 1``, as the README's "restarts" section runs it:
a checkpoint at every epoch end (``ModelCheckpoint(save_last=True)``) and ``fit(ckpt_path="last")``.

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 \\
        tests/lightning/restart_script.py --out DIR [--kill-at STEP] [--kill-rank RANK]

With ``--kill-at``, rank 1 (``--kill-rank``) SIGKILLs itself at that global step, once: a marker file keeps the
restarted workers from doing it again. Rank 0 writes the final parameters to ``DIR/params.pt``. With
``--num-nodes 2`` (two agents of ``--nproc-per-node 2``) the run is a two-level one (``hierarchical=True``).
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_dgc import DGCStrategy
from tests.lightning.fit_script import Regression, dataset


class KillOnce(L.Callback):
    """SIGKILL ``rank`` at ``step``, the first time only (a lost worker, mid-epoch)."""

    def __init__(self, step: int, marker: Path, rank: int = 1) -> None:
        self.step, self.marker, self.rank = step, marker, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.step and not self.marker.exists():
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--num-nodes", type=int, default=1)
    args = parser.parse_args()
    out = Path(args.out)
    L.seed_everything(0)
    callbacks: list[L.Callback] = [ModelCheckpoint(dirpath=out / "checkpoints", save_last=True, every_n_epochs=1)]
    if args.kill_at is not None:
        callbacks.append(KillOnce(args.kill_at, out / "killed", args.kill_rank))
    strategy = DGCStrategy(density=0.05, min_compress_numel=512, hierarchical=args.num_nodes > 1)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, num_nodes=args.num_nodes, max_epochs=args.epochs,
        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = Regression()
    # 256 samples, 16 per batch and rank: 8 steps per epoch (4 on 2 nodes of 2), shuffled per epoch
    # (DistributedSampler's seed + epoch)
    trainer.fit(model, DataLoader(dataset(256), batch_size=16, shuffle=True), ckpt_path="last")
    # each agent counts its own restarts: one whose workers were healthy when the other's came back to the
    # rendezvous restarts them without counting it
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-1"))
    restarts = trainer.strategy.all_gather(torch.tensor([restart])).reshape(-1).tolist()
    if trainer.global_rank == 0:
        torch.save(
            {
                "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                "global_step": trainer.global_step,
                "restart": restart,
                "restarts": restarts,
                "two_level": strategy.exchange_state.topology is not None,
            },
            out / "params.pt",
        )


if __name__ == "__main__":
    main()
