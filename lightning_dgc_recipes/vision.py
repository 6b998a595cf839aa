"""Image classification recipe: ResNets on CIFAR-10 and ImageNet (DGC paper, section 5.1).

* :class:`ImageClassifier`: cross-entropy training with momentum SGD and a step schedule (Gross &
  Wilber 2016, as in the paper), top-1 accuracy from torchmetrics.
* :class:`CIFAR10DataModule`: the original python pickle batches, downloaded and checked when
  missing, unpickled with an allow-list of globals (a crafted file cannot run code); augmentation
  (4-pixel padded random crop, horizontal flip, per-channel normalisation) in plain torch, so
  CIFAR needs no torchvision.
* :class:`ImageNetDataModule`: ``train/`` and ``val/`` class folders read with torchvision (the
  optional ``vision`` extra), imported only when this DataModule is set up.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Literal

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_dgc_recipes.download import DatasetNotFoundError, download_file, extract_tar
from lightning_dgc_recipes.resnet import build_resnet

__all__ = ["CIFAR10DataModule", "CIFAR10_MEAN", "CIFAR10_STD", "ImageClassifier", "ImageNetDataModule"]

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
#: The only globals the CIFAR-10 python files need: numpy's array reconstruction (``numpy.core`` in the
#: official archive, ``numpy._core`` when written by numpy 2) and ``_codecs.encode``, which Python 3 writes
#: for ``bytes`` at pickle protocol 2.
CIFAR10_PICKLE_GLOBALS = frozenset(
    {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }
)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class ImageClassifier(L.LightningModule):
    """A ResNet trained with cross-entropy and momentum SGD on a step schedule.

    Args:
        arch: ``resnet20``/``32``/``44``/``56``/``110`` (CIFAR, 6n+2 layers), ``resnet8`` (tests)
            or ``resnet50`` (ImageNet bottleneck network).
        num_classes: 10 for CIFAR-10, 1000 for ImageNet.
        shortcut: CIFAR shortcut option, ``"A"`` (identity + zero padding, the paper's) or ``"B"``.
        base_width: channels of the first CIFAR stage (paper: 16, giving 16/32/64).
        lr: learning rate for the whole batch of one optimizer step (all processes together).
        momentum: SGD momentum (DGC's momentum correction assumes the same value).
        nesterov: use Nesterov momentum.
        weight_decay: L2 penalty.
        milestones: epochs at which the learning rate is multiplied by ``gamma``.
        gamma: step-decay factor.
        warmup_epochs: epochs of linear learning-rate warm-up from ``lr / (warmup_epochs + 1)``
            (Goyal et al. 2017); 0 disables it. Useful when ``lr`` is scaled up for many processes.
    """

    def __init__(
        self,
        arch: str = "resnet20",
        num_classes: int = 10,
        shortcut: Literal["A", "B"] = "A",
        base_width: int = 16,
        lr: float = 0.1,
        momentum: float = 0.9,
        nesterov: bool = False,
        weight_decay: float = 1e-4,
        milestones: Sequence[int] = (81, 122),
        gamma: float = 0.1,
        warmup_epochs: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.network = build_resnet(arch, num_classes, shortcut, base_width)
        self.train_accuracy = MulticlassAccuracy(num_classes, average="micro")
        self.val_accuracy = MulticlassAccuracy(num_classes, average="micro")
        self.test_accuracy = MulticlassAccuracy(num_classes, average="micro")

    def forward(self, images: Tensor) -> Tensor:
        return self.network(images)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels)
        self.train_accuracy(logits, labels)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_accuracy, on_step=False, on_epoch=True)
        return loss

    def _evaluate(self, batch: tuple[Tensor, Tensor], stage: str, accuracy: MulticlassAccuracy) -> None:
        images, labels = batch
        logits = self(images)
        self.log(f"{stage}_loss", F.cross_entropy(logits, labels), sync_dist=True)
        accuracy(logits, labels)
        self.log(f"{stage}_acc", accuracy, prog_bar=True)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_accuracy)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_accuracy)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        optimizer = torch.optim.SGD(
            self.parameters(),
            lr=hp.lr,
            momentum=hp.momentum,
            nesterov=hp.nesterov,
            weight_decay=hp.weight_decay,
        )
        milestones, gamma, warmup = sorted(hp.milestones), hp.gamma, hp.warmup_epochs

        def factor(epoch: int) -> float:
            if epoch < warmup:
                return (epoch + 1) / (warmup + 1)
            return gamma ** sum(epoch >= milestone for milestone in milestones)

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


def augment_batch(images: Tensor, generator: torch.Generator) -> Tensor:
    """A batch's 4-pixel padded random crop and horizontal flip, in a few batched kernels on its device.

    ``images`` is ``(B, C, H, W)``; the offsets and flips are drawn on the CPU from ``generator`` (so a draw
    is a function of its seed only, on any device) and applied as one gather: no per-image Python work.
    """
    b, _, h, w = images.shape
    offsets = torch.randint(0, 9, (b, 2), generator=generator).to(images.device)
    flips = (torch.rand(b, generator=generator) < 0.5).to(images.device)
    padded = F.pad(images, (4, 4, 4, 4))
    rows = offsets[:, :1] + torch.arange(h, device=images.device)  # (B, H)
    cols = offsets[:, 1:] + torch.arange(w, device=images.device)  # (B, W)
    cols = torch.where(flips[:, None], cols.flip(-1), cols)
    index = torch.arange(b, device=images.device)[:, None, None]
    return padded.permute(0, 2, 3, 1)[index, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)


class CIFARImages(Dataset[tuple[Tensor, Tensor]]):
    """CIFAR images held as one uint8 tensor, normalised (and augmented for training) per item; with
    ``augment="batch"`` an item is the stored uint8 image, left to :meth:`CIFAR10DataModule.on_after_batch_transfer`."""

    def __init__(self, images: Tensor, labels: Tensor, augment: bool | Literal["batch"]) -> None:
        self.images, self.labels, self.augment = images, labels, augment
        self.mean = torch.tensor(CIFAR10_MEAN).view(3, 1, 1)
        self.std = torch.tensor(CIFAR10_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if self.augment == "batch":  # uint8 as stored: normalised and augmented per batch, after the transfer
            return self.images[index], self.labels[index]
        image = self.images[index].float().div_(255)
        if self.augment:  # torchvision's RandomCrop(32, padding=4) + RandomHorizontalFlip, in torch
            size = image.shape[-1]
            padded = F.pad(image, (4, 4, 4, 4))
            top, left = torch.randint(0, 9, (2,)).tolist()
            image = padded[:, top : top + size, left : left + size]
            if torch.rand(()) < 0.5:
                image = image.flip(-1)
        return (image - self.mean) / self.std, self.labels[index]


def _redownload_hint(path: Path) -> str:
    # the whole folder: with one batch missing, the DataModule would train on the others without a word
    return (
        f"Delete the folder {path.parent} and let the DataModule download the archive again (download=True), "
        f"or unpack a fresh copy of {CIFAR10_URL} into {path.parent.parent} by hand."
    )


class _CIFARUnpickler(pickle.Unpickler):
    """Unpickler that builds only what the CIFAR-10 files hold: dicts, lists, bytes, numbers, numpy arrays.

    ``pickle.load`` calls whatever importable function a file names, so a crafted ``data_batch_1``
    under ``--data.root`` could run any code; refusing every global but numpy's array reconstruction
    closes that door (the same idea as ``torch.load(weights_only=True)``).
    """

    def __init__(self, file: IO[bytes]) -> None:
        super().__init__(file, encoding="bytes")  # the archive was pickled by Python 2: its str are bytes
        self.refused: str | None = None  # the first global refused, for the error message

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in CIFAR10_PICKLE_GLOBALS:
            self.refused = f"{module}.{name}"
            raise pickle.UnpicklingError(f"global '{self.refused}' is forbidden")
        return super().find_class(module, name)


def load_cifar_pickle(path: str | Path) -> Any:
    """Unpickle one file of the CIFAR-10 python archive (a batch or ``batches.meta``) without running code.

    Raises:
        pickle.UnpicklingError: the file names a global the archive never needs, or is damaged or cut
            short; the message names the file and says how to get a fresh copy.
    """
    path = Path(path)
    with open(path, "rb") as f:
        unpickler = _CIFARUnpickler(f)
        try:
            return unpickler.load()
        except Exception as error:  # a damaged pickle raises almost any type (EOFError, ValueError, ...)
            if unpickler.refused is not None:
                raise pickle.UnpicklingError(
                    f"{path} is not a CIFAR-10 batch: it asks for {unpickler.refused!r}, which the official "
                    f"archive never contains. {_redownload_hint(path)}"
                ) from None
            raise pickle.UnpicklingError(
                f"{path} is not a readable CIFAR-10 batch ({type(error).__name__}: {error}): the file is "
                f"damaged or was cut short, e.g. by an interrupted download or copy. {_redownload_hint(path)}"
            ) from error


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    return f"a {type(value).__name__}"


def _batch_problem(batch: Any) -> str | None:
    """What keeps ``batch`` from being a CIFAR-10 batch, in words, or ``None`` when it is one."""
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        found = list(batch) if isinstance(batch, dict) else _describe(batch)
        return f"it should be a dict with b'data' and b'labels', found {found}"
    data, labels = batch[b"data"], np.asarray(batch[b"labels"])
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        return f"b'data' should be N x 3072 uint8 images, found {_describe(data)}"
    if labels.shape != (len(data),) or labels.dtype.kind not in "iu" or ((labels < 0) | (labels > 9)).any():
        return f"b'labels' should be {len(data)} integers in 0..9 (one per image), found {_describe(labels)}"
    return None


def load_cifar_batch(path: str | Path) -> tuple[Tensor, Tensor]:
    """Read one original CIFAR-10 pickle batch: ``b"data"`` (N x 3072 uint8, CHW) and ``b"labels"``.

    Raises:
        pickle.UnpicklingError: see :func:`load_cifar_pickle`.
        ValueError: the file unpickles but is not a batch (keys, shape, dtype or labels are wrong).
    """
    batch = load_cifar_pickle(path)
    problem = _batch_problem(batch)
    if problem is not None:
        raise ValueError(f"{path} is not a CIFAR-10 batch: {problem}. {_redownload_hint(Path(path))}")
    images = torch.as_tensor(batch[b"data"], dtype=torch.uint8).reshape(-1, 3, 32, 32)
    return images, torch.as_tensor(batch[b"labels"], dtype=torch.long)


class _ImageDataModule(L.LightningDataModule):
    """Loaders shared by the image DataModules: ``train_set`` shuffled, ``val_set`` for val and test."""

    batch_size: int
    num_workers: int
    train_set: Dataset[Any] | None = None
    val_set: Dataset[Any] | None = None

    def _loader(self, dataset: Dataset[Any] | None, shuffle: bool) -> DataLoader[Any]:
        if dataset is None:
            raise RuntimeError("Call setup() before asking for a DataLoader.")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
        )

    def train_dataloader(self) -> DataLoader[Any]:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader[Any]:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader[Any]:
        return self._loader(self.val_set, shuffle=False)


class CIFAR10DataModule(_ImageDataModule):
    """CIFAR-10 from the original python batches in ``<root>/cifar-10-batches-py/``.

    Training reads every ``data_batch_*`` file present (the official set has five), validation and
    test the ``test_batch`` (the paper reports accuracy on the 10,000 test images). When the
    folder is missing and ``download`` is set, the official archive is fetched, checked against its
    MD5 and unpacked; offline, the error says where to put the files.

    Args:
        root: folder that holds (or will hold) ``cifar-10-batches-py/``.
        batch_size: images per batch *per process* (the global batch is this times the number of
            processes).
        num_workers: DataLoader worker processes.
        download: fetch the archive when the files are missing.
        augment: random crop and flip on the training set: ``True`` per image in the loader's workers;
            ``"batch"`` on each batch after it reaches its device (one gather, no per-image Python, a fifth
            of the bytes through the loader), with draws seeded by the run's seed, the batch's position in
            the run and the rank, so that a run resumed from a checkpoint draws what it would have drawn;
            ``False`` none.
    """

    def __init__(
        self,
        root: str = "data",
        batch_size: int = 128,
        num_workers: int = 2,
        download: bool = True,
        augment: bool | Literal["batch"] = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.root = Path(root)
        self.batch_size, self.num_workers = batch_size, num_workers
        self.download, self.augment = download, augment
        self.train_set: CIFARImages | None = None
        self.val_set: CIFARImages | None = None

    @property
    def folder(self) -> Path:
        return self.root / CIFAR10_FOLDER

    def _present(self) -> bool:
        return (self.folder / "test_batch").is_file() and any(self.folder.glob("data_batch_*"))

    def prepare_data(self) -> None:
        """Download and unpack the archive if the batches are missing (runs on one process per node)."""
        if self._present():
            return
        hint = (
            f"Download {CIFAR10_URL} by hand and unpack it so that {self.folder}/data_batch_1 .. data_batch_5 "
            f"and {self.folder}/test_batch exist, or point --data.root at the folder holding {CIFAR10_FOLDER}/."
        )
        if not self.download:
            raise DatasetNotFoundError(f"CIFAR-10 not found in {self.folder} and download=False. {hint}")
        archive = download_file(CIFAR10_URL, self.root / "cifar-10-python.tar.gz", CIFAR10_MD5, hint)
        extract_tar(archive, self.root)

    def setup(self, stage: str | None = None) -> None:
        if not self._present():
            self.prepare_data()  # a DataModule used without a Trainer still finds (or fetches) its data
        if stage in (None, "fit") and self.train_set is None:
            parts = [load_cifar_batch(path) for path in sorted(self.folder.glob("data_batch_*"))]
            images, labels = (torch.cat(tensors) for tensors in zip(*parts, strict=True))
            self.train_set = CIFARImages(images, labels, self.augment)
        if self.val_set is None:
            self.val_set = CIFARImages(*load_cifar_batch(self.folder / "test_batch"), augment=False)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """With ``augment="batch"``: normalise (and, in training, augment) a uint8 training batch on its device."""
        images, labels = batch
        if self.augment != "batch" or images.dtype != torch.uint8:
            return batch
        images = images.float().div_(255)
        trainer = self.trainer
        if trainer is not None and trainer.training:
            # a function of (seed, batch index in the run, rank): a resumed run's batches draw as before
            position = trainer.fit_loop.epoch_loop.batch_progress.total.ready
            seed = (int(os.environ.get("PL_GLOBAL_SEED", 0)) * 1_000_003 + position) * 4099 + trainer.global_rank
            images = augment_batch(images, torch.Generator().manual_seed(seed % 2**63))
        mean = torch.tensor(CIFAR10_MEAN, device=images.device).view(1, 3, 1, 1)
        std = torch.tensor(CIFAR10_STD, device=images.device).view(1, 3, 1, 1)
        return (images - mean) / std, labels


class ImageNetDataModule(_ImageDataModule):
    """ImageNet (ILSVRC-2012) from ``<root>/train/<class>/*.JPEG`` and ``<root>/val/<class>/*.JPEG``.

    Uses torchvision's ``ImageFolder`` and the standard augmentation (random-resized crop + flip for
    training; resize to 256/224 of the crop size and centre crop for validation). ImageNet cannot
    be downloaded automatically (its licence requires registration at image-net.org).

    Args:
        root: folder holding ``train/`` and ``val/``.
        batch_size: images per batch per process.
        num_workers: DataLoader worker processes (JPEG decoding is the usual bottleneck).
        image_size: training crop size.
    """

    def __init__(
        self, root: str = "data/imagenet", batch_size: int = 32, num_workers: int = 8, image_size: int = 224
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.root = Path(root)
        self.batch_size, self.num_workers, self.image_size = batch_size, num_workers, image_size
        self.train_set: Dataset[Any] | None = None
        self.val_set: Dataset[Any] | None = None

    def setup(self, stage: str | None = None) -> None:
        try:
            from torchvision import datasets, transforms
        except ImportError as error:
            raise ImportError(
                "ImageNetDataModule needs torchvision: pip install 'lightning-dgc[vision]'."
            ) from error
        for split in ("train", "val"):
            if not (self.root / split).is_dir():
                raise DatasetNotFoundError(
                    f"ImageNet not found: {self.root / split} is missing. Download ILSVRC-2012 from "
                    "https://image-net.org (registration required) and arrange it as "
                    f"{self.root}/train/<wnid>/*.JPEG and {self.root}/val/<wnid>/*.JPEG, "
                    "or point --data.root at such a folder."
                )
        normalize = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)
        train = transforms.Compose(
            [
                transforms.RandomResizedCrop(self.image_size),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                normalize,
            ]
        )
        val = transforms.Compose(
            [
                transforms.Resize(round(self.image_size * 256 / 224)),
                transforms.CenterCrop(self.image_size),
                transforms.ToTensor(),
                normalize,
            ]
        )
        if stage in (None, "fit"):
            self.train_set = datasets.ImageFolder(str(self.root / "train"), transform=train)
        self.val_set = datasets.ImageFolder(str(self.root / "val"), transform=val)
