"""Each recipe runs ``fast_dev_run`` under ``dgc`` (and deft) with 2 CPU processes, through the real CLI.

The CLI runs in a subprocess because Lightning's popen launcher re-executes the command line for rank 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.recipes import ddp_probe
from tests.recipes.fake_datasets import TINY_OVERRIDES

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run_cli(
    task: str, algorithm: str, data_root: Path, tmp_path: Path, *args: str
) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run the CLI; returns the process and, per rank, how the strategy wrapped the model (``ddp_probe``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(REPO_ROOT))
    env[ddp_probe.ENV] = str(tmp_path / "ddp")
    cmd = [
        sys.executable, "-m", "lightning_dgc_recipes", "fit",
        "--config", f"configs/{task}.yaml", "--config", f"configs/algo/{algorithm}.yaml",
        *TINY_OVERRIDES[task], f"--data.root={data_root}",
        "--trainer.fast_dev_run=2", "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.callbacks+=tests.recipes.ddp_probe.DDPWrapperProbe", *args,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{task} x {algorithm} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    return proc, ddp_probe.read(tmp_path / "ddp")


@pytest.mark.parametrize("task", ["cifar10_resnet20_cpu", "ptb_lstm_cpu", "librispeech_deepspeech_cpu"])
def test_recipe_fast_dev_run_under_dgc_with_two_processes(task: str, fake_data_roots, tmp_path) -> None:
    proc, ranks = _run_cli(task, "dgc", fake_data_roots[task], tmp_path)
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in proc.stdout + proc.stderr, "rank 1 did not start"
    # the CLI keeps the strategy's default, as DGCStrategy() in Python does: .grad are views into the buckets
    assert ranks == [{"strategy": "DGCStrategy", "gradient_as_bucket_view": True}] * 2


def test_recipe_fast_dev_run_under_deft_with_two_processes(fake_data_roots, tmp_path) -> None:
    """Under DEFT, with ``gradient_as_bucket_view`` set to False on the command line: the setting is honoured."""
    _, ranks = _run_cli(
        "cifar10_resnet20_cpu", "deft", fake_data_roots["cifar10_resnet20_cpu"], tmp_path,
        "--trainer.strategy.init_args.gradient_as_bucket_view=false",
    )  # fmt: skip
    assert ranks == [{"strategy": "DEFTStrategy", "gradient_as_bucket_view": False}] * 2
