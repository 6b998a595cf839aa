"""Opt-in checks on the real datasets: the loaders read the genuine files and each recipe learns.

Skipped unless ``LIGHTNING_DGC_DATA`` names a data root laid out as::

    $LIGHTNING_DGC_DATA/cifar10-subset/cifar-10-batches-py/   (or the full CIFAR-10)
    $LIGHTNING_DGC_DATA/ptb/ptb.{train,valid,test}.txt
    $LIGHTNING_DGC_DATA/librispeech-digits/LibriSpeech/{train-digits,test-digits}/
    $LIGHTNING_DGC_DATA/librispeech-sample/LibriSpeech/test-clean/   (optional)

Run with ``LIGHTNING_DGC_DATA=/path/to/data pytest -m realdata tests/recipes``. Each recipe trains for a
few dozen steps on one CPU process (about a minute each on a 2-core machine).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_dgc_recipes.language import PTBDataModule, WordLanguageModel
from lightning_dgc_recipes.speech import LibriSpeechDataModule, SpeechRecognizer, find_utterances
from lightning_dgc_recipes.vision import CIFAR10DataModule, ImageClassifier
from tests.recipes.test_recipes_training import LossHistory

DATA = os.environ.get("LIGHTNING_DGC_DATA")
pytestmark = [
    pytest.mark.realdata,
    pytest.mark.slow,
    pytest.mark.skipif(not DATA, reason="set LIGHTNING_DGC_DATA to a data root to run the real-data checks"),
]


def data_dir(*parts: str) -> Path:
    path = Path(DATA or "").joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not found")
    return path


def train_briefly(
    model: L.LightningModule, data: L.LightningDataModule, steps: int, **trainer_args: Any
) -> list[float]:
    torch.manual_seed(0)
    history = LossHistory()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        limit_val_batches=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[history],
        **trainer_args,
    )
    trainer.fit(model, datamodule=data)
    trainer.validate(model, datamodule=data, verbose=False)
    return history.losses


def test_cifar10_resnet20_learns() -> None:
    root = data_dir("cifar10-subset")
    data = CIFAR10DataModule(str(root), batch_size=64, num_workers=0, download=False)
    data.setup("fit")
    assert len(data.val_set) in (2_000, 10_000) and len(data.train_set) in (10_000, 50_000)
    losses = train_briefly(ImageClassifier("resnet20"), data, steps=40)
    assert sum(losses[-10:]) / 10 < sum(losses[:5]) / 5 - 0.1


def test_ptb_lstm_learns() -> None:
    root = data_dir("ptb")
    data = PTBDataModule(str(root), batch_size=20, bptt=35, download=False)
    data.setup("fit")
    assert data.vocab_size == 10_000
    # Mikolov's PTB: 887,521 / 70,390 / 78,669 words plus one <eos> per line
    assert [len(data.tokens[s]) for s in ("train", "valid", "test")] == [929_589, 73_760, 82_430]
    model = WordLanguageModel(embedding_dim=64, hidden_size=64, dropout=0.0)
    losses = train_briefly(model, data, steps=60, gradient_clip_val=0.25)
    assert sum(losses[-10:]) / 10 < sum(losses[:5]) / 5 - 1.0  # from ~ln(10000) = 9.2 towards unigram level


def test_librispeech_digits_deepspeech_learns() -> None:
    root = data_dir("librispeech-digits")
    data = LibriSpeechDataModule(
        str(root),
        "train-digits",
        "test-digits",
        "test-digits",
        batch_size=8,
        num_workers=0,
        download=False,
        n_mels=40,
    )
    data.setup("fit")
    assert sum(len(b) for b in data.datasets["train"].batches) == 2_700
    assert sum(len(b) for b in data.datasets["val"].batches) == 300
    model = SpeechRecognizer(n_mels=40, conv_channels=8, rnn_hidden=64, rnn_layers=2, lr=2e-3)
    losses = train_briefly(model, data, steps=60, gradient_clip_val=400)
    assert sum(losses[-10:]) / 10 < 0.75 * sum(losses[:5]) / 5


def test_librispeech_sample_reads_genuine_files() -> None:
    root = data_dir("librispeech-sample")
    utterances = find_utterances(root / "LibriSpeech" / "test-clean")
    assert len(utterances) == 4 and all(path.is_file() for path, _ in utterances)
    data = LibriSpeechDataModule(
        str(root), "test-clean", "test-clean", batch_size=2, num_workers=0, download=False
    )
    data.setup("validate")
    features, lengths, targets, target_lengths, texts = data.datasets["val"][0]
    assert features.shape[:2] == (2, 80) and lengths.min() > 100 and all(t.isupper() for t in texts)
    assert target_lengths.tolist() == [len(t) for t in texts]
