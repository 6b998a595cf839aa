"""A real ``Trainer.fit`` with 2 CPU processes, run as a script: once per rank (``tests/lightning/run.py``)
or by Lightning's popen launcher (the one ``strategy="dgc"`` uses), which re-executes it for rank 1.
Writes a JSON summary for the test.

    python tests/lightning/fit_script.py --strategy dgc --out result.json [options]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from datetime import timedelta

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dgc


class Regression(L.LightningModule):
    """A small MLP on a learnable synthetic task: big enough that its weights are compressed."""

    def __init__(
        self,
        optimizer: str = "sgd",
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        inf_at: tuple[int, int] | None = None,
        manual: bool = False,
        inf_from: tuple[int, int] | None = None,
        reuse_optimizer: bool = False,
    ):
        super().__init__()
        self.save_hyperparameters()
        self._optimizer: torch.optim.Optimizer | None = None
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
        self.automatic_optimization = not manual

    def _loss(self, batch):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.hparams.inf_at == (self.global_rank, self.global_step):
            loss = loss * float("inf")  # a forced overflow on one rank
        inf_from = self.hparams.inf_from
        if inf_from is not None and self.global_rank == inf_from[0] and self.global_step >= inf_from[1]:
            loss = loss * float("inf")  # an overflow in every step from then on: a stalled run
        return loss

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        self.log("train_loss", loss, sync_dist=False)
        return loss

    def configure_optimizers(self):
        if self._optimizer is None or not self.hparams.reuse_optimizer:
            self._optimizer = self._make_optimizer()
        return self._optimizer

    def _make_optimizer(self):
        h = self.hparams
        if h.optimizer == "sgd":
            return torch.optim.SGD(
                self.parameters(), lr=h.lr, momentum=h.momentum, weight_decay=h.weight_decay
            )
        if h.optimizer == "rmsprop":
            return torch.optim.RMSprop(self.parameters(), lr=h.lr, momentum=h.momentum)
        return torch.optim.Adam(self.parameters(), lr=h.lr)


def dataset(n: int = 512) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    w = torch.randn(32, 4, generator=g) / 4
    return TensorDataset(x, torch.tanh(x @ w))


class HookProbe(L.Callback):
    """Asserts during the run that the compression hook is registered and called; records per-batch facts."""

    def __init__(self) -> None:
        self.stats: list[dict] = []
        self.losses: list[float] = []
        self.records: list[dict] = []
        self._before: torch.Tensor | None = None
        self._grad_storages: int | None = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        # one storage for all: the gradients are views into DDP's (single) bucket (gradient_as_bucket_view)
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self._grad_storages = len({g.untyped_storage().data_ptr() for g in grads})

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = torch.cat([p.detach().float().reshape(-1) for p in pl_module.parameters()])
        if isinstance(trainer.strategy, lightning_dgc.CompressionStrategy):
            trainer.strategy.request_buildup()  # the build-up factor is measured only on request

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        strategy = trainer.strategy
        self.losses.append(float(outputs["loss"]))
        after = torch.cat([p.detach().float().reshape(-1) for p in pl_module.parameters()])
        record = {
            "global_step": trainer.global_step,
            "sgd_momentum": [g.get("momentum") for g in trainer.optimizers[0].param_groups],
            "update_norm": float(torch.linalg.vector_norm(after - self._before)),
            "params_finite": bool(torch.isfinite(after).all()),
            "grad_storages": self._grad_storages,
        }
        self._grad_storages = None
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            record["scale"] = float(scaler.get_scale())
        if isinstance(strategy, lightning_dgc.CompressionStrategy):
            if trainer.global_step > 0:  # after the first optimizer step (accumulation delays it)
                assert strategy.hook_calls > 0, "the DGC communication hook was not called"
            self.stats.append(dict(strategy.compression_stats()))
            committed = strategy.exchange_state.memory.committed
            record["hook_calls"] = strategy.hook_calls
            for kind in ("velocity", "momentum"):
                record[f"{kind}_sum"] = sum(
                    float(t.double().abs().sum()) for t in committed.get(kind, {}).values()
                )
        self.records.append(record)


class MemoryDump(L.Callback):
    """Saves this rank's committed DGC memory when training starts (after a resume) and ends."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def _dump(self, trainer, tag: str) -> None:
        state = trainer.strategy.exchange_state
        torch.save(state.memory.state_dict(), f"{self.prefix}.rank{trainer.global_rank}.{tag}.pt")

    def on_train_start(self, trainer, pl_module):
        self._dump(trainer, "start")

    def on_train_end(self, trainer, pl_module):
        self._dump(trainer, "end")


class SignalRank(L.Callback):
    """Sends one rank a signal mid-epoch: SIGKILL as a crashed node, SIGSTOP as a hung one."""

    def __init__(self, rank: int, step: int, signum: int = signal.SIGKILL) -> None:
        self.rank, self.step, self.signum = rank, step, signum

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


class StepLog(L.Callback):
    """Prints ``rank R step N`` after every optimizer step, so a test can see how far a rank got."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        print(f"rank {trainer.global_rank} step {trainer.global_step}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="dgc")
    p.add_argument("--density", type=lambda v: v if v == "auto" else float(v), default=None, help="a number or 'auto'")
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt-every", type=int, default=0, help="ModelCheckpoint every n steps (0: off)")
    p.add_argument("--resume", default=None, help="checkpoint path (or 'last') to resume from")
    p.add_argument("--save-ckpt", default=None, help="trainer.save_checkpoint here after fit")
    p.add_argument("--dump-memory", action="store_true")
    p.add_argument("--kill", default=None, help="RANK:STEP to SIGKILL")
    p.add_argument("--stop", default=None, help="RANK:STEP to SIGSTOP (a hung peer)")
    p.add_argument("--timeout", type=float, default=None, help="the process group's timeout, in seconds")
    p.add_argument("--log-steps", action="store_true", help="print every rank's optimizer steps")
    p.add_argument("--inf-at", default=None, help="RANK:STEP whose loss is multiplied by inf")
    p.add_argument("--inf-from", default=None, help="RANK:STEP from which on the loss is multiplied by inf")
    p.add_argument("--max-skips", type=int, default=None, help="the strategy's max_consecutive_skips")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--fp16-scaler", action="store_true", help="16-mixed with a GradScaler on CPU")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--clip-val", type=float, default=None)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--manual", action="store_true")
    p.add_argument("--mismatch", action="store_true", help="rank 1 builds the strategy with another density")
    p.add_argument("--local-clip", type=float, default=None)
    p.add_argument("--no-masking", action="store_true", help="DGCStrategy(momentum_masking=False)")
    p.add_argument("--selection", default="sampled")
    p.add_argument("--samples", type=int, default=512, help="dataset size (16 per batch, per rank)")
    p.add_argument("--no-shuffle", action="store_true", help="every epoch sees the batches in the same order")
    p.add_argument("--fit-twice", type=int, default=0, help="fit to this many steps, then on to --max-steps")
    p.add_argument("--options", default=None, help="JSON: CompressionStrategy(--strategy, options)")
    p.add_argument("--grad-copy", action="store_true", help="DGCStrategy(gradient_as_bucket_view=False)")
    p.add_argument("--no-exchange-state", action="store_true", help="CompressionStrategy(save_exchange_state=False)")
    p.add_argument("--top-k", type=int, default=-1, help="ModelCheckpoint's save_top_k")
    args = p.parse_args()

    L.seed_everything(0)
    strategy: object = args.strategy
    if args.mismatch:  # LOCAL_RANK: set for rank 1 by Lightning's launcher or the test
        args.density = 0.001 if os.environ.get("LOCAL_RANK", "0") == "0" else 0.002
    if args.density is not None or args.local_clip is not None or args.no_masking or args.grad_copy:
        strategy = lightning_dgc.DGCStrategy(
            density=args.density if args.density is not None else 0.001, local_clip_norm=args.local_clip,
            momentum_masking=not args.no_masking, selection=args.selection,
            **({"gradient_as_bucket_view": False} if args.grad_copy else {}),
        )  # fmt: skip
    if args.options is not None:
        strategy = lightning_dgc.CompressionStrategy(args.strategy, json.loads(args.options))
    if args.max_skips is not None:
        assert isinstance(strategy, str), "--max-skips takes --strategy NAME only"
        strategy = lightning_dgc.CompressionStrategy(strategy, max_consecutive_skips=args.max_skips)
    if args.no_exchange_state:
        assert isinstance(strategy, str), "--no-exchange-state takes --strategy NAME only"
        strategy = lightning_dgc.CompressionStrategy(strategy, save_exchange_state=False)
    if args.timeout is not None:
        kinds = {"dgc": lightning_dgc.DGCStrategy, "deft": lightning_dgc.DEFTStrategy, "ddp": DDPStrategy}
        strategy = kinds[args.strategy](timeout=timedelta(seconds=args.timeout))
    probe = HookProbe()
    callbacks: list[L.Callback] = [probe]
    if args.ckpt_every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=f"{args.out}.ckpts",
                every_n_train_steps=args.ckpt_every,
                save_last=True,
                save_top_k=args.top_k,
            )
        )
    if args.dump_memory:
        callbacks.append(MemoryDump(args.out))
    if args.kill:
        kill_rank, kill_step = map(int, args.kill.split(":"))
        callbacks.append(SignalRank(kill_rank, kill_step))
    if args.stop:
        stop_rank, stop_step = map(int, args.stop.split(":"))
        callbacks.append(SignalRank(stop_rank, stop_step, signal.SIGSTOP))
    if args.log_steps:
        callbacks.append(StepLog())
    plugins = []
    if (
        args.fp16_scaler
    ):  # Lightning maps '16-mixed' to bf16 on CPU; CPU autocast and GradScaler do support fp16
        plugins.append(
            MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
        )
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=args.devices, max_steps=args.max_steps, logger=False,
        precision=None if plugins else args.precision, plugins=plugins or None,
        accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip_val,
        enable_checkpointing=bool(args.ckpt_every), enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks,
    )  # fmt: skip
    inf_at = tuple(map(int, args.inf_at.split(":"))) if args.inf_at else None
    model = Regression(
        optimizer=args.optimizer, momentum=args.momentum, lr=args.lr, inf_at=inf_at, manual=args.manual,
        inf_from=tuple(map(int, args.inf_from.split(":"))) if args.inf_from else None,
        reuse_optimizer=bool(args.fit_twice),
    )  # fmt: skip
    data = DataLoader(dataset(args.samples), batch_size=16, shuffle=not args.no_shuffle)
    if args.fit_twice:  # the same Trainer and optimizer object, fit again further
        trainer.fit_loop.epoch_loop.max_steps = args.fit_twice
        trainer.fit(model, data, ckpt_path=args.resume)
        trainer.fit_loop.epoch_loop.max_steps = args.max_steps
    trainer.fit(model, data, ckpt_path=args.resume)
    if args.save_ckpt:
        trainer.save_checkpoint(args.save_ckpt)
    rank = trainer.global_rank
    params = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    torch.save(params, f"{args.out}.rank{rank}.params.pt")
    summary = {
        "rank": rank,
        "strategy": type(trainer.strategy).__name__,
        "hook_calls": getattr(trainer.strategy, "hook_calls", 0),
        "stats": probe.stats,
        "losses": probe.losses,
        "records": probe.records,
        "param_dtype": str(next(model.parameters()).dtype),
        "optimizer_momentum": [g["momentum"] for g in trainer.optimizers[0].param_groups if "momentum" in g],
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "pid": os.getpid(),
    }
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump(summary, f)


if __name__ == "__main__":
    main()
