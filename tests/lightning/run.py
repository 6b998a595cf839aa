"""Run ``fit_script.py`` (or another script) as 2 real ranks, started here or by Lightning's popen launcher.

Most tests start both ranks at once, as torchrun or srun do: the two interpreters import torch and
Lightning on the 2 cores side by side. Under the popen launcher (what ``Trainer(strategy="dgc")`` does by
default) rank 0 imports them, then starts rank 1, which imports them again while rank 0 waits: a 10-step
``fit_script.py`` run took 14.8 s that way against 9.2 s (medians of 4, 2 cores). The tests that prove the
default path (``test_fit``, ``test_exit``, ``test_fabric``, an outside algorithm) use ``launcher="popen"``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
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


def _command(script: str, out: Path, args: tuple[str, ...]) -> list[str]:
    return [sys.executable, str(HERE / script), "--out", str(out), *args]


def run_script(
    script: str, out: Path, *args: str, timeout: int = 300, check: bool = True, launcher: str = "external"
) -> subprocess.CompletedProcess:
    """Run ``script`` on 2 ranks (1 with ``--devices 1``); rank 0's output, then rank 1's, as one process's.

    ``launcher="external"`` starts each rank here (:func:`launch_ranks`); ``"popen"`` starts one process and
    lets Lightning's launcher start the other. The return code is the first non-zero one among the ranks.
    """
    devices = int(args[args.index("--devices") + 1]) if "--devices" in args else 2
    if launcher == "popen" or devices == 1:
        proc = subprocess.run(
            _command(script, out, args), env=_environment(), cwd=out.parent, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip
    elif launcher == "external":
        proc = _wait(launch_ranks(script, out, *args, world_size=devices), timeout)
    else:
        raise ValueError(f"launcher must be 'external' or 'popen', not {launcher!r}")
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def _wait(ranks: list[Rank], timeout: float, grace: float = 20.0) -> subprocess.CompletedProcess:
    """Wait for every rank; once one has failed, give the others ``grace`` seconds, then kill them.

    Lightning's popen launcher does the same for the processes it starts: the ranks left would otherwise wait
    in a collective for the process group's timeout. A run still going after ``timeout`` is killed and raises
    :class:`subprocess.TimeoutExpired`, as :func:`subprocess.run` does.
    """
    start = time.monotonic()
    failed_at = None
    while any(r.process.poll() is None for r in ranks):
        now = time.monotonic()
        if failed_at is None and any(r.process.returncode not in (None, 0) for r in ranks):
            failed_at = now
        if now - start > timeout or (failed_at is not None and now - failed_at > grace):
            for r in ranks:
                r.stop()
            if failed_at is None:
                raise subprocess.TimeoutExpired(ranks[0].process.args, timeout, *ranks[0].output())
            break
        time.sleep(0.1)
    outputs = [r.output() for r in ranks]
    codes = [r.process.returncode for r in ranks]
    return subprocess.CompletedProcess(
        ranks[0].process.args,
        next((c for c in codes if c != 0), 0),
        "".join(out for out, _ in outputs),
        "".join(err for _, err in outputs),
    )


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

    def stop(self) -> None:
        """Kill the process if it is still running (a stopped or hung rank), and reap it."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


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
                _command(script, out, args), env=env, cwd=out.parent, stdout=o, stderr=e, text=True,
            )  # fmt: skip
        ranks.append(Rank(process, stdout, stderr))
    return ranks
