"""Parity's byte accounting (``benchmarks.common.RunRecorder``) over a DiLoCo run: the steps inside a round send
nothing, those that end one the outer exchange, and the last outer step at the end of ``fit`` counts too; and the
selection time of every rank, epoch by epoch."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from torch import nn

import lightning_dgc
from benchmarks.common import RunRecorder
from lightning_dgc import DGCStrategy, DiLoCoStrategy


class Tiny(L.LightningModule):
    def __init__(self, width: int | None = None) -> None:
        super().__init__()
        self.net = nn.Linear(8, 2) if width is None else nn.Linear(64, width)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_diloco_runs_bytes_are_its_outer_exchanges_over_every_optimizer_step(tmp_path) -> None:
    path = tmp_path / "run.json"
    data = torch.utils.data.TensorDataset(torch.randn(40, 8), torch.randn(40, 2))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=DiLoCoStrategy(sync_every=4), max_steps=10, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[RunRecorder(str(path))], default_root_dir=tmp_path,
    )  # fmt: skip
    try:
        trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
    finally:
        lightning_dgc.destroy_process_group()
    totals = json.loads(path.read_text())["compression"]
    dense = 4 * (8 * 2 + 2)
    assert totals["steps"] == 10 and totals["dense_bytes"] == 10 * dense
    # outer steps after steps 4 and 8, and at the end of fit over the 2 steps left
    assert totals["bytes_sent"] == 3 * dense and totals["compression_ratio"] == 10 / 3


def test_every_rank_s_selection_time_is_gathered_at_each_epoch_s_end(tmp_path) -> None:
    path = tmp_path / "run.json"
    data = torch.utils.data.TensorDataset(torch.randn(40, 64), torch.randn(40, 40))
    recorder = RunRecorder(str(path))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=DGCStrategy(density=0.01), max_epochs=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[recorder], default_root_dir=tmp_path,
    )  # fmt: skip
    try:
        trainer.fit(Tiny(width=40), torch.utils.data.DataLoader(data, batch_size=4))
    finally:
        lightning_dgc.destroy_process_group()
    totals = json.loads(path.read_text())["compression"]
    assert len(recorder.rank_selection_ms) == 3 and all(len(epoch) == 1 for epoch in recorder.rank_selection_ms)
    assert all(epoch[0] > 0 for epoch in recorder.rank_selection_ms)  # 10 selections an epoch, each timed
    assert totals["rank_selection_ms"] == [pytest.approx(totals["selection_ms"])]
