"""Tiny datasets written in the genuine on-disk formats, for the recipe tests.

Each writer produces the files a real download would (pickled CIFAR batches, PTB text files,
LibriSpeech FLAC + ``.trans.txt``), only small and with a signal a tiny model learns in a few
dozen steps. They are plain functions so that multi-process tests can use them too: with
:func:`write_all` and :data:`TINY_OVERRIDES`, a 2-process run of any CPU config takes seconds::

    from tests.recipes.fake_datasets import TINY_OVERRIDES, write_all

    roots = write_all(tmp_path)
    subprocess.run([sys.executable, "-m", "lightning_dgc_recipes", "fit",
                    "--config", "configs/ptb_lstm_cpu.yaml", "--config", "configs/algo/dgc.yaml",
                    *TINY_OVERRIDES["ptb_lstm_cpu"], f"--data.root={roots['ptb_lstm_cpu']}",
                    "--trainer.max_steps=4", "--trainer.limit_val_batches=2",
                    f"--trainer.logger.init_args.save_dir={tmp_path}"], cwd=REPO_ROOT, check=True)

(The CPU configs use 2 processes; Lightning's DDP launcher re-runs the command line, so run the
CLI in a subprocess, not in the pytest process.)
"""

from __future__ import annotations

import pickle
import zlib
from pathlib import Path

import numpy as np
import soundfile

CIFAR_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _cifar_images(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """N x 3072 uint8 images (CHW rows): a class-specific colour and stripe pattern plus noise."""
    n = len(labels)
    images = rng.integers(0, 64, size=(n, 3, 32, 32)).astype(np.int64)
    for index, label in enumerate(labels):
        images[index, label % 3] += 120
        images[index, :, :, label::10] += 60  # vertical stripes whose phase encodes the class
    return np.clip(images, 0, 255).astype(np.uint8).reshape(n, 3072)


def _write_cifar_batch(path: Path, label: bytes, labels: np.ndarray, rng: np.random.Generator) -> None:
    batch = {
        b"batch_label": label,
        b"labels": [int(x) for x in labels],
        b"data": _cifar_images(labels, rng),
        b"filenames": [f"image_{i:05d}.png".encode() for i in range(len(labels))],
    }
    with open(path, "wb") as f:
        pickle.dump(batch, f, protocol=2)


def write_cifar10(
    root: Path, train_images: int = 200, test_images: int = 100, train_batches: int = 1
) -> Path:
    """Write ``root/cifar-10-batches-py/`` with ``data_batch_*``, ``test_batch`` and ``batches.meta``."""
    folder = Path(root) / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for number in range(1, train_batches + 1):
        labels = np.arange(train_images) % 10
        rng.shuffle(labels)
        _write_cifar_batch(
            folder / f"data_batch_{number}", f"training batch {number} of 5".encode(), labels, rng
        )
    _write_cifar_batch(folder / "test_batch", b"testing batch 1 of 1", np.arange(test_images) % 10, rng)
    meta = {
        b"num_cases_per_batch": train_images,
        b"label_names": [c.encode() for c in CIFAR_CLASSES],
        b"num_vis": 3072,
    }
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump(meta, f, protocol=2)
    return Path(root)


def _sentences(count: int, rng: np.random.Generator) -> list[str]:
    """Sentences from a tiny grammar, so the next word is largely predictable."""
    subjects, verbs, objects = (
        ["the cat", "a dog", "the bird", "<unk>"],
        ["sees", "likes", "eats"],
        ["fish", "a bone", "seeds"],
    )
    return [
        " ".join([subjects[rng.integers(4)], verbs[rng.integers(3)], objects[rng.integers(3)], "N", "times"])
        for _ in range(count)
    ]


def write_ptb(root: Path, train_lines: int = 400, eval_lines: int = 60) -> Path:
    """Write ``ptb.train.txt``, ``ptb.valid.txt``, ``ptb.test.txt`` (PTB style: leading space, one sentence per line)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, lines in (("train", train_lines), ("valid", eval_lines), ("test", eval_lines)):
        text = "".join(f" {sentence} \n" for sentence in _sentences(lines, rng))
        (root / f"ptb.{split}.txt").write_text(text, encoding="utf-8")
    return root


#: Words of the fake speech corpus and the tone (Hz) of each of their letters.
SPEECH_WORDS = ["HI", "NO", "ON", "OH"]
_LETTER_TONES = {"H": 500.0, "I": 1100.0, "N": 1700.0, "O": 2500.0}


def _speak(text: str, rng: np.random.Generator, rate: int = 16000) -> np.ndarray:
    """A waveform with one 120 ms tone per letter and short pauses between words."""
    pieces = []
    for word in text.split():
        for letter in word:
            t = np.arange(int(0.12 * rate)) / rate
            pieces.append(0.4 * np.sin(2 * np.pi * _LETTER_TONES[letter] * t))
        pieces.append(np.zeros(int(0.05 * rate)))
    audio = np.concatenate(pieces) + 0.01 * rng.standard_normal(sum(len(p) for p in pieces))
    return audio.astype(np.float32)


def write_librispeech(root: Path, subset: str, utterances: int = 24, speakers: int = 2) -> Path:
    """Write ``root/LibriSpeech/<subset>/SPEAKER/CHAPTER/`` with 16 kHz FLAC files and ``.trans.txt``.

    Like some real copies, the transcript files end without a final newline.
    """
    rng = np.random.default_rng(zlib.crc32(subset.encode()))
    per_speaker = utterances // speakers
    for speaker in range(speakers):
        speaker_id, chapter_id = 100 + speaker, 10 + speaker
        folder = Path(root) / "LibriSpeech" / subset / str(speaker_id) / str(chapter_id)
        folder.mkdir(parents=True, exist_ok=True)
        lines = []
        for number in range(per_speaker):
            words = rng.choice(SPEECH_WORDS, size=int(rng.integers(1, 3)))
            text = " ".join(words)
            utterance_id = f"{speaker_id}-{chapter_id}-{number:04d}"
            soundfile.write(folder / f"{utterance_id}.flac", _speak(text, rng), 16000, subtype="PCM_16")
            lines.append(f"{utterance_id} {text}")
        (folder / f"{speaker_id}-{chapter_id}.trans.txt").write_text("\n".join(lines), encoding="utf-8")
    return Path(root)


#: CLI flags that shrink each CPU config to a few seconds on the fake data (add ``--data.root``).
TINY_OVERRIDES: dict[str, list[str]] = {
    "cifar10_resnet20_cpu": [
        "--model.arch=resnet8", "--model.base_width=4", "--data.batch_size=16", "--data.num_workers=0",
    ],
    "ptb_lstm_cpu": [
        "--model.embedding_dim=16", "--model.hidden_size=16", "--model.dropout=0.0", "--data.batch_size=4", "--data.bptt=8",
    ],
    "ptb_transformer_cpu": [
        "--model.d_model=16", "--model.num_heads=2", "--model.dropout=0.0", "--data.batch_size=4", "--data.bptt=8",
    ],
    "librispeech_deepspeech_cpu": [
        "--model.n_mels=16", "--data.n_mels=16", "--model.conv_channels=4", "--model.rnn_hidden=16",
        "--data.batch_size=4", "--data.num_workers=0",
        "--data.train_subset=train-fake", "--data.val_subset=dev-fake", "--data.test_subset=dev-fake",
    ],
}  # fmt: skip


def write_all(root: Path) -> dict[str, Path]:
    """Write every fake dataset under ``root``; returns the ``--data.root`` of each CPU config."""
    root = Path(root)
    write_librispeech(root / "librispeech", "train-fake")
    write_librispeech(root / "librispeech", "dev-fake", utterances=8)
    return {
        "cifar10_resnet20_cpu": write_cifar10(root / "cifar"),
        "ptb_lstm_cpu": write_ptb(root / "ptb"),
        "ptb_transformer_cpu": root / "ptb",
        "librispeech_deepspeech_cpu": root / "librispeech",
    }
