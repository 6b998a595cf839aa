"""Run ``fit_script.py`` (or another script) in a fresh interpreter with Lightning's popen launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.conftest import free_port

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def _environment() -> dict[str, str]:
    """This process's environment without the distributed variables a previous run may have left."""
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
    return env


def run_script(
    script: str, out: Path, *args: str, timeout: int = 300, check: bool = True
) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, str(HERE / script), "--out", str(out), *args],
        env=_environment(), cwd=out.parent, capture_output=True, text=True, timeout=timeout,
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


@dataclass
class Rank:
    """One separately launched rank: its process and where its output goes."""

    process: subprocess.Popen
    stdout: Path
    stderr: Path

    def output(self) -> tuple[str, str]:
        return self.stdout.read_text(), self.stderr.read_text()


def launch_ranks(script: str, out: Path, *args: str, world_size: int = 2) -> list[Rank]:
    """Start every rank of ``script`` as its own process, as torchrun or srun do (no Lightning launcher).

    Each process gets ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK``,
    which makes Lightning treat the processes as created externally. The caller waits for them (and
    kills what is left: a stopped rank stays stopped).
    """
    port = free_port()
    ranks = []
    for rank in range(world_size):
        env = _environment() | {
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
            "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0",
        }  # fmt: skip
        stdout, stderr = Path(f"{out}.rank{rank}.stdout"), Path(f"{out}.rank{rank}.stderr")
        with stdout.open("w") as o, stderr.open("w") as e:
            process = subprocess.Popen(
                [sys.executable, str(HERE / script), "--out", str(out), *args],
                env=env, cwd=out.parent, stdout=o, stderr=e, text=True,
            )  # fmt: skip
        ranks.append(Rank(process, stdout, stderr))
    return ranks
