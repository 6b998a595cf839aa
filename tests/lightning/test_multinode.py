"""Two nodes on one machine, as users launch them: one ``torchrun`` agent per node, c10d rendezvous."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest
import torch

from tests.conftest import free_port
from tests.lightning.fit_script import Regression
from tests.lightning.run import HERE, _environment, outputs_of_passed, run_together, two_torchrun_agents


@pytest.mark.slow
def test_two_torchrun_agents_train_dgc_and_deft_to_identical_parameters_and_resume(tmp_path: Path) -> None:
    """The README's two-machine command with both "machines" on localhost; ``multinode_script.py`` fits
    ``Trainer(num_nodes=2)`` under dgc and deft, saves a checkpoint and resumes from it."""
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    env = _environment() | {"OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
        "--max-restarts", "0", str(HERE / "multinode_script.py"), "--out", str(tmp_path),
    ]  # fmt: skip
    outputs_of_passed(run_together([command, command], [env, env], tmp_path))
    _check(tmp_path, ("dgc", "deft"), "TorchElasticEnvironment")


@pytest.mark.slow
def test_two_processes_with_the_variables_srun_sets_train_as_two_slurm_nodes(tmp_path: Path) -> None:
    """What the README's sbatch example starts: ``srun`` runs one task per node with these variables, and
    Lightning's ``SLURMEnvironment`` reads them (``MASTER_PORT`` given: it is derived from the job id otherwise)."""
    port = free_port()
    envs = []
    for rank in range(2):
        slurm = {
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "lightning-dgc", "SLURM_NNODES": "2", "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "1", "SLURM_NODELIST": "127.0.0.1", "SLURM_NODEID": str(rank),
            "SLURM_PROCID": str(rank), "SLURM_LOCALID": "0", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
        }  # fmt: skip
        envs.append(_environment() | slurm)
    command = [sys.executable, str(HERE / "multinode_script.py"), "--out", str(tmp_path), "--strategies", "dgc"]
    outputs_of_passed(run_together([command] * 2, envs, tmp_path))
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


#: One launch of 2 nodes x 2 processes runs all of these in the same processes (each launch costs ~20 s).
TWO_LEVEL = ("ddp", "dgc_exact", "dgc", "deft", "powersgd")


@pytest.mark.slow
def test_two_torchrun_agents_of_two_processes_run_the_two_level_exchange(tmp_path: Path) -> None:
    """Two nodes of two devices, one ``torchrun`` agent per node (static rendezvous, ``--node-rank``): the
    two-level exchange (``hierarchical="auto"``) for dgc, deft and powersgd; density 1 equals DDP; a
    checkpoint resumes exactly on the same topology and, with a warning, on a flat exchange."""
    outputs = two_torchrun_agents(
        "multinode_script.py", ["--out", str(tmp_path), "--devices", "2", "--strategies", *TWO_LEVEL], tmp_path
    )
    _check_two_level(tmp_path, ("dgc", "deft", "powersgd"), "TorchElasticEnvironment")
    # density 1, exact selection, no masking: DDP's result on the same 4 processes
    ddp = torch.load(tmp_path / "ddp.rank0.params.pt", weights_only=True)
    for rank in range(4):
        exact = torch.load(tmp_path / f"dgc_exact.rank{rank}.params.pt", weights_only=True)
        torch.testing.assert_close(exact, ddp, rtol=1e-5, atol=1e-6)
    # the same topology resumes every rank's memory bit for bit
    for rank in range(4):
        end = torch.load(tmp_path / f"dgc.rank{rank}.end.pt", weights_only=True)
        start = torch.load(tmp_path / f"dgc.rank{rank}.start.pt", weights_only=True)
        assert end.keys() == start.keys() and "velocity" in end
        for kind in end:
            assert end[kind].keys() == start[kind].keys()
            assert all(torch.equal(end[kind][n], start[kind][n]) for n in end[kind])
    # another topology (a flat exchange over the same processes) resumes with the documented warning
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["dgc_flat"]["resumed_steps"] == 8 and not r["dgc_flat"]["hierarchical"] for r in reports)
    assert "is resumed as" in "".join(outputs)
    flat = [torch.load(tmp_path / f"dgc_flat.rank{r}.params.pt", weights_only=True) for r in range(4)]
    assert all(torch.equal(flat[0], f) for f in flat[1:])
    # the checkpoint and the optimizer after fit hold SGD momentum buffers put together from the nodes' pieces
    shapes = [list(p.shape) for p in Regression().parameters()]
    saved = torch.load(tmp_path / "dgc.ckpt", weights_only=True)["optimizer_states"][0]["state"]
    assert [list(saved[i]["momentum_buffer"].shape) for i in range(len(shapes))] == shapes
    assert all(r["dgc"]["momentum_handed_back"] == shapes for r in reports)


@pytest.mark.slow
def test_four_processes_with_the_variables_srun_sets_train_as_two_slurm_nodes_of_two(tmp_path: Path) -> None:
    """``srun --nodes 2 --ntasks-per-node 2``: Lightning's ``SLURMEnvironment`` gives node and local ranks."""
    port = free_port()
    envs = []
    for rank in range(4):
        slurm = {
            "SLURM_JOB_ID": "4243", "SLURM_JOB_NAME": "lightning-dgc", "SLURM_NNODES": "2", "SLURM_NTASKS": "4",
            "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODELIST": "127.0.0.1", "SLURM_NODEID": str(rank // 2),
            "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % 2), "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }  # fmt: skip
        envs.append(_environment() | slurm)
    command = [sys.executable, str(HERE / "multinode_script.py"), "--out", str(tmp_path), "--devices", "2",
               "--strategies", "deft"]  # fmt: skip
    outputs_of_passed(run_together([command] * 4, envs, tmp_path))
    _check_two_level(tmp_path, ("deft",), "SLURMEnvironment")


def _check_two_level(tmp_path: Path, strategies: tuple[str, ...], environment: str) -> None:
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for name in strategies:
        seen = [report[name] for report in reports]
        assert sorted((s["global_rank"], s["node_rank"], s["local_rank"]) for s in seen) == [
            (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)
        ]  # fmt: skip
        for s in seen:
            assert s["world_size"] == s["strategy_world_size"] == 4 and s["num_nodes"] == 2
            assert s["cluster_environment"] == environment and s["hierarchical"]
            assert (s["first_steps"], s["resumed_steps"], s["exchange_step"]) == (4, 8, 8)
            assert 0 < s["inter_node_bytes"] < s["link_bytes"]
            assert s["loss"] < s["initial_loss"], f"{name} did not train"
        params = [torch.load(tmp_path / f"{name}.rank{r}.params.pt", weights_only=True) for r in range(4)]
        assert all(torch.equal(params[0], p) for p in params[1:]), f"{name}: the ranks' parameters differ"
