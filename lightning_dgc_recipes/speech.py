"""Speech-recognition recipe: DeepSpeech-style CTC model on LibriSpeech (DGC paper, section 5.1).

The paper trains "a 7-layer GRU of 1200 hidden units per layer" after a convolutional front-end
(DeepSpeech 2 layout) on LibriSpeech with Nesterov momentum SGD, gradient clipping and a learning
rate annealed every epoch, without a language model. :class:`DeepSpeech` reaches that size by
configuration (``rnn_layers: 7, rnn_hidden: 1200``); the defaults are small enough for a CPU.

* Features: log-mel spectrogram (torchaudio), normalised per utterance; SpecAugment-style
  frequency and time masks (torchaudio) on the training set only.
* Audio is read with ``soundfile`` (``torchaudio.load`` needs ffmpeg/torchcodec).
* Batches hold utterances of similar length: utterances are sorted by duration and cut into
  batches once; a dataset item is a whole batch, and the batch order is shuffled every epoch (by
  the DistributedSampler Lightning inserts under DDP, so every process gets different batches).
* Decoding is greedy CTC; word and character error rates come from torchmetrics.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import lightning as L
import soundfile
import torch
import torch.nn.functional as F
import torchaudio
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence, pad_sequence
from torch.utils.data import DataLoader, Dataset
from torchmetrics.text import CharErrorRate, WordErrorRate

from lightning_dgc_recipes.download import DatasetNotFoundError

__all__ = ["CHARACTERS", "DeepSpeech", "LibriSpeechDataModule", "SpeechRecognizer", "greedy_decode"]

#: Output alphabet: index 0 is the CTC blank, then space, apostrophe and A-Z.
CHARACTERS: tuple[str, ...] = ("<blank>", " ", "'", *string.ascii_uppercase)
_CHAR_INDEX = {c: i for i, c in enumerate(CHARACTERS) if i > 0}
#: LibriSpeech subsets that torchaudio knows how to download.
LIBRISPEECH_SUBSETS = (
    "dev-clean", "dev-other", "test-clean", "test-other", "train-clean-100", "train-clean-360", "train-other-500",
)  # fmt: skip
SAMPLE_RATE = 16000

Batch = tuple[Tensor, Tensor, Tensor, Tensor, list[str]]


def encode_transcript(text: str) -> Tensor:
    """Character indices of ``text`` (upper-cased; characters outside the alphabet are dropped)."""
    return torch.tensor([_CHAR_INDEX[c] for c in text.upper() if c in _CHAR_INDEX], dtype=torch.long)


def greedy_decode(log_probs: Tensor, lengths: Tensor) -> list[str]:
    """Best-path CTC decoding: most likely class per frame, repeats merged, blanks removed.

    Args:
        log_probs: ``[batch, time, classes]`` scores.
        lengths: valid frames per utterance.
    """
    best = log_probs.argmax(-1).cpu()
    texts = []
    for path, length in zip(best, lengths.tolist(), strict=True):
        merged = torch.unique_consecutive(path[:length])
        texts.append("".join(CHARACTERS[i] for i in merged.tolist() if i != 0).strip())
    return texts


def find_utterances(folder: Path) -> list[tuple[Path, str]]:
    """(FLAC path, transcript) pairs of a LibriSpeech subset folder ``SPEAKER/CHAPTER/*.trans.txt``."""
    utterances = []
    for transcripts in sorted(folder.glob("*/*/*.trans.txt")):
        for line in transcripts.read_text(encoding="utf-8").splitlines():  # a final newline is optional
            if line.strip():
                utterance_id, _, text = line.strip().partition(" ")
                utterances.append((transcripts.parent / f"{utterance_id}.flac", text))
    return utterances


class LibriSpeechBatches(Dataset[Batch]):
    """Length-bucketed batches of LibriSpeech utterances with log-mel features.

    Item ``i`` is the ``i``-th batch: ``(features [B, n_mels, T], feature_lengths [B],
    targets [B, S], target_lengths [B], transcripts)``.
    """

    def __init__(
        self, utterances: list[tuple[Path, str, float]], batch_size: int, n_mels: int, spec_augment: bool,
        freq_mask_param: int, time_mask_param: int, time_mask_ratio: float,
    ) -> None:  # fmt: skip
        ordered = sorted(utterances, key=lambda u: u[2])
        self.batches = [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]
        self.melspec = torchaudio.transforms.MelSpectrogram(
            SAMPLE_RATE, n_fft=400, hop_length=160, n_mels=n_mels
        )
        self.augment: nn.Module | None = None
        if spec_augment:
            self.augment = nn.Sequential(
                torchaudio.transforms.FrequencyMasking(freq_mask_param),
                torchaudio.transforms.FrequencyMasking(freq_mask_param),
                torchaudio.transforms.TimeMasking(time_mask_param, p=time_mask_ratio),
                torchaudio.transforms.TimeMasking(time_mask_param, p=time_mask_ratio),
            )

    def __len__(self) -> int:
        return len(self.batches)

    def features(self, path: Path) -> Tensor:
        """Log-mel spectrogram ``[n_mels, frames]`` of one file, normalised to zero mean, unit variance."""
        audio, rate = soundfile.read(path, dtype="float32", always_2d=True)
        waveform = torch.from_numpy(audio).mean(1)
        if rate != SAMPLE_RATE:
            waveform = torchaudio.functional.resample(waveform, rate, SAMPLE_RATE)
        spectrogram = self.melspec(waveform).clamp_min(1e-10).log()
        spectrogram = (spectrogram - spectrogram.mean()) / (spectrogram.std() + 1e-5)
        if self.augment is not None:
            spectrogram = self.augment(spectrogram.unsqueeze(0)).squeeze(0)
        return spectrogram

    def __getitem__(self, index: int) -> Batch:
        batch = self.batches[index]
        features = [self.features(path) for path, _, _ in batch]
        targets = [encode_transcript(text) for _, text, _ in batch]
        return (
            pad_sequence([f.T for f in features], batch_first=True).transpose(1, 2),
            torch.tensor([f.shape[1] for f in features]),
            pad_sequence(targets, batch_first=True),
            torch.tensor([len(t) for t in targets]),
            [text for _, text, _ in batch],
        )


class LibriSpeechDataModule(L.LightningDataModule):
    """LibriSpeech in its distributed layout, ``<root>/LibriSpeech/<subset>/SPEAKER/CHAPTER/``.

    Each chapter folder holds ``SPEAKER-CHAPTER-UTT.flac`` files and ``SPEAKER-CHAPTER.trans.txt``
    with lines ``UTT-ID TRANSCRIPT``. Any subset name works (e.g. a custom ``train-digits``); the
    official ones are downloaded with torchaudio when missing and ``download`` is set.

    Args:
        root: folder holding ``LibriSpeech/``.
        train_subset: subset(s) to train on; several can be joined with ``+``
            (``train-clean-100+train-clean-360``).
        val_subset: subset for validation.
        test_subset: subset for ``trainer.test``; ``None`` reuses ``val_subset``.
        batch_size: utterances per batch per process (paper's DeepSpeech runs: 20).
        num_workers: DataLoader worker processes (decode FLAC and compute features).
        download: fetch official subsets that are missing.
        n_mels: mel bands of the features (the model's ``n_mels`` must match).
        max_duration: drop training utterances longer than this many seconds (``None``: keep all).
        spec_augment: apply frequency and time masking to training features.
        freq_mask_param: widest frequency mask, in mel bands (two masks).
        time_mask_param: widest time mask, in frames (two masks).
        time_mask_ratio: a time mask covers at most this fraction of an utterance.
    """

    def __init__(
        self,
        root: str = "data",
        train_subset: str = "train-clean-100",
        val_subset: str = "dev-clean",
        test_subset: str | None = "test-clean",
        batch_size: int = 20,
        num_workers: int = 4,
        download: bool = True,
        n_mels: int = 80,
        max_duration: float | None = None,
        spec_augment: bool = True,
        freq_mask_param: int = 15,
        time_mask_param: int = 35,
        time_mask_ratio: float = 0.2,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.root = Path(root)
        self.batch_size, self.num_workers, self.n_mels = batch_size, num_workers, n_mels
        self.datasets: dict[str, LibriSpeechBatches] = {}

    def _subsets(self, stage: str) -> list[str]:
        hp = self.hparams
        names = {"train": hp.train_subset, "val": hp.val_subset, "test": hp.test_subset or hp.val_subset}
        return names[stage].split("+")

    def _folder(self, subset: str) -> Path:
        return self.root / "LibriSpeech" / subset

    def _splits(self, stage: str | None) -> tuple[str, ...]:
        return {"fit": ("train", "val"), "validate": ("val",), "test": ("test",)}.get(
            stage or "", ("train", "val", "test")
        )

    def prepare_data(self) -> None:
        """Download the missing official subsets this run needs (runs on one process per node)."""
        self._ensure_subsets(self.trainer.state.fn if self.trainer is not None else None)

    def _ensure_subsets(self, stage: str | None) -> None:
        subsets = {subset for split in self._splits(stage) for subset in self._subsets(split)}
        for subset in sorted(subsets):
            folder = self._folder(subset)
            if folder.is_dir():
                continue
            hint = (
                f"Put the subset in {folder}/SPEAKER/CHAPTER/ (FLAC files and SPEAKER-CHAPTER.trans.txt), "
                "or point --data.root at the folder holding LibriSpeech/."
            )
            if subset not in LIBRISPEECH_SUBSETS:
                raise DatasetNotFoundError(
                    f"{folder} not found, and {subset!r} is not an official subset. {hint}"
                )
            if not self.hparams.download:
                raise DatasetNotFoundError(f"{folder} not found and download=False. {hint}")
            try:
                torchaudio.datasets.LIBRISPEECH(str(self.root), url=subset, download=True)
            except Exception as error:  # urllib, hub and tar errors alike: say what to do instead
                raise DatasetNotFoundError(
                    f"Could not download LibriSpeech {subset} from openslr.org ({error}). Fetch "
                    f"https://www.openslr.org/resources/12/{subset}.tar.gz by hand and unpack it in {self.root}. {hint}"
                ) from error

    def _dataset(self, stage: str) -> LibriSpeechBatches:
        utterances = []
        for subset in self._subsets(stage):
            for path, text in find_utterances(self._folder(subset)):
                info = soundfile.info(path)
                utterances.append((path, text, info.frames / info.samplerate))
        if not utterances:
            raise DatasetNotFoundError(
                f"No utterances found in {[str(self._folder(s)) for s in self._subsets(stage)]}."
            )
        hp = self.hparams
        if stage == "train" and hp.max_duration is not None:
            utterances = [u for u in utterances if u[2] <= hp.max_duration]
        augment = hp.spec_augment and stage == "train"
        return LibriSpeechBatches(
            utterances,
            self.batch_size,
            self.n_mels,
            augment,
            hp.freq_mask_param,
            hp.time_mask_param,
            hp.time_mask_ratio,
        )

    def setup(self, stage: str | None = None) -> None:
        self._ensure_subsets(stage)  # a DataModule used without a Trainer still finds (or fetches) its data
        for split in self._splits(stage):
            if split not in self.datasets:
                self.datasets[split] = self._dataset(split)

    def _loader(self, split: str) -> DataLoader[Any]:
        if split not in self.datasets:
            raise RuntimeError("Call setup() before asking for a DataLoader.")
        return DataLoader(
            self.datasets[split],
            batch_size=None,  # items are whole, length-bucketed batches
            shuffle=split == "train",
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
        )

    def train_dataloader(self) -> DataLoader[Any]:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader[Any]:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader[Any]:
        return self._loader("test")


class BatchRNN(nn.Module):
    """Optional sequence-wise batch norm, then a bidirectional GRU whose two directions are summed."""

    def __init__(self, input_size: int, hidden_size: int, batch_norm: bool) -> None:
        super().__init__()
        self.batch_norm = nn.BatchNorm1d(input_size) if batch_norm else None
        self.rnn = nn.GRU(input_size, hidden_size, batch_first=True, bidirectional=True)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        if self.batch_norm is not None:
            x = self.batch_norm(x.transpose(1, 2)).transpose(1, 2)
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        output, _ = pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=x.shape[1])
        forward, backward = output.chunk(2, dim=-1)
        return forward + backward


def _conv_block(
    in_channels: int, out_channels: int, kernel: tuple[int, int], stride: tuple[int, int]
) -> nn.Module:
    padding = (kernel[0] // 2, kernel[1] // 2)
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel, stride=stride, padding=padding, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.Hardtanh(0, 20, inplace=True),
    )


class DeepSpeech(nn.Module):
    """DeepSpeech 2-style acoustic model: two 2-D convolutions, stacked bidirectional GRUs, linear.

    Time is subsampled by 2 in the first convolution; frames past each utterance's end are zeroed
    after every convolution block (DeepSpeech 2's "MaskConv"), so the padding of a batch does not
    change a shorter utterance's output. Output: ``[batch, frames, len(CHARACTERS)]``
    log-probabilities and the valid frames per utterance.

    Written here because ``torchaudio.models.DeepSpeech`` is the original DeepSpeech (dense layers
    around a single bidirectional vanilla RNN) and cannot express the paper's stacked-GRU network.
    """

    def __init__(
        self, n_mels: int = 80, conv_channels: int = 32, rnn_hidden: int = 256, rnn_layers: int = 3
    ) -> None:
        super().__init__()
        self.conv = nn.ModuleList(
            [
                _conv_block(1, conv_channels, (41, 11), (2, 2)),
                _conv_block(conv_channels, conv_channels, (21, 11), (2, 1)),
            ]
        )
        self.time_strides = (2, 1)
        frequencies = ((n_mels - 1) // 2 + 1 - 1) // 2 + 1
        sizes = [conv_channels * frequencies] + [rnn_hidden] * rnn_layers
        self.rnns = nn.ModuleList(
            BatchRNN(sizes[i], sizes[i + 1], batch_norm=i > 0) for i in range(rnn_layers)
        )
        self.head_norm = nn.BatchNorm1d(rnn_hidden)
        self.head = nn.Linear(rnn_hidden, len(CHARACTERS), bias=False)

    def forward(self, features: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        x = features.unsqueeze(1)  # [B, 1, n_mels, T]
        lengths = lengths.to(x.device)
        for block, stride in zip(self.conv, self.time_strides, strict=True):
            x = block(x)
            lengths = torch.div(lengths - 1, stride, rounding_mode="floor") + 1  # kernel 11, padding 5
            x = x * (torch.arange(x.shape[-1], device=x.device) < lengths.unsqueeze(1))[:, None, None, :]
        x = x.flatten(1, 2).transpose(1, 2)  # [B, T', C * F']
        for rnn in self.rnns:
            x = rnn(x, lengths)
        logits = self.head(self.head_norm(x.transpose(1, 2)).transpose(1, 2))
        return logits.log_softmax(-1), lengths


class SpeechRecognizer(L.LightningModule):
    """CTC training of :class:`DeepSpeech` with Nesterov SGD; greedy decoding, WER and CER.

    Args:
        n_mels: feature bands, equal to the DataModule's ``n_mels``.
        conv_channels: channels of both convolutions (DeepSpeech 2: 32).
        rnn_hidden: GRU units per layer and direction (paper: 1200).
        rnn_layers: stacked bidirectional GRUs (paper: 7).
        lr: SGD learning rate; the loss is summed over each utterance and averaged over the batch.
        momentum: SGD momentum.
        nesterov: Nesterov momentum (the paper's choice).
        weight_decay: L2 penalty.
        lr_anneal: the learning rate is divided by this after every epoch (deepspeech.pytorch: 1.1).
    """

    def __init__(
        self,
        n_mels: int = 80,
        conv_channels: int = 32,
        rnn_hidden: int = 256,
        rnn_layers: int = 3,
        lr: float = 3e-4,
        momentum: float = 0.9,
        nesterov: bool = True,
        weight_decay: float = 1e-5,
        lr_anneal: float = 1.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = DeepSpeech(n_mels, conv_channels, rnn_hidden, rnn_layers)
        self.val_wer, self.val_cer = WordErrorRate(), CharErrorRate()
        self.test_wer, self.test_cer = WordErrorRate(), CharErrorRate()

    def setup(self, stage: str) -> None:
        """Fail early, with both setting names, when the model and the data disagree on the features."""
        data_mels = getattr(self.trainer.datamodule, "n_mels", None) if self._trainer is not None else None
        if data_mels is not None and data_mels != self.hparams.n_mels:
            raise ValueError(
                f"model.n_mels={self.hparams.n_mels} but data.n_mels={data_mels}; set them equal."
            )

    def forward(self, features: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        return self.model(features, lengths)

    def _loss(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
        features, feature_lengths, targets, target_lengths, _ = batch
        log_probs, lengths = self(features, feature_lengths)
        loss = F.ctc_loss(
            log_probs.transpose(0, 1),
            targets,
            lengths,
            target_lengths,
            blank=0,
            reduction="sum",
            zero_infinity=True,
        )
        return loss / features.shape[0], log_probs, lengths

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss, _, _ = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=batch[0].shape[0])
        return loss

    def _evaluate(self, batch: Batch, stage: str, wer: WordErrorRate, cer: CharErrorRate) -> None:
        loss, log_probs, lengths = self._loss(batch)
        hypotheses, references = greedy_decode(log_probs, lengths), batch[4]
        wer(hypotheses, references)
        cer(hypotheses, references)
        size = batch[0].shape[0]
        self.log(f"{stage}_loss", loss, sync_dist=True, batch_size=size)
        self.log(f"{stage}_wer", wer, prog_bar=True, batch_size=size)
        self.log(f"{stage}_cer", cer, prog_bar=True, batch_size=size)

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_wer, self.val_cer)

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_wer, self.test_cer)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        optimizer = torch.optim.SGD(
            self.parameters(),
            lr=hp.lr,
            momentum=hp.momentum,
            nesterov=hp.nesterov,
            weight_decay=hp.weight_decay,
        )
        scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=1.0 / hp.lr_anneal)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}
