"""Residual networks of He et al. (2016), written out so the vision recipe needs no torchvision model.

* :class:`CIFARResNet`: the 6n+2-layer networks of the CIFAR-10 experiments (section 4.2 of the
  paper): a 3x3 stem, three stages of n basic blocks with 16, 32 and 64 channels, global average
  pooling. ResNet-20/32/44/56/110 are n = 3/5/7/9/18. Shortcuts are option A (identity, with
  stride-2 subsampling and zero-padded extra channels: no parameters, as in the paper) or option B
  (1x1 convolution + batch norm where the shape changes).
* :class:`ResNet50`: the bottleneck ImageNet network (3, 4, 6, 3 blocks), with the stride on the
  3x3 convolution ("ResNet v1.5", as in torchvision and most published training runs).

DGC compresses every gradient with more than one dimension, so these plain ``nn.Conv2d`` /
``nn.Linear`` layers are exactly what the strategy sees; batch-norm parameters stay dense.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ARCHITECTURES", "BasicBlock", "Bottleneck", "CIFARResNet", "ResNet50", "build_resnet"]

Shortcut = Literal["A", "B"]


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (CIFAR ResNets)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, shortcut: Shortcut) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.stride = stride
        self.extra_channels = out_channels - in_channels
        self.shortcut_option = shortcut
        self.projection: nn.Module | None = None
        if shortcut == "B" and (stride != 1 or in_channels != out_channels):
            self.projection = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def _shortcut(self, x: Tensor) -> Tensor:
        if self.projection is not None:
            return self.projection(x)
        if self.stride != 1:
            x = x[:, :, :: self.stride, :: self.stride]
        if self.extra_channels > 0:  # option A: pad the new channels with zeros, half on each side
            half = self.extra_channels // 2
            x = F.pad(x, (0, 0, 0, 0, half, self.extra_channels - half))
        return x

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self._shortcut(x))


class CIFARResNet(nn.Module):
    """The 6n+2-layer CIFAR ResNet (He et al. 2016, section 4.2).

    Args:
        depth: number of weighted layers, 6n+2 (20, 32, 44, 56, 110, ...; 8 for tests).
        num_classes: output classes.
        shortcut: ``"A"`` (parameter-free, the paper's choice for CIFAR) or ``"B"`` (projection).
        base_width: channels of the first stage; the stages have 1x, 2x and 4x this (paper: 16).
    """

    def __init__(
        self, depth: int = 20, num_classes: int = 10, shortcut: Shortcut = "A", base_width: int = 16
    ) -> None:
        super().__init__()
        if depth < 8 or (depth - 2) % 6:
            raise ValueError(f"A CIFAR ResNet has 6n+2 layers (20, 32, 44, 56, 110, ...), got depth={depth}.")
        if shortcut not in ("A", "B"):
            raise ValueError(f"shortcut must be 'A' or 'B', got {shortcut!r}.")
        blocks_per_stage = (depth - 2) // 6
        widths = (base_width, 2 * base_width, 4 * base_width)
        self.conv1 = nn.Conv2d(3, base_width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(base_width)
        stages: list[nn.Module] = []
        in_channels = base_width
        for stage, width in enumerate(widths):
            blocks = []
            for index in range(blocks_per_stage):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(BasicBlock(in_channels, width, stride, shortcut))
                in_channels = width
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(in_channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.stages(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand by 4, with a projection shortcut where shapes change."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + identity)


class ResNet50(nn.Module):
    """ResNet-50 for ImageNet (25.6 M parameters with 1000 classes).

    Args:
        num_classes: output classes.
        zero_init_residual: start each block's last batch-norm scale at zero, so every residual
            block begins as the identity (Goyal et al. 2017); helps large-batch training.
    """

    def __init__(self, num_classes: int = 1000, zero_init_residual: bool = False) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages: list[nn.Module] = []
        in_channels = 64
        for stage, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True)):
            layers = []
            for index in range(blocks):
                layers.append(Bottleneck(in_channels, width, 2 if stage > 0 and index == 0 else 1))
                in_channels = width * Bottleneck.expansion
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(in_channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, Bottleneck) and zero_init_residual:
                nn.init.zeros_(module.bn3.weight)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.stages(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _cifar(depth: int) -> Callable[..., nn.Module]:
    def build(num_classes: int, shortcut: Shortcut, base_width: int) -> nn.Module:
        return CIFARResNet(depth, num_classes, shortcut, base_width)

    return build


#: Architecture names accepted by :class:`lightning_dgc_recipes.vision.ImageClassifier`. ``resnet8`` is the
#: smallest member of the CIFAR family, for tests and smoke runs.
ARCHITECTURES: dict[str, Callable[..., nn.Module]] = {
    **{f"resnet{depth}": _cifar(depth) for depth in (8, 20, 32, 44, 56, 110)},
    "resnet50": lambda num_classes, shortcut, base_width: ResNet50(num_classes),
}


def build_resnet(arch: str, num_classes: int, shortcut: Shortcut = "A", base_width: int = 16) -> nn.Module:
    """Build the network named ``arch`` (a key of :data:`ARCHITECTURES`).

    ``shortcut`` and ``base_width`` apply to the CIFAR family only; ``resnet50`` is the ImageNet
    bottleneck network (the CIFAR 6n+2 family has no 50-layer member in the paper).
    """
    try:
        builder = ARCHITECTURES[arch]
    except KeyError:
        raise ValueError(f"Unknown architecture {arch!r}; choose one of {sorted(ARCHITECTURES)}.") from None
    return builder(num_classes=num_classes, shortcut=shortcut, base_width=base_width)
