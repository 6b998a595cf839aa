"""A fit with 2 CPU processes started by Lightning's multiprocessing launcher: this script is the main process
(``tests/lightning/test_spawn.py`` runs it).

* ``--mode name``: ``Trainer(strategy="dgc_spawn")`` fits (the spawn launcher pickles the Trainer, its strategy and the
  model into each process), then tests (a second spawn), then a second ``fit`` is refused by Lightning's launcher, as
  under ``"ddp_spawn"``.
* ``--mode extras``: a DiLoCo strategy whose launcher sends a figure of the worker's run back to the main process
  (Lightning's ``get_extra_results`` / ``update_main_process_results``), its processes forked (``start_method="fork"``,
  what ``"diloco_fork"`` and ``"diloco_notebook"`` use).

The main process writes ``OUT.main.json`` and its model's weights (``OUT.main.params.pt``); each worker, once its
strategy has torn down, pickles that strategy (set up, trained) and writes ``OUT.rankN.json`` and its weights.

    python tests/lightning/spawn_script.py --out OUT --mode name
"""

from __future__ import annotations

import argparse
import json
import pickle
from typing import Any

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch import nn

import lightning_dgc

SEED = 1234


class TiedModel(BoringModel):
    """Lightning's boring model with a second layer whose weight is the first one's and a buffer (the memory-sharing
    check of the spawn launcher), a value logged in validation (the callback metrics sent back), and SGD with
    momentum (which DGC takes over). Wide enough that DGC compresses its weight."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(32, 256)
        self.tied_layer = nn.Linear(32, 256)
        self.tied_layer.weight = self.layer.weight
        self.register_buffer("buffer", torch.ones(3))
        self.seen: dict[str, Any] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) + self.tied_layer(x)

    def on_fit_start(self) -> None:
        self.seen.update(
            shared=[t.is_shared() for t in (self.layer.weight, self.tied_layer.weight, self.buffer)],
            tied=self.layer.weight.data_ptr() == self.tied_layer.weight.data_ptr(),
            initial_seed=torch.initial_seed(),  # the main process's, restored by the launcher
        )

    def on_train_start(self) -> None:
        self.seen["device"] = str(self.device)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        self.log("val_marker", 1.0, sync_dist=True)
        return super().validation_step(batch, batch_idx)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _same(a: Any, b: Any) -> bool:
    """Whether two state dicts (nested dicts, lists, tensors, plain values) hold the same values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


class AfterFit(L.Callback):
    """In each worker, once the strategy has torn down (callbacks' ``teardown`` comes after it): pickle the strategy
    that ran and compare its state with the copy's; write what the worker saw and its weights."""

    def __init__(self, out: str) -> None:
        self.out = out

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        copy = pickle.loads(pickle.dumps(strategy))
        if isinstance(strategy, lightning_dgc.DiLoCoStrategy):
            state, copied = strategy.outer.state_dict(), copy.outer.state_dict()
            steps = strategy.outer.outer_steps
        else:
            state, copied = strategy.exchange_state.state_dict(), copy.exchange_state.state_dict()
            steps = state["step"]
        stats = strategy.compression_stats()
        record = {
            **pl_module.seen,  # type: ignore[dict-item]
            "rank": trainer.global_rank,
            "strategy": type(strategy).__name__,
            "copy_strategy": type(copy).__name__,
            "copy_state_equal": _same(state, copied),
            "steps": steps,
            "compression_ratio": stats.get("compression_ratio"),
        }
        torch.save(_flat(pl_module), f"{self.out}.rank{trainer.global_rank}.params.pt")
        with open(f"{self.out}.rank{trainer.global_rank}.json", "w") as f:
            json.dump(record, f)


class ExtrasLauncher(_MultiProcessingLauncher):
    """Sends the worker's number of outer steps back with the callback metrics."""

    def get_extra_results(self, trainer: L.Trainer) -> dict[str, Any]:
        return {**super().get_extra_results(trainer), "outer_steps": trainer.strategy.outer.outer_steps}

    def update_main_process_results(self, trainer: L.Trainer, extra: dict[str, Any]) -> None:
        trainer.strategy.outer_steps_in_worker = extra.pop("outer_steps")
        super().update_main_process_results(trainer, extra)


class DiLoCoWithExtras(lightning_dgc.DiLoCoStrategy):
    def _configure_launcher(self) -> None:
        self._launcher = ExtrasLauncher(self, start_method=self._start_method)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=("name", "extras"), default="name")
    args = parser.parse_args()

    torch.manual_seed(SEED)
    model = TiedModel()
    before = _flat(model).clone()
    strategy = "dgc_spawn" if args.mode == "name" else DiLoCoWithExtras(sync_every=2, start_method="fork")
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, limit_train_batches=4, limit_val_batches=2,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[AfterFit(args.out)],
    )  # fmt: skip
    launcher = trainer.strategy.launcher
    main: dict[str, Any] = {
        "strategy": type(trainer.strategy).__name__,
        "root_device": str(trainer.strategy.root_device),
        "launcher": type(launcher).__name__,
        "start_method": getattr(launcher, "_start_method", None),
    }
    trainer.fit(model)
    main.update(
        val_marker=float(trainer.callback_metrics["val_marker"]),
        weights_changed=not torch.equal(before, _flat(model)),
        tied=model.layer.weight.data_ptr() == model.tied_layer.weight.data_ptr(),
        outer_steps_in_worker=getattr(trainer.strategy, "outer_steps_in_worker", None),
    )
    torch.save(_flat(model), f"{args.out}.main.params.pt")
    if args.mode == "name":
        main["test_results"] = trainer.test(model, verbose=False)
        trainer.fit_loop.max_epochs += 1
        try:
            trainer.fit(model)
        except NotImplementedError as error:
            main["second_fit"] = str(error)
    with open(f"{args.out}.main.json", "w") as f:
        json.dump(main, f)


if __name__ == "__main__":  # spawned processes import this file again
    main()
