"""Parameter shapes of the DGC paper's models, taken from the recipes' real modules.

    python -m benchmarks.shapes

prints, for every model, the number of parameters, how many tensors the hook would compress (more
than one dimension and at least ``min_compress_numel`` values) and how many it sends dense.

The models are built on the ``meta`` device: shapes and names are exact, no memory is allocated and
no initialisation runs, so even the 66 M-parameter LSTM costs a few milliseconds.

* ``resnet110``: :class:`lightning_dgc_recipes.resnet.CIFARResNet` of depth 110, option-A shortcuts, 10 classes (1.7 M).
* ``resnet50``: :class:`lightning_dgc_recipes.resnet.ResNet50` with 1000 classes (25.6 M).
* ``lstm``: :class:`lightning_dgc_recipes.language.WordLanguageModel` as in the paper's PTB experiment: 2 layers of
  1500 units, a 10 000-word vocabulary, embedding and decoder *not* tied (66 M; the recipe's default
  ties them, which leaves 51 M).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

#: Names of the models, in the order the benchmarks report them.
MODELS = ("resnet110", "resnet50", "lstm")
#: PTB's vocabulary size (the Mikolov preprocessing).
PTB_VOCAB = 10_000


@dataclass(frozen=True)
class ParamShape:
    """One parameter: its name (as ``named_parameters`` gives it) and shape."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _resnet110() -> nn.Module:
    from lightning_dgc_recipes.resnet import CIFARResNet

    return CIFARResNet(depth=110, num_classes=10, shortcut="A")


def _resnet50() -> nn.Module:
    from lightning_dgc_recipes.resnet import ResNet50

    return ResNet50(num_classes=1000)


def _lstm() -> nn.Module:
    from lightning_dgc_recipes.language import WordLanguageModel

    return WordLanguageModel(vocab_size=PTB_VOCAB, embedding_dim=1500, hidden_size=1500, num_layers=2,
                             tie_weights=False)  # fmt: skip


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "resnet110": _resnet110,
    "resnet50": _resnet50,
    "lstm": _lstm,
}


def build_model(model: str, device: str | torch.device = "meta") -> nn.Module:
    """The model named ``model`` (a key of :data:`BUILDERS`), created on ``device``."""
    try:
        builder = BUILDERS[model]
    except KeyError:
        raise ValueError(f"unknown model {model!r}; choose one of {list(BUILDERS)}") from None
    with torch.device(device):
        return builder()


def param_shapes(model: str) -> list[ParamShape]:
    """Every trainable parameter of ``model``, in ``named_parameters`` order (shared ones once)."""
    module = build_model(model, "meta")
    return [ParamShape(name, tuple(p.shape)) for name, p in module.named_parameters() if p.requires_grad]


def is_compressed(shape: ParamShape, min_compress_numel: int = 1024) -> bool:
    """Whether the hook compresses this tensor (see ``lightning_dgc.exchange.hook.tensor_kind``): more than one
    dimension and at least ``min_compress_numel`` values. (At the densities benchmarked here, 0.01 and
    0.001, the hook's third kind, ``full``, never occurs.)"""
    return shape.ndim > 1 and shape.numel >= min_compress_numel


def compressed_shapes(model: str, min_compress_numel: int = 1024) -> list[ParamShape]:
    """The tensors whose velocity the hook runs top-k selection on."""
    return [s for s in param_shapes(model) if is_compressed(s, min_compress_numel)]


def main(argv: list[str] | None = None) -> dict[str, dict[str, int]]:
    from rich.console import Console
    from rich.table import Table

    del argv
    table = Table(title="Parameter shapes (from the recipes' modules, built on the meta device)")
    for column in ("model", "parameters", "tensors", "compressed tensors", "compressed values",
                   "dense tensors", "dense values", "largest tensor"):  # fmt: skip
        table.add_column(column, justify="right" if column != "model" else "left")
    summary = {}
    for model in MODELS:
        shapes = param_shapes(model)
        compressed = [s for s in shapes if is_compressed(s)]
        dense = [s for s in shapes if not is_compressed(s)]
        largest = max(shapes, key=lambda s: s.numel)
        row = {
            "parameters": sum(s.numel for s in shapes),
            "tensors": len(shapes),
            "compressed_tensors": len(compressed),
            "compressed_values": sum(s.numel for s in compressed),
            "dense_tensors": len(dense),
            "dense_values": sum(s.numel for s in dense),
        }
        summary[model] = row
        table.add_row(model, *(f"{v:,}" for v in row.values()), f"{largest.name} {list(largest.shape)}")
    Console(width=max(Console().width, 150)).print(table)
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
