"""The transformer language model: shapes, causality, AdamW's groups and its warm-up + cosine schedule, a real fit."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_dgc_recipes.language import PTBDataModule
from lightning_dgc_recipes.transformer import TransformerLanguageModel, WarmupCosine
from tests.recipes.fake_datasets import TINY_OVERRIDES

REPO_ROOT = Path(__file__).resolve().parents[2]


def tiny_model(**overrides: Any) -> TransformerLanguageModel:
    args = {"vocab_size": 50, "d_model": 16, "num_layers": 2, "num_heads": 2, "dropout": 0.0, "max_seq_len": 12}
    return TransformerLanguageModel(**{**args, **overrides})


def test_logits_shape_and_tied_output() -> None:
    torch.manual_seed(0)
    model = tiny_model()
    logits = model(torch.randint(0, 50, (3, 10)))
    assert logits.shape == (3, 10, 50)
    # the output layer is the token embedding: a gradient through the logits alone reaches it
    logits.sum().backward()
    assert model.embedding.weight.grad is not None
    assert not any(name.startswith("decoder") for name, _ in model.named_parameters())


def test_a_later_token_does_not_change_earlier_logits() -> None:
    torch.manual_seed(0)
    model = tiny_model().eval()
    tokens = torch.randint(0, 50, (2, 10))
    changed = tokens.clone()
    changed[:, 6] = (tokens[:, 6] + 1) % 50
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :6], after[:, :6])
    assert not torch.allclose(before[:, 6:], after[:, 6:])  # from position 6 on, the new token is seen


def test_windows_longer_than_the_positions_are_refused(ptb_root: Path) -> None:
    with pytest.raises(ValueError, match="max_seq_len=12"):
        tiny_model()(torch.zeros(1, 13, dtype=torch.long))
    model = tiny_model(vocab_size=None)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match=r"data.bptt=20 is longer than model.max_seq_len=12"):
        trainer.fit(model, datamodule=PTBDataModule(str(ptb_root), batch_size=4, bptt=20, download=False))


def test_num_heads_must_divide_the_width() -> None:
    with pytest.raises(ValueError, match=r"num_heads \(3\) must divide d_model \(16\)"):
        tiny_model(num_heads=3)


def test_weight_decay_only_on_the_blocks_weight_matrices() -> None:
    model = tiny_model(weight_decay=0.1)
    decay, rest = model.parameter_groups()
    assert decay["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0
    names = {id(p): name for name, p in model.named_parameters()}
    decayed = sorted(names[id(p)] for p in decay["params"])
    assert decayed == sorted(
        f"blocks.{i}.{layer}.weight" for i in range(2) for layer in ("qkv", "out", "mlp.0", "mlp.2")
    )
    assert {id(p) for p in rest["params"]} | {id(p) for p in decay["params"]} == set(names)
    assert any(p is model.embedding.weight for p in rest["params"])


def test_warmup_cosine_values() -> None:
    schedule = WarmupCosine(warmup_steps=4, total_steps=14, min_ratio=0.1)
    assert [schedule(step) for step in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert schedule(4) == 1.0  # the cosine starts at the peak ...
    assert schedule(9) == pytest.approx(0.1 + 0.9 * 0.5)  # ... is half-way at the middle ...
    assert schedule(6) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.2)))
    assert schedule(14) == pytest.approx(0.1) and schedule(20) == pytest.approx(0.1)  # ... and ends at the floor
    assert WarmupCosine(warmup_steps=0, total_steps=10, min_ratio=0.0)(0) == 1.0


class LearningRates(Callback):
    """The learning rate each optimizer step used."""

    def __init__(self) -> None:
        self.rates: list[float] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        self.rates.append(optimizer.param_groups[0]["lr"])


@pytest.mark.parametrize(
    ("options", "warmup"), [({"warmup_steps": 3}, 3), ({"warmup_fraction": 0.25}, 4)], ids=["steps", "fraction"]
)
def test_fit_follows_the_schedule_over_the_runs_steps(
    ptb_root: Path, options: dict[str, Any], warmup: int
) -> None:
    """The schedule's length is the Trainer's (16 steps here), and it is stepped once per optimizer step."""
    torch.manual_seed(0)
    model = tiny_model(vocab_size=None, lr=1e-2, min_lr_ratio=0.1, **options)
    rates = LearningRates()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=16, limit_val_batches=1, logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False, callbacks=[rates],
    )  # fmt: skip
    trainer.fit(model, datamodule=PTBDataModule(str(ptb_root), batch_size=4, bptt=8, download=False))
    expected = WarmupCosine(warmup_steps=warmup, total_steps=16, min_ratio=0.1)
    assert rates.rates == pytest.approx([1e-2 * expected(step) for step in range(16)])
    assert rates.rates[warmup - 1] == pytest.approx(1e-2) and rates.rates[-1] < 0.12e-2


def test_loss_falls(ptb_root: Path) -> None:
    torch.manual_seed(0)
    model = tiny_model(vocab_size=None, d_model=32, lr=1e-2, warmup_steps=4)
    losses: list[float] = []

    class Losses(Callback):
        def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *_: Any) -> None:
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=40, val_check_interval=20, check_val_every_n_epoch=None,
        limit_val_batches=2, logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False, callbacks=[Losses()],
    )  # fmt: skip
    trainer.fit(model, datamodule=PTBDataModule(str(ptb_root), batch_size=4, bptt=8, download=False))
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert len(losses) == 40 and last < 0.6 * first, losses
    assert {"train_loss", "val_loss", "val_ppl"} <= set(trainer.callback_metrics)
    assert torch.isfinite(trainer.callback_metrics["val_ppl"])


def test_checkpoint_rebuilds_the_vocabulary_layers(ptb_root: Path, tmp_path: Path) -> None:
    model = tiny_model(vocab_size=None)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=3, limit_val_batches=1, logger=False, enable_progress_bar=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(model, datamodule=PTBDataModule(str(ptb_root), batch_size=4, bptt=8, download=False))
    trainer.save_checkpoint(tmp_path / "lm.ckpt")
    restored = TransformerLanguageModel.load_from_checkpoint(tmp_path / "lm.ckpt")
    assert torch.equal(restored.embedding.weight, model.embedding.weight)
    rates = LearningRates()
    resumed = L.Trainer(
        accelerator="cpu", devices=1, max_steps=5, limit_val_batches=1, logger=False, enable_progress_bar=False,
        default_root_dir=tmp_path, callbacks=[rates],
    )  # fmt: skip
    resumed.fit(
        tiny_model(vocab_size=None),
        datamodule=PTBDataModule(str(ptb_root), batch_size=4, bptt=8, download=False),
        ckpt_path=tmp_path / "lm.ckpt",
    )
    assert resumed.global_step == 5 and len(rates.rates) == 2
    # the schedule resumes where it stopped (step 3 of the first run's 3-step schedule: its floor)
    assert rates.rates == pytest.approx([model.hparams.lr * model.hparams.min_lr_ratio] * 2)


def test_bf16_autocast_gives_the_fp32_loss_closely() -> None:
    """Under bf16 autocast (trainer.precision bf16-mixed) the logits come back in fp32 for the loss."""
    torch.manual_seed(0)
    model = tiny_model().eval()
    batch = (torch.randint(0, 50, (2, 10)), torch.randint(0, 50, (2, 10)))
    _, loss32 = model._step(batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss16 = model._step(batch)
    assert logits.dtype == torch.float32 and loss16.dtype == torch.float32
    assert loss16.item() == pytest.approx(loss32.item(), rel=1e-2)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["dgc", "powersgd"])
def test_cpu_config_fast_dev_run_with_two_processes(algorithm: str, ptb_root: Path, tmp_path: Path) -> None:
    """The CPU config with AdamW under each algorithm YAML, as shipped (DGC: momentum 0, plain error feedback)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(REPO_ROOT))
    cmd = [
        sys.executable, "-m", "lightning_dgc_recipes", "fit",
        "--config", "configs/ptb_transformer_cpu.yaml", "--config", f"configs/algo/{algorithm}.yaml",
        *TINY_OVERRIDES["ptb_transformer_cpu"], f"--data.root={ptb_root}",
        "--trainer.fast_dev_run=2", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{algorithm} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in output, "rank 1 did not start"
