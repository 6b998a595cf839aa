"""Run ``fit_script.py`` (or another script) in a fresh interpreter with Lightning's popen launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def run_script(
    script: str, out: Path, *args: str, timeout: int = 300, check: bool = True
) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "MASTER_PORT",
            "MASTER_ADDR",
            "LOCAL_RANK",
            "RANK",
            "WORLD_SIZE",
            "NODE_RANK",
            "PL_TRAINER_GPUS",
        )
    }
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    proc = subprocess.run(
        [sys.executable, str(HERE / script), "--out", str(out), *args],
        env=env, cwd=out.parent, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def results(out: Path, world_size: int = 2) -> list[dict]:
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(world_size)]


def params(out: Path, rank: int) -> torch.Tensor:
    return torch.load(f"{out}.rank{rank}.params.pt", weights_only=True)
