"""Several backward passes per optimizer step, under DDP and under DGC at density 1, in one interpreter per
rank (``tests/lightning/run.py`` starts both ranks): Lightning's manual optimization (two passes per step,
the accumulation recipe, two optimizers GAN-style), a parameter left unused in some steps, and Fabric.
Writes every run's final parameters, ``<out>.<pattern>.<strategy>.rank<r>.pt``, for the test to compare.

    python tests/lightning/accumulate_script.py --out prefix [--patterns twice,gan,...]
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dgc
from lightning_dgc.algorithms.dgc import DGCConfig

DGC_AS_DDP = {"density": 1.0, "selection": "exact", "momentum_masking": False}
STEPS = int(__import__("os").environ.get("ACC_STEPS", "6"))


def dataset(n: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    return TensorDataset(x, torch.tanh(x @ (torch.randn(32, 4, generator=g) / 4)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.head = nn.Linear(64, 4)
        self.other = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))  # 'unused' uses it every other step

    def forward(self, x: torch.Tensor, skip_other: bool = False) -> torch.Tensor:
        h = self.body(x)
        return self.head(h) + (0 if skip_other else self.other(h))


class Manual(L.LightningModule):
    """Manual optimization in the patterns Lightning's docs show."""

    def __init__(self, pattern: str, nesterov: bool = False, weight_decay: float = 0.0) -> None:
        super().__init__()
        self.net, self.pattern = Net(), pattern
        self.nesterov, self.weight_decay = nesterov, weight_decay
        self.automatic_optimization = pattern == "unused"

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        skip_other = self.pattern == "unused" and self.global_step % 2 == 1
        return nn.functional.mse_loss(self.net(x, skip_other), y)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.pattern == "unused":
            return self._loss(x, y)
        if self.pattern == "gan":  # the second optimizer's parameters keep the first pass's gradients
            first, second = self.optimizers()
            self.manual_backward(nn.functional.mse_loss(self.net.body(x).mean(1, keepdim=True), y[:, :1]))
            first.step()
            first.zero_grad()
            self.manual_backward(self._loss(x, y))
            second.step()
            second.zero_grad()
            return None
        opt = self.optimizers()
        if self.pattern == "dropped":  # a synchronised pass whose gradients are thrown away, then one stepped
            self.manual_backward(self._loss(x, y))
            opt.zero_grad()
            self.manual_backward(self._loss(x, y))
            opt.step()
            opt.zero_grad()
        elif self.pattern == "twice":  # two backward passes, one step
            half = x.shape[0] // 2
            self.manual_backward(self._loss(x[:half], y[:half]))
            self.manual_backward(self._loss(x[half:], y[half:]))
            opt.step()
            opt.zero_grad()
        else:  # Lightning's manual accumulation recipe: backward every batch, step every 2
            self.manual_backward(self._loss(x, y) / 2)
            if (batch_idx + 1) % 2 == 0:
                opt.step()
                opt.zero_grad()
        return None

    def configure_optimizers(self):
        def sgd(params):
            return torch.optim.SGD(
                params, lr=0.05, momentum=0.9, nesterov=self.nesterov, weight_decay=self.weight_decay
            )

        if self.pattern == "gan":
            return sgd(self.net.body.parameters()), sgd([*self.net.head.parameters(), *self.net.other.parameters()])
        return sgd(self.parameters())


def fit(pattern: str, strategy_name: str, nesterov: bool, weight_decay: float) -> torch.Tensor:
    unused = pattern in ("unused", "gan")  # DDP must look for parameters a pass leaves unused
    if strategy_name == "ddp":
        strategy = DDPStrategy(find_unused_parameters=unused)
    else:
        strategy = lightning_dgc.DGCStrategy(**DGC_AS_DDP, find_unused_parameters=unused)
    model = Manual(pattern, nesterov, weight_decay)
    batches = STEPS * (2 if pattern == "accumulate" else 1)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, limit_train_batches=batches,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model, DataLoader(dataset(), batch_size=16, shuffle=False))
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def fabric_fit(strategy_name: str) -> torch.Tensor:
    """Two ``fabric.backward`` calls before one ``optimizer.step()``."""
    strategy = (
        "ddp" if strategy_name == "ddp" else lightning_dgc.FabricCompressionStrategy(DGCConfig(**DGC_AS_DDP))
    )
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    net = Net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    x, y = dataset().tensors
    rank = fabric.global_rank
    for step in range(STEPS):
        batch = slice((2 * step + rank) * 16, (2 * step + rank + 1) * 16)
        for part in (slice(0, 8), slice(8, 16)):
            loss = nn.functional.mse_loss(model(x[batch][part]), y[batch][part])
            fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--patterns", default="twice,twice_nesterov,accumulate,gan,unused,fabric")
    args = parser.parse_args()
    for pattern in args.patterns.split(","):
        for strategy in ("ddp", "dgc") if pattern != "dropped" else ("dgc",):
            if pattern == "fabric":
                params = fabric_fit(strategy)
            elif pattern == "twice_nesterov":
                params = fit("twice", strategy, nesterov=True, weight_decay=1e-3)
            else:
                params = fit(pattern, strategy, nesterov=False, weight_decay=0.0)
            rank = torch.distributed.get_rank()
            torch.save(params, f"{args.out}.{pattern}.{strategy}.rank{rank}.pt")


if __name__ == "__main__":
    main()
