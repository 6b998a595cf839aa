"""``HSDPDiLoCoStrategy`` (``"diloco_hsdp"``) with a real ``Trainer`` on 2 nodes x 2 CPU processes (gloo): one
synchronous step equals native HSDP, DiLoCo on shards equals the replicated DiLoCo, replicas agree after every outer
step, each process holds one shard's outer state, checkpoints resume exactly (and reshard on another layout), and the
bad inputs raise on every rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_dgc.local_steps.hsdp import MOMENTUM_FOLDER, OUTER_FILES
from tests.lightning.run import run_nodes

pytestmark = pytest.mark.slow

SCRIPT = "diloco_hsdp_script.py"
OPTIONS = json.dumps({
    "dgc": {"density": 0.1, "min_compress_numel": 16},
    "powersgd": {"matrix_approximation_rank": 1, "start_iter": 2, "min_compression_rate": 1.0},
})  # fmt: skip


def records(out: Path, run: str, world: int = 4) -> list[dict]:
    return [torch.load(out / f"{run}.rank{r}.pt", weights_only=False) for r in range(world)]


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_one_synchronous_outer_step_equals_native_hsdp(tmp_path) -> None:
    """With ``sync_every=1``, outer lr 1 and no outer momentum, the outer step sets the weights to the nodes' mean of
    their local weights. Every node started the step from the same weights and SGD's update is linear in the
    gradient (momentum and weight decay included), so that mean is one SGD step on the mean gradient: native HSDP's.
    Both accumulate 2 micro-batches per step (here FSDP2 reduce-scatters once per step, on their sum)."""
    out = tmp_path / "out"
    run_nodes(SCRIPT, out, "--runs", "native", "diloco_hsdp", "--sync-every", "1", "--outer-lr", "1",
              "--outer-momentum", "0", "--steps", "4", "--accumulate", "2")  # fmt: skip
    native, sharded = records(out, "native"), records(out, "diloco_hsdp")
    for mine, theirs in zip(sharded, native, strict=True):
        assert mine["outer_steps"] == 4 and mine["identical"] == [True] * 4
        assert max_difference(mine["full"], theirs["full"]) <= 1e-6
        assert mine["losses"] == pytest.approx(theirs["losses"], abs=1e-6)


def test_replicas_agree_after_every_outer_step_and_each_process_holds_one_shard_of_outer_state(tmp_path) -> None:
    """Dense, DGC at 0.1 and PowerSGD (rank 1) outer exchanges on shards, 3 outer steps of 3 inner steps: after each
    outer step every shard equals its replicas on the other nodes, and the loss falls. The dense run equals the
    replicated ``"diloco"`` (DDP inside the node): its outer step is elementwise, so running it shard by shard changes
    nothing. The outer state per process (global weights, outer momentum, exchange memory) is about half of
    ``"diloco"``'s at 2 processes per node."""
    out = tmp_path / "out"
    runs = ("diloco_hsdp", "diloco", "diloco_hsdp@dgc", "diloco@dgc", "diloco_hsdp@powersgd")
    run_nodes(SCRIPT, out, "--runs", *runs, "--options", OPTIONS, "--steps", "9", "--sync-every", "3")
    for run in ("diloco_hsdp", "diloco_hsdp_dgc", "diloco_hsdp_powersgd"):
        ranks = records(out, run)
        for record in ranks:
            assert record["outer_steps"] == 3 and record["identical"] == [True, True, True], run
        losses = torch.tensor([record["losses"] for record in ranks])
        assert losses[:, -3:].mean() < 0.7 * losses[:, :3].mean(), run
    compressed = records(out, "diloco_hsdp_powersgd")[0]["stats"]
    assert compressed["algorithm"] == "powersgd" and compressed["outer_bytes_sent"] < compressed["dense_bytes"]

    sharded, replicated = records(out, "diloco_hsdp"), records(out, "diloco")
    for mine, theirs in zip(sharded, replicated, strict=True):
        assert max_difference(mine["full"], theirs["full"]) <= 1e-6
    for run in ("", "_dgc"):
        mine = max(r["state_bytes"] for r in records(out, f"diloco_hsdp{run}"))
        theirs = max(r["state_bytes"] for r in records(out, f"diloco{run}"))
        model = 4 * sum(t.numel() for t in replicated[0]["full"].values())
        assert theirs >= 2 * model  # global weights and outer momentum, whole (and DGC's memory)
        assert mine <= 0.55 * theirs, (run, mine, theirs)


def test_resume_is_exact_on_the_same_layout_and_resharded_on_another(tmp_path) -> None:
    """AdamW inside, DGC's outer exchange, ``sync_every=2``, a checkpoint after step 3 (mid-round, at the end of an
    epoch): resumed, the run ends bit-identical to the uninterrupted one. Resumed by 1 node of 4 processes, the
    model holds the checkpoint's global weights and the outer momentum is resharded, both equal to what the
    2 x 2 processes held."""
    full, resumed, other = tmp_path / "full", tmp_path / "resumed", tmp_path / "other"
    common = ("--runs", "diloco_hsdp@dgc", "--options", OPTIONS, "--optimizer", "adamw", "--samples", "96")
    run_nodes(SCRIPT, full, *common, "--steps", "6", "--checkpoint-every", "3")
    checkpoint = full / "diloco_hsdp_dgc.ckpt" / "step=3.ckpt"
    run_nodes(SCRIPT, resumed, *common, "--steps", "6", "--resume", str(checkpoint))
    for a, b in zip(records(full, "diloco_hsdp_dgc"), records(resumed, "diloco_hsdp_dgc"), strict=True):
        assert a["losses"][3:] == b["losses"] and b["global_step"] == 6
        assert all(torch.equal(a["shards"][n], b["shards"][n]) for n in a["shards"])
        assert all(torch.equal(a["momentum"][n], b["momentum"][n]) for n in a["momentum"])
        assert a["stats"]["link_bytes_per_step"] == b["stats"]["link_bytes_per_step"]

    proc = run_nodes(SCRIPT, other, *common, "--steps", "3", "--resume", str(checkpoint), "--nodes", "1",
                     "--per-node", "4", nodes=1, per_node=4)  # fmt: skip
    assert "is resumed by 1 x 4" in proc.stderr + proc.stdout
    dcp_to_torch_save(checkpoint, tmp_path / "model.pt")
    dcp_to_torch_save(checkpoint / MOMENTUM_FOLDER, tmp_path / "momentum.pt")
    model = torch.load(tmp_path / "model.pt", weights_only=False)["state_dict"]
    momentum = torch.load(tmp_path / "momentum.pt", weights_only=False)["outer_momentum"]
    files = sorted((checkpoint / f"{OUTER_FILES}.exchange").iterdir())
    node0 = [torch.load(f, weights_only=True)["outer"] for f in files[:2]]  # ranks 0 and 1: node 0's shards
    ranks = records(other, "diloco_hsdp_dgc")
    for i, name in enumerate(node0[0]["names"]):
        saved_global = torch.cat([s["global"][name] for s in node0])
        saved_momentum = torch.cat([s["outer_optimizer"]["state"][i]["momentum_buffer"] for s in node0])
        assert torch.equal(model[name], saved_global) and torch.equal(momentum[name], saved_momentum)
        assert torch.equal(ranks[0]["full"][name], saved_global)
        resharded = torch.cat([r["momentum"][name] for r in ranks if name in r["momentum"]])
        assert torch.equal(resharded, saved_momentum)


def test_bad_inputs_raise_on_every_rank(tmp_path) -> None:
    out = tmp_path / "out"
    run_nodes(SCRIPT, out, "--bad")
    expected = {
        "not sharded": "was not sharded: add to it",
        "HSDP mesh": "sharded on a mesh of two dimensions (HSDP)",
        "CPU offload": "does not support FSDP2's CPU offload",
        "node across hosts": "run on different hosts",
        "ranks not node by node": "needs global ranks numbered node by node",
    }
    for rank in range(4):
        errors = json.loads((out / f"bad.rank{rank}.json").read_text())
        assert errors.keys() == expected.keys()
        for case, words in expected.items():
            assert words in errors[case] and errors[case].startswith(("TypeError", "ValueError")), (case, errors[case])
