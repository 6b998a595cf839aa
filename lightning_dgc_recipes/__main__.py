"""Command-line entry point: ``lightning-dgc`` (or ``python -m lightning_dgc_recipes``), a LightningCLI.

A run stacks a task YAML and, optionally, an algorithm YAML; later files and flags override
earlier ones::

    lightning-dgc fit --config cifar10_resnet20 --config algo/dgc --data.root /path/to/data

``--config`` takes a file, or the name of a built-in config that ships with the package:
``cifar10_resnet20`` (or ``cifar10_resnet20.yaml``, ``configs/cifar10_resnet20.yaml``) and
``algo/dgc`` (or ``configs/algo/dgc.yaml``). An existing file of that name always wins, so the
checkout's ``configs/`` paths work from the repository root and everywhere else alike.

Model and data are given by ``class_path`` in the task YAML (LightningCLI's subclass mode), so any
LightningModule / LightningDataModule can be used. Defaults added here: a TensorBoard logger
writing to ``lightning_logs/`` and a Rich progress bar (unless the run configures its own
progress bar or disables it with ``--trainer.enable_progress_bar false``).
"""

from __future__ import annotations

import difflib
import sys
import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar
from lightning.pytorch.cli import LightningCLI

from lightning_dgc import destroy_process_group

__all__ = ["RecipeCLI", "builtin_configs", "cli_main", "main", "resolve_config"]

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


def _configs_dir() -> Path:
    """The built-in configs: ``lightning_dgc_recipes/configs`` in an installed wheel, ``configs/`` in a checkout."""
    installed = Path(__file__).resolve().parent / "configs"
    return installed if installed.is_dir() else Path(__file__).resolve().parent.parent / "configs"


def builtin_configs() -> list[str]:
    """Names of the built-in configs (``cifar10_resnet20``, ``algo/dgc``, ...), for ``--config``."""
    root = _configs_dir()
    return sorted(path.relative_to(root).with_suffix("").as_posix() for path in root.rglob("*.yaml"))


#: Built-in configs under a previous name, kept for one release: the old name -> the new one.
RENAMED_CONFIGS = {"algo/dgc_adamw": "algo/dgc_1pct_int8"}


def resolve_config(value: str) -> str:
    """The file a ``--config`` value names: an existing file as given, else a built-in config's path.

    Built-in names are accepted with or without ``.yaml`` and with or without a leading ``configs/``.
    A YAML string given inline is returned unchanged, for LightningCLI to parse. Any other value is a
    ``ValueError`` that lists the built-in names and suggests the closest one.
    """
    if Path(value).exists() or "\n" in value or ":" in value or value.lstrip().startswith(("{", "[")):
        return value
    name = value.removeprefix("configs/").removesuffix(".yaml").removesuffix(".yml")
    if name in RENAMED_CONFIGS:
        warnings.warn(
            f"`{name}` is the previous name of `{RENAMED_CONFIGS[name]}` (the same settings); it is removed in the"
            f" next release: pass `--config {RENAMED_CONFIGS[name]}`.",
            FutureWarning,
            stacklevel=2,
        )
    candidate = _configs_dir() / f"{name}.yaml"
    if candidate.is_file():
        return str(candidate)
    names = builtin_configs()
    close = difflib.get_close_matches(name, names, n=1)
    hint = f" Did you mean `{close[0]}`?" if close else ""
    raise ValueError(
        f"`--config {value}`: no such file, and no built-in config of that name.{hint} The built-in configs:"
        f" {', '.join(names)}. Pass one of these names (`--config cifar10_resnet20_cpu --config algo/dgc`)"
        " or the path of a YAML file."
    )


def _resolve_config_args(args: list[str]) -> list[str]:
    resolved = list(args)
    for i, arg in enumerate(resolved):
        if arg in ("--config", "-c") and i + 1 < len(resolved):
            resolved[i + 1] = resolve_config(resolved[i + 1])
        elif arg.startswith("--config="):
            resolved[i] = "--config=" + resolve_config(arg.removeprefix("--config="))
    return resolved


def main(args: list[str] | None = None, run: bool = True) -> RecipeCLI:
    """Run the recipes CLI (``args`` defaults to ``sys.argv[1:]``); returns the CLI object.

    Built-in config names given to ``--config`` are resolved first (see :func:`resolve_config`).
    """
    try:
        if args is None:  # the command line: resolved in place, so LightningCLI reads it as usual
            sys.argv[1:] = _resolve_config_args(sys.argv[1:])
        else:
            args = _resolve_config_args(args)
    except ValueError as error:  # reported as LightningCLI reports a bad argument
        print(f"{Path(sys.argv[0]).name}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
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


def cli_main() -> None:
    """The ``lightning-dgc`` console script: :func:`main` without a return value (a console script
    hands its function's return value to ``sys.exit``, which would turn the CLI object into exit code 1)."""
    main()


if __name__ == "__main__":
    cli_main()
