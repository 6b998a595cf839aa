"""A short 2-process ``fit`` (then ``test`` on the same Trainer) that records, at the very end of the
interpreter's life, whether the process group was still alive.

    python tests/lightning/exit_script.py --strategy dgc --out result [--then-test]

The atexit handler registered first runs last (atexit is LIFO), after the strategy's own.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os

import lightning as L
import torch.distributed as dist
from torch.utils.data import DataLoader

import lightning_dgc  # noqa: F401  (registers the strategy names)
from tests.lightning.fit_script import Regression, dataset


class TestedRegression(Regression):
    def test_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="dgc")
    p.add_argument("--out", required=True)
    p.add_argument("--then-test", action="store_true")
    args = p.parse_args()
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # set by Lightning's launcher in the other rank
    record: dict[str, object] = {}

    def at_exit() -> None:
        record["group_alive_at_exit"] = dist.is_available() and dist.is_initialized()
        with open(f"{args.out}.rank{rank}.json", "w") as f:
            json.dump(record, f)

    atexit.register(at_exit)
    L.seed_everything(0)
    trainer = L.Trainer(
        strategy=args.strategy, accelerator="cpu", devices=2, max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = TestedRegression()
    trainer.fit(model, DataLoader(dataset(96), batch_size=16))
    record["global_step"] = trainer.global_step
    if args.then_test:
        record["test"] = trainer.test(model, DataLoader(dataset(64), batch_size=16), verbose=False)


if __name__ == "__main__":
    main()
