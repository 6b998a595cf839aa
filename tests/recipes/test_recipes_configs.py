"""Every task YAML, alone and stacked with every algorithm YAML, parses with the recipes CLI."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy

from lightning_dgc_recipes.__main__ import main

REPO_ROOT = Path(__file__).resolve().parents[2]
TASKS = sorted(path.stem for path in (REPO_ROOT / "configs").glob("*.yaml"))
ALGORITHMS = sorted(path.stem for path in (REPO_ROOT / "configs" / "algo").glob("*.yaml"))
CPU_TASKS = [task for task in TASKS if task.endswith("_cpu")]
#: The configs of DiLoCoStrategy: sync_every, outer_lr, outer_momentum, algorithm and its density.
DILOCO = {"diloco": (10, 0.7, 0.9, "dense", None), "diloco_dgc": (10, 0.7, 0.9, "dgc", 0.01),
          "diloco_streaming": (10, 0.7, 0.9, "dense", None), "dgc_updates": (1, 1.0, 0.0, "dgc", 0.001)}  # fmt: skip
#: Streaming DiLoCo's configs: fragments, overlap_steps, mixing (the others: one fragment, no overlap).
STREAMING = {"diloco_streaming": (5, 1, 0.5)}
#: The sharded models' configs (FSDP2 inside the node): their algorithm and its density (``None``: it has none).
SHARDED = {"dgc_hsdp": ("dgc", 0.01), "deft_hsdp": ("deft", 0.001), "powersgd_hsdp": ("powersgd", None)}
#: DiLoCo on a sharded model: sync_every, outer_lr, outer_momentum, algorithm
SHARDED_DILOCO = {"diloco_hsdp": (10, 0.7, 0.9, "dense")}
#: The densities of the algorithm YAMLs that set one other than DGC's 0.001.
DENSITIES = {"dgc_adamw": 0.01, "dgc_1pct_int8": 0.01}
#: The lightning_dgc classes the algorithm YAMLs may name (the package's public API).
LIGHTNING_DGC_NAMES = {
    "CompressionStrategy",
    "DGCStrategy",
    "DEFTStrategy",
    "DiLoCoStrategy",
    "HSDPCompressionStrategy",
    "HSDPDiLoCoStrategy",
    "SparsityWarmup",
    "CriticalRegimes",
    "CompressionMonitor",
}


def lightning_dgc_names(algorithm: str | None) -> set[str]:
    if algorithm is None:
        return set()
    text = (REPO_ROOT / "configs" / "algo" / f"{algorithm}.yaml").read_text()
    return set(re.findall(r"class_path:\s*lightning_dgc\.(\w+)", text))


@pytest.fixture(autouse=True)
def repo_root_and_clean_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr(sys, "argv", ["recipes"])  # pytest's own flags are not the CLI's


def test_the_expected_configs_exist() -> None:
    assert {
        "cifar10_resnet20",
        "cifar10_resnet110",
        "imagenet_resnet50",
        "ptb_lstm",
        "librispeech_deepspeech",
    } <= set(TASKS)
    assert {"cifar10_resnet20_cpu", "ptb_lstm_cpu", "librispeech_deepspeech_cpu"} <= set(TASKS)
    assert {"ddp", "dgc", "dgc_warmup", "dgc_adamw", "deft", "powersgd", *DILOCO} <= set(ALGORITHMS)


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "configs").rglob("*.yaml")), ids=lambda p: p.stem)
def test_every_yaml_starts_with_its_launch_command(path: Path) -> None:
    first_line = path.read_text().splitlines()[0]
    assert first_line.startswith("# python -m lightning_dgc_recipes fit --config configs/")
    assert f"configs/{path.relative_to(REPO_ROOT / 'configs')}" in first_line
    assert isinstance(yaml.safe_load(path.read_text()), dict)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_algorithm_yamls_name_only_the_public_classes(algorithm: str) -> None:
    assert lightning_dgc_names(algorithm) <= LIGHTNING_DGC_NAMES


@pytest.mark.parametrize("algorithm", [None, *ALGORITHMS], ids=lambda a: a or "plain")
@pytest.mark.parametrize("task", TASKS)
def test_config_pair_parses(task: str, algorithm: str | None) -> None:
    args = ["fit", "--config", f"configs/{task}.yaml"]
    if algorithm is not None:
        args += ["--config", f"configs/algo/{algorithm}.yaml"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main([*args, "--print_config"])
    assert exit_info.value.code == 0
    config = yaml.safe_load(out.getvalue())
    assert config["model"]["class_path"].startswith("lightning_dgc_recipes.")
    assert config["data"]["class_path"].startswith("lightning_dgc_recipes.")
    if algorithm == "ddp":
        assert config["trainer"]["strategy"] == "ddp"
    elif algorithm in SHARDED:  # no DDP wrapper: the algorithm and its options, nothing of DDP's
        init_args = config["trainer"]["strategy"]["init_args"]
        assert config["trainer"]["strategy"]["class_path"] == "lightning_dgc.HSDPCompressionStrategy"
        assert (init_args["algorithm"], (init_args["options"] or {}).get("density")) == SHARDED[algorithm]
        return
    elif algorithm in SHARDED_DILOCO:
        init_args = config["trainer"]["strategy"]["init_args"]
        assert config["trainer"]["strategy"]["class_path"] == "lightning_dgc.HSDPDiLoCoStrategy"
        got = (init_args["sync_every"], init_args["outer_lr"], init_args["outer_momentum"], init_args["algorithm"])
        assert got == SHARDED_DILOCO[algorithm]
        return
    elif algorithm in DILOCO:  # local steps: no gradient exchange
        init_args = config["trainer"]["strategy"]["init_args"]
        assert config["trainer"]["strategy"]["class_path"] == "lightning_dgc.DiLoCoStrategy"
        got = (init_args["sync_every"], init_args["outer_lr"], init_args["outer_momentum"], init_args["algorithm"],
               (init_args["options"] or {}).get("density"))  # fmt: skip
        assert got == DILOCO[algorithm]
        streaming = (init_args["fragments"], init_args["overlap_steps"], init_args["mixing"])
        assert streaming == STREAMING.get(algorithm, (1, 0, 0.5))
        return
    elif (
        algorithm is not None
        and "density" in (REPO_ROOT / "configs" / "algo" / f"{algorithm}.yaml").read_text()
    ):
        assert config["trainer"]["strategy"]["init_args"]["density"] == DENSITIES.get(algorithm, 0.001)
    if algorithm not in (None, "ddp"):
        assert config["trainer"]["strategy"]["init_args"]["hierarchical"] == "auto"
        # the strategies' default, as in Python (DDP's own default is False)
        assert config["trainer"]["strategy"]["init_args"]["gradient_as_bucket_view"] is True


@pytest.mark.parametrize("algorithm", [None, *ALGORITHMS], ids=lambda a: a or "plain")
@pytest.mark.parametrize("task", CPU_TASKS)
def test_cpu_config_pair_instantiates(task: str, algorithm: str | None, tmp_path: Path) -> None:
    """Model, DataModule and Trainer (with its strategy and callbacks) build; nothing is launched."""
    args = ["--config", f"configs/{task}.yaml", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    if algorithm is not None:
        args += ["--config", f"configs/algo/{algorithm}.yaml"]
    cli = main(args, run=False)
    assert cli.trainer.num_devices == 2
    assert isinstance(cli.trainer.progress_bar_callback, RichProgressBar)
    assert isinstance(cli.trainer.logger, TensorBoardLogger) and cli.trainer.logger.name == task
    if algorithm in SHARDED:
        assert type(cli.trainer.strategy).__name__ == "HSDPCompressionStrategy"
        assert cli.trainer.strategy.algorithm == SHARDED[algorithm][0]
    elif algorithm in SHARDED_DILOCO:
        assert type(cli.trainer.strategy).__name__ == "HSDPDiLoCoStrategy"
    elif algorithm is not None:
        assert isinstance(cli.trainer.strategy, DDPStrategy)
        if algorithm in DILOCO:
            assert cli.trainer.strategy.settings.sync_every == DILOCO[algorithm][0]
        elif algorithm != "ddp":
            assert cli.trainer.strategy._ddp_kwargs["gradient_as_bucket_view"] is True
        callbacks = {type(callback).__name__ for callback in cli.trainer.callbacks}
        assert (
            lightning_dgc_names(algorithm) - {"CompressionStrategy", "DGCStrategy", "DEFTStrategy", "DiLoCoStrategy"}
            <= callbacks
        )


def test_progress_bar_can_be_disabled(tmp_path: Path) -> None:
    args = ["--config", "configs/ptb_lstm_cpu.yaml", "--trainer.enable_progress_bar=false"]
    cli = main([*args, f"--trainer.logger.init_args.save_dir={tmp_path}"], run=False)
    assert cli.trainer.progress_bar_callback is None


def test_default_logger_without_a_task_logger(tmp_path: Path) -> None:
    config = yaml.safe_load((REPO_ROOT / "configs" / "ptb_lstm_cpu.yaml").read_text())
    del config["trainer"]["logger"]
    path = tmp_path / "no_logger.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = main(["--config", str(path)], run=False)
    assert isinstance(cli.trainer.logger, TensorBoardLogger)
    assert Path(cli.trainer.logger.save_dir).name == "lightning_logs"


@pytest.mark.parametrize("algorithm", ["dgc", "deft", "powersgd"])
def test_an_explicit_gradient_as_bucket_view_false_is_honoured(algorithm: str, tmp_path: Path) -> None:
    args = ["--config", "configs/ptb_lstm_cpu.yaml", "--config", f"configs/algo/{algorithm}.yaml"]
    args += ["--trainer.strategy.init_args.gradient_as_bucket_view=false", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    cli = main(args, run=False)
    assert cli.trainer.strategy._ddp_kwargs["gradient_as_bucket_view"] is False


@pytest.mark.parametrize(("value", "closest"), [("cifar10_resnet21", "cifar10_resnet20"), ("algo/dgcc", "algo/dgc")])
def test_an_unknown_config_name_lists_the_builtin_names_on_the_command_line(value: str, closest: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_dgc_recipes", "fit", "--config", value, "--print_config"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"`--config {value}`: no such file" in proc.stderr and f"Did you mean `{closest}`?" in proc.stderr
    assert "cifar10_resnet20_cpu, imagenet_resnet50" in proc.stderr and "algo/dgc, algo/dgc_1pct_int8, algo/dgc_adamw, algo/dgc_hsdp, algo/dgc_lean, algo/dgc_lean_every, algo/dgc_lean_small, algo/dgc_regimes, algo/dgc_updates, algo/dgc_warmup" in proc.stderr
    assert "Traceback" not in proc.stderr and "File does not exist" not in proc.stderr
