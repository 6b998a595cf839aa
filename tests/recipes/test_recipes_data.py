"""DataModules on small files in the genuine formats, and their download paths."""

from __future__ import annotations

import hashlib
import os
import pickle
import shlex
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile
import torch
from torch.utils.data import DistributedSampler

from lightning_dgc_recipes import language, speech, vision
from lightning_dgc_recipes.demo import write_synthetic_cifar
from lightning_dgc_recipes.download import DatasetNotFoundError, download_file
from lightning_dgc_recipes.language import EOS, BPTTWindows, PTBDataModule
from lightning_dgc_recipes.speech import LibriSpeechDataModule, encode_transcript, find_utterances
from lightning_dgc_recipes.vision import (
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR10DataModule,
    load_cifar_batch,
    load_cifar_pickle,
)
from tests.recipes import fake_datasets

UNREACHABLE = "http://127.0.0.1:9/unreachable"  # the discard port: connection refused at once


# ----------------------------------------------------------------------------------------------- CIFAR-10


def test_cifar_reads_the_pickle_batches(cifar_root: Path) -> None:
    dm = CIFAR10DataModule(str(cifar_root), batch_size=32, num_workers=0, download=False, augment=False)
    dm.setup("fit")
    assert len(dm.train_set) == 200 and len(dm.val_set) == 100

    with open(cifar_root / "cifar-10-batches-py" / "test_batch", "rb") as f:
        raw = pickle.load(f, encoding="bytes")
    image, label = dm.val_set[7]
    expected = torch.tensor(raw[b"data"][7], dtype=torch.float32).view(3, 32, 32) / 255
    expected = (expected - torch.tensor(CIFAR10_MEAN).view(3, 1, 1)) / torch.tensor(CIFAR10_STD).view(3, 1, 1)
    assert label.item() == raw[b"labels"][7]
    torch.testing.assert_close(image, expected)

    images, labels = next(iter(dm.train_dataloader()))
    assert images.shape == (32, 3, 32, 32) and images.dtype == torch.float32
    assert labels.dtype == torch.long and labels.max() < 10


def test_cifar_augmentation_is_a_padded_crop_or_flip(cifar_root: Path) -> None:
    dm = CIFAR10DataModule(str(cifar_root), num_workers=0, download=False)
    dm.setup("fit")
    plain = vision.CIFARImages(dm.train_set.images, dm.train_set.labels, augment=False)[0][0]
    torch.manual_seed(0)
    views = [dm.train_set[0][0] for _ in range(20)]
    assert any(not torch.equal(view, plain) for view in views)
    background = (-torch.tensor(CIFAR10_MEAN) / torch.tensor(CIFAR10_STD)).view(3, 1, 1)
    padded = (
        torch.nn.functional.pad(plain - background, (4, 4, 4, 4)) + background
    )  # zero pixels at the border
    for view in views:  # every view is a 32x32 window of the padded image, possibly mirrored
        windows = padded.unfold(1, 32, 1).unfold(2, 32, 1).permute(1, 2, 0, 3, 4)  # [9, 9, 3, 32, 32]
        assert any(
            torch.allclose(candidate, w) for w in windows.flatten(0, 1) for candidate in (view, view.flip(-1))
        )


def test_cifar_concatenates_all_training_batches(tmp_path: Path) -> None:
    fake_datasets.write_cifar10(tmp_path, train_images=30, test_images=10, train_batches=3)
    dm = CIFAR10DataModule(str(tmp_path), num_workers=0, download=False)
    dm.setup("fit")
    assert len(dm.train_set) == 90


class _WritesMarker:
    """Unpickling this runs ``function(argument)``, which creates the marker file: a stand-in for any attack."""

    def __init__(self, function: object, argument: str) -> None:
        self.function, self.argument = function, argument

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return self.function, (self.argument,)


@pytest.mark.parametrize("attack", ["os.system", "exec"])
def test_cifar_refuses_a_pickle_that_would_run_code(tmp_path: Path, attack: str) -> None:
    fake_datasets.write_cifar10(tmp_path, train_images=20, test_images=10)
    marker = tmp_path / "pwned"
    if attack == "os.system":
        payload = _WritesMarker(os.system, f"echo pwned > {shlex.quote(str(marker))}")
    else:
        payload = _WritesMarker(exec, f"open({str(marker)!r}, 'w').write('pwned')")
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_1"
    batch.write_bytes(pickle.dumps({b"data": payload, b"labels": [0]}, protocol=2))

    dm = CIFAR10DataModule(str(tmp_path), num_workers=0, download=False)
    with pytest.raises(pickle.UnpicklingError, match="which the official archive never contains") as error:
        dm.setup("fit")
    assert not marker.exists()  # refused before anything ran
    message = str(error.value)
    # the global as the file spells it: 'posix.system' on Linux, '__builtin__.exec' at protocol 2
    assert f"{batch} is not a CIFAR-10 batch: it asks for '" in message
    assert f".{payload.function.__name__}', which" in message
    assert f"Delete the folder {batch.parent}" in message and "download=True" in message

    pickle.loads(batch.read_bytes())  # the same file through plain pickle does run its code
    assert marker.exists()


@pytest.mark.parametrize("writer", ["fake_datasets", "demo", "numpy 1 names"])
def test_cifar_safe_unpickler_reads_the_real_formats(tmp_path: Path, writer: str) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    if writer == "demo":
        write_synthetic_cifar(tmp_path, train_per_class=2, test_per_class=1)
    else:
        fake_datasets.write_cifar10(tmp_path, train_images=20, test_images=10)
    if writer == "numpy 1 names":  # the official archive (and numpy < 2) names numpy.core, not numpy._core
        for path in folder.iterdir():
            path.write_bytes(
                path.read_bytes().replace(b"numpy._core.multiarray\n", b"numpy.core.multiarray\n")
            )
        assert b"numpy.core.multiarray\n_reconstruct" in (folder / "test_batch").read_bytes()
    for name in ("data_batch_1", "test_batch"):
        with open(folder / name, "rb") as f:
            raw = pickle.load(f, encoding="bytes")
        images, labels = load_cifar_batch(folder / name)
        assert torch.equal(images.flatten(1), torch.as_tensor(raw[b"data"]))
        assert labels.tolist() == list(raw[b"labels"])
    meta = load_cifar_pickle(folder / "batches.meta")
    assert meta[b"label_names"][0] == b"airplane" and meta[b"num_vis"] == 3072


def test_cifar_truncated_batch_names_the_file(tmp_path: Path) -> None:
    fake_datasets.write_cifar10(tmp_path, train_images=20, test_images=10)
    batch = tmp_path / "cifar-10-batches-py" / "test_batch"
    batch.write_bytes(batch.read_bytes()[: batch.stat().st_size // 2])  # an interrupted copy
    with pytest.raises(pickle.UnpicklingError, match="damaged or was cut short") as error:
        CIFAR10DataModule(str(tmp_path), num_workers=0, download=False).setup("validate")
    message = str(error.value)
    assert f"{batch} is not a readable CIFAR-10 batch (UnpicklingError: pickle data was truncated)" in message
    assert f"Delete the folder {batch.parent}" in message and "download=True" in message


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ({b"labels": [0, 1]}, r"it should be a dict with b'data' and b'labels', found \[b'labels'\]"),
        ([1, 2], "it should be a dict with b'data' and b'labels', found a list"),
        (
            {b"data": np.zeros((2, 1024), np.uint8), b"labels": [0, 1]},
            r"b'data' should be N x 3072 uint8 images, found an array of shape \(2, 1024\) and dtype uint8",
        ),
        (
            {b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]},
            r"b'data' should be N x 3072 uint8 images, found an array of shape \(2, 3072\) and dtype float32",
        ),
        (
            {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]},
            r"b'labels' should be 2 integers in 0..9 \(one per image\), found an array of shape \(1,\)",
        ),
        (
            {b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]},
            r"b'labels' should be 2 integers in 0..9",
        ),
    ],
)
def test_cifar_batch_with_wrong_content_names_the_file(tmp_path: Path, content: object, problem: str) -> None:
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_1"
    batch.parent.mkdir()
    batch.write_bytes(pickle.dumps(content, protocol=2))
    with pytest.raises(ValueError, match=problem) as error:
        load_cifar_batch(batch)
    assert str(error.value).startswith(f"{batch} is not a CIFAR-10 batch: ")
    assert f"Delete the folder {batch.parent}" in str(error.value)


def _fake_cifar_archive(tmp_path: Path) -> tuple[Path, str]:
    source = fake_datasets.write_cifar10(tmp_path / "source", train_images=20, test_images=10)
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(source / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    return archive, hashlib.md5(archive.read_bytes()).hexdigest()


def test_cifar_downloads_checks_and_extracts_the_archive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive, md5 = _fake_cifar_archive(tmp_path)
    monkeypatch.setattr(
        vision, "CIFAR10_URL", archive.as_uri()
    )  # a file:// URL goes through urllib like https
    monkeypatch.setattr(vision, "CIFAR10_MD5", md5)
    dm = CIFAR10DataModule(str(tmp_path / "root"), num_workers=0)
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_set) == 20 and len(dm.val_set) == 10


def test_cifar_rejects_an_archive_with_the_wrong_md5(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    archive, _ = _fake_cifar_archive(tmp_path)
    monkeypatch.setattr(vision, "CIFAR10_URL", archive.as_uri())
    with pytest.raises(DatasetNotFoundError, match="does not have the MD5"):
        CIFAR10DataModule(str(tmp_path / "root")).prepare_data()  # the real MD5 of the official archive
    assert not list((tmp_path / "root").glob("cifar-10-python.tar.gz*"))  # nothing half-written is left


def test_cifar_offline_error_says_where_to_put_the_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vision, "CIFAR10_URL", f"{UNREACHABLE}/cifar-10-python.tar.gz")
    with pytest.raises(DatasetNotFoundError, match="Could not download") as error:
        CIFAR10DataModule(str(tmp_path)).prepare_data()
    assert str(tmp_path / "cifar-10-batches-py" / "data_batch_1") in str(error.value)
    assert "--data.root" in str(error.value)
    with pytest.raises(DatasetNotFoundError, match="download=False"):
        CIFAR10DataModule(str(tmp_path), download=False).setup("fit")


def test_download_file_reuses_a_verified_file(tmp_path: Path) -> None:
    path = tmp_path / "file.txt"
    path.write_text("hello")
    md5 = hashlib.md5(b"hello").hexdigest()
    assert download_file(UNREACHABLE, path, md5, hint="") == path  # no network needed


def test_imagenet_needs_torchvision_or_folders(tmp_path: Path) -> None:
    dm = vision.ImageNetDataModule(str(tmp_path))
    try:
        import torchvision  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"lightning-dgc\[vision\]"):
            dm.setup("fit")
    else:
        with pytest.raises(DatasetNotFoundError, match="image-net.org"):
            dm.setup("fit")


# ----------------------------------------------------------------------------------------------- PTB


def test_ptb_vocabulary_and_eos(ptb_root: Path) -> None:
    dm = PTBDataModule(str(ptb_root), batch_size=4, bptt=8, download=False)
    dm.setup("fit")
    lines = (ptb_root / "ptb.train.txt").read_text().splitlines()
    assert len(dm.tokens["train"]) == sum(len(line.split()) + 1 for line in lines)
    index = dm.vocabulary.index
    assert dm.tokens["train"][len(lines[0].split())].item() == index[EOS]  # <eos> closes every line
    assert dm.vocab_size == len({w for line in lines for w in line.split()}) + 1
    assert dm.tokens["valid"].max() < dm.vocab_size


def test_ptb_unknown_words_map_to_unk(tmp_path: Path) -> None:
    fake_datasets.write_ptb(tmp_path)
    with open(tmp_path / "ptb.test.txt", "a") as f:
        f.write(" zebra \n")
    dm = PTBDataModule(str(tmp_path), download=False)
    dm.setup("test")
    assert dm.tokens["test"][-2].item() == dm.vocabulary.index["<unk>"]


@pytest.mark.parametrize("split", ["train", "valid", "test"])
@pytest.mark.parametrize("content", ["", "\n \n\n"])
def test_ptb_file_without_words_names_the_file(tmp_path: Path, split: str, content: str) -> None:
    fake_datasets.write_ptb(tmp_path)
    (tmp_path / f"ptb.{split}.txt").write_text(content)
    with pytest.raises(ValueError, match="holds no words") as error:
        PTBDataModule(str(tmp_path), download=False).setup("fit")
    assert str(error.value) == (
        f"{tmp_path / f'ptb.{split}.txt'} holds no words: the file is empty or blank, perhaps from an "
        "interrupted download or copy. Delete it and let the DataModule download it again (download=True), "
        f"or put Mikolov's ptb.{split}.txt there."
    )


def test_bptt_windows_cover_the_batchified_stream() -> None:
    tokens = torch.arange(103)
    windows = BPTTWindows(tokens, batch_size=4, bptt=6)
    stream = tokens[:100].view(4, 25)  # 4 rows of 25 columns, the remainder dropped
    assert len(windows) == 4  # 24 (input, target) columns in windows of 6
    inputs = torch.cat([windows[i][0] for i in range(len(windows))], dim=1)
    targets = torch.cat([windows[i][1] for i in range(len(windows))], dim=1)
    torch.testing.assert_close(inputs, stream[:, :-1])
    torch.testing.assert_close(targets, stream[:, 1:])
    assert windows[3][0].shape == (4, 6)
    assert BPTTWindows(torch.arange(103), batch_size=4, bptt=7)[3][0].shape == (4, 3)  # shorter last window


def test_bptt_windows_give_each_process_consecutive_windows_of_its_own_rows() -> None:
    tokens = torch.arange(1000)
    windows = BPTTWindows(tokens, batch_size=5, bptt=7, num_replicas=2)
    seen = []
    for rank in range(2):
        sampler = DistributedSampler(windows, num_replicas=2, rank=rank, shuffle=False)
        inputs = [windows[i][0] for i in sampler]
        assert len(inputs) == len(windows) // 2  # both processes take the same number of steps
        rows = torch.cat(inputs, dim=1)
        assert torch.all(rows[:, 1:] - rows[:, :-1] == 1)  # each row continues the previous window
        seen.append(rows)
    assert not set(seen[0].flatten().tolist()) & set(seen[1].flatten().tolist())  # disjoint parts


def test_ptb_dataloader_brings_its_own_distributed_sampler(ptb_root: Path) -> None:
    dm = PTBDataModule(str(ptb_root), batch_size=4, bptt=8, download=False)
    dm.setup("fit")
    dm.trainer = SimpleNamespace(world_size=2, global_rank=1)  # what a DDP Trainer exposes on rank 1
    loader = dm.train_dataloader()
    assert isinstance(loader.sampler, DistributedSampler) and loader.sampler.rank == 1
    assert next(iter(loader))[0].shape == (4, 8)


def test_ptb_offline_error_says_where_to_put_the_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(language, "PTB_URL", UNREACHABLE + "/ptb.{split}.txt")
    with pytest.raises(DatasetNotFoundError, match="Could not download") as error:
        PTBDataModule(str(tmp_path)).setup("fit")
    assert f"in {tmp_path}" in str(error.value) and "ptb.train.txt" in str(error.value)


def test_ptb_download_checks_md5(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = fake_datasets.write_ptb(tmp_path / "source")
    monkeypatch.setattr(language, "PTB_URL", source.as_uri() + "/ptb.{split}.txt")
    with pytest.raises(DatasetNotFoundError, match="MD5"):  # the fake files are not the real PTB
        PTBDataModule(str(tmp_path / "root")).prepare_data()
    md5 = {
        split: hashlib.md5((source / f"ptb.{split}.txt").read_bytes()).hexdigest()
        for split in language.PTB_MD5
    }
    monkeypatch.setattr(language, "PTB_MD5", md5)
    dm = PTBDataModule(str(tmp_path / "root"))
    dm.setup("fit")
    assert dm.vocab_size > 5


# ----------------------------------------------------------------------------------------------- LibriSpeech


def test_librispeech_reads_transcripts_without_final_newline(librispeech_root: Path) -> None:
    trans = sorted((librispeech_root / "LibriSpeech" / "train-fake").glob("*/*/*.trans.txt"))
    assert not trans[0].read_text().endswith("\n")
    utterances = find_utterances(librispeech_root / "LibriSpeech" / "train-fake")
    assert len(utterances) == 24 and all(path.is_file() for path, _ in utterances)
    last_line = trans[0].read_text().splitlines()[-1]
    assert last_line.split(" ", 1)[1] in [text for _, text in utterances]


def test_librispeech_batches_are_bucketed_and_padded(librispeech_root: Path) -> None:
    dm = LibriSpeechDataModule(
        str(librispeech_root), "train-fake", "dev-fake", batch_size=4, num_workers=0, n_mels=16
    )
    dm.setup("fit")
    train = dm.datasets["train"]
    durations = [u[2] for batch in train.batches for u in batch]
    assert durations == sorted(durations) and len(train) == 6
    features, lengths, targets, target_lengths, texts = next(iter(dm.train_dataloader()))
    assert features.shape[:2] == (4, 16) and features.shape[2] == lengths.max()
    assert lengths.shape == target_lengths.shape == (4,)
    for row, length, text in zip(targets, target_lengths, texts, strict=True):
        assert torch.equal(row[:length], encode_transcript(text)) and not row[length:].any()


def test_librispeech_spec_augment_only_in_training(librispeech_root: Path) -> None:
    dm = LibriSpeechDataModule(
        str(librispeech_root), "train-fake", "dev-fake", batch_size=4, num_workers=0, n_mels=16
    )
    dm.setup("fit")
    val = dm.datasets["val"]
    assert val.augment is None and torch.equal(val[0][0], val[0][0])
    torch.manual_seed(0)
    assert not torch.equal(dm.datasets["train"][0][0], dm.datasets["train"][0][0])


def test_librispeech_joins_subsets_with_plus(librispeech_root: Path) -> None:
    dm = LibriSpeechDataModule(
        str(librispeech_root), "train-fake+dev-fake", "dev-fake", batch_size=8, num_workers=0
    )
    dm.setup("fit")
    assert sum(len(batch) for batch in dm.datasets["train"].batches) == 32


def test_librispeech_missing_custom_subset_says_where(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError, match="not an official subset") as error:
        LibriSpeechDataModule(str(tmp_path), "train-digits", "test-digits").setup("fit")
    assert str(tmp_path / "LibriSpeech") in str(error.value)


def test_librispeech_offline_download_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # torchaudio owns the openslr.org URL; an unreachable proxy takes the network away just the same
    for variable in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(variable, "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    with pytest.raises(DatasetNotFoundError, match="Could not download LibriSpeech dev-clean") as error:
        LibriSpeechDataModule(str(tmp_path), val_subset="dev-clean").setup("validate")
    assert "dev-clean.tar.gz" in str(error.value) and "--data.root" in str(error.value)


def test_librispeech_resamples_other_rates(tmp_path: Path) -> None:
    folder = tmp_path / "LibriSpeech" / "x" / "1" / "2"
    folder.mkdir(parents=True)
    soundfile.write(folder / "1-2-0000.flac", np.zeros(8000, dtype=np.float32), 8000)
    (folder / "1-2.trans.txt").write_text("1-2-0000 HELLO WORLD")
    dm = LibriSpeechDataModule(str(tmp_path), "x", "x", batch_size=1, num_workers=0, n_mels=16)
    dm.setup("validate")
    features, lengths, *_ = dm.datasets["val"][0]
    assert lengths.item() == 101  # one second at 16 kHz in 10 ms hops (centred frames)
    assert speech.SAMPLE_RATE == 16000
