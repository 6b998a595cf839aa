"""Command-line entry point: ``python -m recipes`` (or ``lightning-dgc-recipes``), a LightningCLI.

A run stacks a task YAML and, optionally, an algorithm YAML; later files and flags override
earlier ones::

    python -m recipes fit --config configs/cifar10_resnet20.yaml --config configs/algo/dgc.yaml \\
        --data.root /path/to/data

Model and data are given by ``class_path`` in the task YAML (LightningCLI's subclass mode), so any
LightningModule / LightningDataModule can be used. Defaults added here: a TensorBoard logger
writing to ``lightning_logs/`` and a Rich progress bar (unless the run configures its own
progress bar or disables it with ``--trainer.enable_progress_bar false``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar
from lightning.pytorch.cli import LightningCLI

from lightning_dgc import destroy_process_group

__all__ = ["RecipeCLI", "main"]

DEFAULT_LOGGER = {
    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
    "init_args": {"save_dir": "lightning_logs", "name": "recipes"},
}


class RecipeCLI(LightningCLI):
    """LightningCLI with the recipes' defaults: Rich progress bar and TensorBoard logger."""

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self._get(self.config_init, "trainer", default={})
        callbacks = config.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
        has_bar = any(isinstance(callback, ProgressBar) for callback in callbacks)
        if config.get("enable_progress_bar") is not False and not has_bar and "callbacks" not in kwargs:
            kwargs["callbacks"] = [*callbacks, RichProgressBar()]
        return super().instantiate_trainer(**kwargs)


def main(args: list[str] | None = None, run: bool = True) -> RecipeCLI:
    """Run the recipes CLI (``args`` defaults to ``sys.argv[1:]``); returns the CLI object."""
    cli = RecipeCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults={"logger": DEFAULT_LOGGER},
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )
    if run:
        destroy_process_group()  # the run is over: end the process group before the interpreter exits
    return cli


if __name__ == "__main__":
    main()
