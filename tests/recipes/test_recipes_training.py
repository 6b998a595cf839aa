"""Each recipe learns: the training loss of a tiny model falls on tiny data, with a real Trainer."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, RichProgressBar
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_dgc_recipes.__main__ import main
from lightning_dgc_recipes.language import PTBDataModule, WordLanguageModel
from lightning_dgc_recipes.speech import LibriSpeechDataModule, SpeechRecognizer
from lightning_dgc_recipes.vision import CIFAR10DataModule, ImageClassifier
from tests.recipes import fake_datasets

REPO_ROOT = Path(__file__).resolve().parents[2]


class LossHistory(Callback):
    """Records the training loss of every step."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))


def tiny_cifar(root: Path) -> tuple[L.LightningModule, L.LightningDataModule]:
    return ImageClassifier("resnet8", base_width=4, lr=0.05), CIFAR10DataModule(
        str(root), batch_size=16, num_workers=0
    )


def tiny_ptb(root: Path) -> tuple[L.LightningModule, L.LightningDataModule]:
    model = WordLanguageModel(embedding_dim=16, hidden_size=16, dropout=0.0)  # paper's lr 20 with clipping
    return model, PTBDataModule(str(root), batch_size=4, bptt=8)


def tiny_speech(root: Path) -> tuple[L.LightningModule, L.LightningDataModule]:
    model = SpeechRecognizer(n_mels=16, conv_channels=4, rnn_hidden=16, rnn_layers=2, lr=1e-2)
    return model, LibriSpeechDataModule(
        str(root), "train-fake", "dev-fake", batch_size=4, num_workers=0, n_mels=16
    )


@pytest.mark.parametrize(
    ("build", "root_fixture", "metric"),
    [
        (tiny_cifar, "cifar_root", "val_acc"),
        (tiny_ptb, "ptb_root", "val_ppl"),
        (tiny_speech, "librispeech_root", "val_cer"),
    ],
    ids=["cifar10", "ptb", "librispeech"],
)
def test_loss_falls(
    build: Callable[[Path], tuple[L.LightningModule, L.LightningDataModule]],
    root_fixture: str,
    metric: str,
    request: pytest.FixtureRequest,
) -> None:
    torch.manual_seed(0)
    model, data = build(request.getfixturevalue(root_fixture))
    history = LossHistory()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=40,
        val_check_interval=20,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        gradient_clip_val=0.25 if isinstance(model, WordLanguageModel) else None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[history],
    )
    trainer.fit(model, datamodule=data)
    first, last = sum(history.losses[:5]) / 5, sum(history.losses[-5:]) / 5
    assert len(history.losses) == 40 and last < 0.75 * first, history.losses
    assert torch.isfinite(trainer.callback_metrics[metric])


@pytest.mark.parametrize("config", sorted(fake_datasets.TINY_OVERRIDES))
def test_cli_trains_each_cpu_config(
    config: str, fake_data_roots: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m lightning_dgc_recipes fit`` on the CPU YAML, shrunk to a few steps on one process."""
    monkeypatch.chdir(REPO_ROOT)  # the YAML paths in the docs are relative to the repository root
    monkeypatch.setattr(sys, "argv", ["recipes"])  # pytest's own flags are not the CLI's
    args = [
        "fit",
        f"--config=configs/{config}.yaml",
        *fake_datasets.TINY_OVERRIDES[config],
        f"--data.root={fake_data_roots[config]}",
        "--trainer.devices=1",
        "--trainer.max_steps=4",
        "--trainer.limit_val_batches=1",
        "--trainer.val_check_interval=4",
        "--trainer.check_val_every_n_epoch=null",
        "--trainer.enable_checkpointing=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
    ]
    cli = main(args)
    assert cli.trainer.global_step == 4
    assert isinstance(cli.trainer.progress_bar_callback, RichProgressBar)
    assert isinstance(cli.trainer.logger, TensorBoardLogger)
    log_dir = Path(cli.trainer.logger.log_dir)
    assert log_dir.is_relative_to(tmp_path) and list(log_dir.glob("events.out.tfevents.*"))
    assert (log_dir / "config.yaml").is_file()  # LightningCLI saves the merged config next to the logs


def test_language_model_checkpoint_rebuilds_its_vocabulary_layers(ptb_root: Path, tmp_path: Path) -> None:
    """vocab_size comes from the data at setup; it is saved, so a checkpoint restores without the data."""
    model = WordLanguageModel(embedding_dim=16, hidden_size=16)
    args = {
        "accelerator": "cpu",
        "devices": 1,
        "limit_val_batches": 1,
        "logger": False,
        "enable_progress_bar": False,
    }
    trainer = L.Trainer(max_steps=3, default_root_dir=tmp_path, **args)
    trainer.fit(model, datamodule=PTBDataModule(str(ptb_root), batch_size=4, bptt=8))
    trainer.save_checkpoint(tmp_path / "lm.ckpt")
    restored = WordLanguageModel.load_from_checkpoint(tmp_path / "lm.ckpt")
    assert restored.hparams.vocab_size == model.hparams.vocab_size
    assert torch.equal(restored.embedding.weight, model.embedding.weight)
    assert restored.decoder.weight is restored.embedding.weight
    resumed = L.Trainer(max_steps=5, default_root_dir=tmp_path, **args)
    resumed.fit(
        WordLanguageModel(embedding_dim=16, hidden_size=16),
        datamodule=PTBDataModule(str(ptb_root), batch_size=4, bptt=8),
        ckpt_path=tmp_path / "lm.ckpt",
    )
    assert resumed.global_step == 5
