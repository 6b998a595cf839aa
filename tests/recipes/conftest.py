"""Fixtures for the recipe tests: fake datasets in the genuine formats, one CPU thread per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.recipes import fake_datasets


@pytest.fixture(autouse=True)
def one_cpu_thread() -> Iterator[None]:
    """Run each test on one intra-op thread: these models are tiny, and the suite shares its cores with
    multi-process tests, where a second OpenMP thread makes small matrix products 10-50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def cifar_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CIFAR-10 root with one 200-image training batch, a 100-image test batch and batches.meta."""
    return fake_datasets.write_cifar10(tmp_path_factory.mktemp("cifar"))


@pytest.fixture(scope="session")
def ptb_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with small ptb.train.txt / ptb.valid.txt / ptb.test.txt."""
    return fake_datasets.write_ptb(tmp_path_factory.mktemp("ptb"))


@pytest.fixture(scope="session")
def librispeech_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root with LibriSpeech/train-fake (24 utterances) and LibriSpeech/dev-fake (8)."""
    root = tmp_path_factory.mktemp("librispeech")
    fake_datasets.write_librispeech(root, "train-fake")
    fake_datasets.write_librispeech(root, "dev-fake", utterances=8)
    return root


@pytest.fixture(scope="session")
def fake_data_roots(cifar_root: Path, ptb_root: Path, librispeech_root: Path) -> dict[str, Path]:
    """``--data.root`` for each CPU config, to be combined with ``fake_datasets.TINY_OVERRIDES``."""
    return {
        "cifar10_resnet20_cpu": cifar_root,
        "ptb_lstm_cpu": ptb_root,
        "ptb_transformer_cpu": ptb_root,
        "librispeech_deepspeech_cpu": librispeech_root,
    }
