"""The optimizer contract (momentum never applied twice), on a 1-process Trainer (world size 1, gloo)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_dgc import DEFTStrategy, DGCStrategy
from lightning_dgc.checkpoint.exchange import inline_exchange_state
from tests.lightning.fit_script import Regression, dataset


class _Configurable(Regression):
    def __init__(self, make_optimizer) -> None:
        super().__init__()
        self._make_optimizer = make_optimizer

    def configure_optimizers(self):
        return self._make_optimizer(self.parameters())


class _GroupProbe(L.Callback):
    """Records the optimizer's first parameter group while training runs."""

    def __init__(self) -> None:
        self.groups: list[tuple] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        group = trainer.optimizers[0].param_groups[0]
        self.groups.append((group.get("momentum"), group.get("nesterov"), group.get("weight_decay")))


def _fit(strategy: DGCStrategy, make_optimizer, steps: int = 3, callbacks: list | None = None) -> L.Trainer:
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks or [],
    )  # fmt: skip
    trainer.fit(_Configurable(make_optimizer), DataLoader(dataset(64), batch_size=16))
    return trainer


def test_sgd_momentum_and_weight_decay_are_taken_over() -> None:
    strategy = DGCStrategy(density=0.01)
    probe = _GroupProbe()
    trainer = _fit(
        strategy, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
        callbacks=[probe],
    )  # fmt: skip
    assert probe.groups == [(0.0, False, 0.0)] * 3, "SGD must not apply what the exchange applies"
    group = trainer.optimizers[0].param_groups[0]
    assert (group["momentum"], group["nesterov"], group["weight_decay"]) == (0.9, True, 1e-4), (
        "after fit the optimizer holds the user's values again"
    )
    settings = set(strategy.exchange_state.param_settings.values())
    assert len(settings) == 1
    s = settings.pop()
    assert (s.momentum, s.nesterov, s.weight_decay) == (0.9, True, 1e-4)
    assert strategy.hook_calls > 0
    assert strategy.compression_stats()["step"] == 3


def test_without_momentum_correction_sgd_keeps_its_momentum_and_weight_decay() -> None:
    """``momentum_correction=False``: top-k with error feedback; SGD applies its own momentum and weight decay to
    the averaged sparse update, so nothing is taken over and the exchange holds no momentum."""
    strategy = DGCStrategy(density=0.05, momentum_correction=False)
    probe = _GroupProbe()
    _fit(strategy, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4), callbacks=[probe])
    assert probe.groups == [(0.9, False, 1e-4)] * 3
    assert not strategy.exchange_state.param_settings
    assert not strategy.exchange_state.memory.state_dict().get("momentum")
    assert strategy.compression_stats()["values_sent"] > 0


@pytest.mark.parametrize("strategy", [DGCStrategy, DEFTStrategy])
def test_momentum_in_the_exchange_without_momentum_correction_is_rejected_with_the_fix(strategy) -> None:
    with pytest.raises(ValueError, match=r"momentum_correction=True.*leave momentum to the optimizer"):
        strategy(momentum=0.9, momentum_correction=False)


def test_momentum_in_both_places_is_rejected() -> None:
    with pytest.raises(ValueError, match="Momentum would be applied twice"):
        _fit(DGCStrategy(momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))


def test_adam_with_momentum_correction_is_rejected() -> None:
    with pytest.raises(ValueError, match="momentum would be applied twice"):
        _fit(DGCStrategy(momentum=0.9), lambda p: torch.optim.Adam(p, lr=1e-3))


def test_adam_with_error_feedback_only_trains() -> None:
    strategy = DGCStrategy(density=0.05)
    _fit(strategy, lambda p: torch.optim.Adam(p, lr=1e-3))
    assert strategy.compression_stats()["values_sent"] > 0


def test_sgd_with_dampening_is_rejected() -> None:
    with pytest.raises(ValueError, match="dampening"):
        _fit(DGCStrategy(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1))


class _SparseEmbedding(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(100, 8, sparse=True)
        self.head = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        return self.head(self.embedding(batch[0])).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("strategy", [DGCStrategy, DEFTStrategy])
def test_sparse_gradients_are_refused_at_setup_by_name(strategy) -> None:
    trainer = L.Trainer(
        strategy=strategy(), accelerator="cpu", devices=1, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = DataLoader(torch.utils.data.TensorDataset(torch.arange(16)), batch_size=4)
    with pytest.raises(ValueError, match=r"\['embedding.weight'\] get sparse gradients .* sparse=False"):
        trainer.fit(_SparseEmbedding(), data)


def test_checkpoint_of_an_earlier_version_keeps_the_momentum_of_configure_optimizers(tmp_path) -> None:
    """Checkpoints written before the user's hyper-parameters were kept hold SGD(momentum=0): the
    exchange must still apply the momentum configure_optimizers() asks for, and SGD none."""
    make = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-4)  # noqa: E731
    trainer = _fit(DGCStrategy(density=0.01), make, steps=2)
    path = tmp_path / "new.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = inline_exchange_state(path)  # the single-file form: what an earlier version wrote
    assert checkpoint["optimizer_states"][0]["param_groups"][0]["momentum"] == 0.9
    # What an earlier version wrote: no format, the take-over's zeros, no SGD buffers.
    del checkpoint["lightning_dgc"]["format"]
    for group in checkpoint["optimizer_states"][0]["param_groups"]:
        group["momentum"] = group["weight_decay"] = 0.0
    checkpoint["optimizer_states"][0]["state"] = {}
    torch.save(checkpoint, tmp_path / "old.ckpt")

    strategy, probe = DGCStrategy(density=0.01), _GroupProbe()
    resumed = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=4, logger=False, callbacks=[probe],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    with pytest.warns(UserWarning, match="written by an earlier lightning-dgc"):
        resumed.fit(
            _Configurable(make), DataLoader(dataset(64), batch_size=16), ckpt_path=tmp_path / "old.ckpt"
        )
    assert probe.groups == [(0.0, False, 0.0)] * 2
    assert {(s.momentum, s.weight_decay) for s in strategy.exchange_state.param_settings.values()} == {
        (0.9, 1e-4)
    }
    group = resumed.optimizers[0].param_groups[0]
    assert (group["momentum"], group["weight_decay"]) == (0.9, 1e-4)
