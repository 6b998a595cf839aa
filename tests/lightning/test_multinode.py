"""Two nodes on one machine, as users launch them: one ``torchrun`` agent per node, c10d rendezvous."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from tests.conftest import free_port
from tests.lightning.run import HERE, _environment


@pytest.mark.slow
def test_two_torchrun_agents_train_dgc_and_deft_to_identical_parameters_and_resume(tmp_path: Path) -> None:
    """The README's two-machine command with both "machines" on localhost; ``multinode_script.py`` fits
    ``Trainer(num_nodes=2)`` under dgc and deft, saves a checkpoint and resumes from it."""
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    env = _environment() | {"OMP_NUM_THREADS": "1"}
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                run_id,
                "--max-restarts",
                "0",
                str(HERE / "multinode_script.py"),
                "--out",
                str(tmp_path),
            ],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for _ in range(2)
    ]
    outputs = [agent.communicate(timeout=400)[0] for agent in agents]
    for agent, output in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, output[-6000:]
    _check(tmp_path, ("dgc", "deft"), "TorchElasticEnvironment")


@pytest.mark.slow
def test_two_processes_with_the_variables_srun_sets_train_as_two_slurm_nodes(tmp_path: Path) -> None:
    """What the README's sbatch example starts: ``srun`` runs one task per node with these variables, and
    Lightning's ``SLURMEnvironment`` reads them (``MASTER_PORT`` given: it is derived from the job id otherwise)."""
    port = free_port()
    tasks = []
    for rank in range(2):
        slurm = {
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "lightning-dgc", "SLURM_NNODES": "2", "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "1", "SLURM_NODELIST": "127.0.0.1", "SLURM_NODEID": str(rank),
            "SLURM_PROCID": str(rank), "SLURM_LOCALID": "0", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
        }  # fmt: skip
        tasks.append(subprocess.Popen(
            [sys.executable, str(HERE / "multinode_script.py"), "--out", str(tmp_path), "--strategies", "dgc"],
            env=_environment() | slurm, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))  # fmt: skip
    outputs = [task.communicate(timeout=400)[0] for task in tasks]
    for task, output in zip(tasks, outputs, strict=True):
        assert task.returncode == 0, output[-6000:]
    _check(tmp_path, ("dgc",), "SLURMEnvironment")


def _check(tmp_path: Path, strategies: tuple[str, ...], environment: str) -> None:
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for name in strategies:
        seen = [report[name] for report in reports]
        assert sorted(s["global_rank"] for s in seen) == [0, 1]
        for s in seen:
            assert s["world_size"] == s["strategy_world_size"] == s["num_nodes"] == 2
            assert s["node_rank"] == s["global_rank"]  # one process per node
            assert s["cluster_environment"] == environment
            assert (s["first_steps"], s["resumed_steps"], s["exchange_step"]) == (4, 8, 8)
        first, second = (
            torch.load(tmp_path / f"{name}.rank{r}.params.pt", weights_only=True) for r in range(2)
        )
        assert torch.equal(first, second), f"{name}: the nodes' parameters differ"
