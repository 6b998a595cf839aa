"""Surviving a lost worker: ``torchrun --max-restarts 1`` restarts every worker, and Lightning resumes from
``ckpt_path="last"``. The resume boundary is an epoch end: there Lightning replays the batches exactly
(the DistributedSampler's order is a function of seed and epoch), while a mid-epoch checkpoint of a
non-resumable DataLoader restarts the epoch's iteration and replays batches that were already trained on.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from tests.conftest import free_port
from tests.lightning.run import HERE, _environment, run_together

pytestmark = pytest.mark.slow


#: torchrun's c10d rendezvous keeps one store for every restart by default, so that the restarted workers can
#: read the dead workers' addresses (gloo: "connection refused", or a hang); with this, each restart gets a
#: fresh store (without it 5 runs in 8 failed here, one of them hanging; with it 8 of 8 passed).
FRESH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _torchrun(out: Path, *args: str) -> subprocess.CompletedProcess:
    out.mkdir()
    return subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "1", str(HERE / "restart_script.py"), "--out", str(out), *args,
        ],
        env=_environment() | {"OMP_NUM_THREADS": "1"} | FRESH_STORE, cwd=out, capture_output=True, text=True,
        timeout=400,
    )  # fmt: skip


def test_a_worker_killed_mid_epoch_is_restarted_and_the_run_ends_as_an_uninterrupted_one(tmp_path) -> None:
    straight = _torchrun(tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-6000:]
    # 8 steps per epoch; the checkpoint at the end of epoch 0 is step 8: rank 1 dies at step 12, in epoch 1
    restarted = _torchrun(tmp_path / "restarted", "--kill-at", "12")
    assert restarted.returncode == 0, restarted.stderr[-6000:]
    assert (tmp_path / "restarted" / "killed").exists(), "rank 1 was not killed"
    log = restarted.stdout + restarted.stderr
    assert "Restoring states from the checkpoint path" in log and "last.ckpt" in log, log[-6000:]
    expected = torch.load(tmp_path / "straight" / "params.pt", weights_only=True)
    got = torch.load(tmp_path / "restarted" / "params.pt", weights_only=True)
    assert (expected["restart"], got["restart"]) == (0, 1), "the second run finished after one restart"
    assert got["global_step"] == expected["global_step"] == 24
    assert torch.equal(got["params"], expected["params"])


def _two_agents(out: Path, *args: str) -> list[tuple[int, str]]:
    """Two nodes of two processes on localhost: two ``torchrun`` agents meeting in a c10d rendezvous."""
    out.mkdir()
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    commands = [
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--rdzv-id", run_id, "--max-restarts", "1", str(HERE / "restart_script.py"), "--out", str(out),
         "--num-nodes", "2", *args]
        for node in range(2)
    ]  # fmt: skip
    env = _environment() | {"OMP_NUM_THREADS": "1"} | FRESH_STORE
    return run_together(commands, [env, env], out)


def test_a_worker_killed_mid_epoch_of_a_two_level_run_is_restarted_and_it_ends_as_an_uninterrupted_one(tmp_path):
    """2 nodes x 2 processes, ``hierarchical=True``: rank 2 (the second node's leader in the exchange across
    nodes) dies; both agents restart their workers, which resume from ``last.ckpt`` bit for bit."""
    straight = _two_agents(tmp_path / "straight")
    assert all(rc == 0 for rc, _ in straight), straight[0][1][-6000:] + straight[1][1][-6000:]
    # 4 steps per epoch; the checkpoint at the end of epoch 0 is step 4: rank 2 dies at step 6, in epoch 1
    restarted = _two_agents(tmp_path / "restarted", "--kill-at", "6", "--kill-rank", "2")
    log = restarted[0][1] + restarted[1][1]
    assert all(rc == 0 for rc, _ in restarted), log[-12000:]
    assert (tmp_path / "restarted" / "killed").exists(), "rank 2 was not killed"
    assert "Restoring states from the checkpoint path" in log and "last.ckpt" in log, log[-6000:]
    expected = torch.load(tmp_path / "straight" / "params.pt", weights_only=True)
    got = torch.load(tmp_path / "restarted" / "params.pt", weights_only=True)
    assert expected["two_level"] and got["two_level"]
    assert expected["restarts"] == [0, 0, 0, 0]
    # the rendezvous ranks the agents by (host, pid), so each keeps its node across the restart: the agent of
    # ranks 2 and 3 restarted after a failure; the other one restarted its workers too, counting it (its
    # workers failed first: the collective with rank 2 broke) or not (a node waiting at the rendezvous)
    assert got["restarts"][2:] == [1, 1] and got["restarts"][0] == got["restarts"][1] in (0, 1), got["restarts"]
    assert got["global_step"] == expected["global_step"] == 12
    assert torch.equal(got["params"], expected["params"])
