"""The sharded strategies with a real ``Trainer``: 2 nodes x 2 processes on this machine (``hsdp_script.py``), FSDP2
inside each node, the exchange across the nodes; native HSDP (``fully_shard`` on a 2-D ``(replicate, shard)`` mesh,
Lightning's ``ModelParallelStrategy``) beside it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.lightning.run import run_nodes

pytestmark = pytest.mark.slow

RANKS = range(4)
#: small enough tensors to compress: the script's model has row blocks of a few hundred values
COMPRESSED = {
    "dgc_hsdp": {"density": 0.05, "min_compress_numel": 64},
    "deft_hsdp": {"density": 0.2, "min_compress_numel": 64},
    "powersgd_hsdp": {"matrix_approximation_rank": 2, "start_iter": 2},
}


def _run(out: Path, *args: str, nodes: int = 2) -> None:
    out.mkdir(parents=True, exist_ok=True)
    run_nodes("hsdp_script.py", out, *args, "--nodes", str(nodes), nodes=nodes, per_node=4 // nodes)


def _load(out: Path, run: str) -> list[dict]:
    return [torch.load(out / f"{run}.rank{r}.pt", weights_only=True) for r in RANKS]


def _assert_params_close(a: list[dict], b: list[dict], atol: float) -> None:
    for x, y in zip(a, b, strict=True):
        assert x["params"].keys() == y["params"].keys()
        for name in x["params"]:
            torch.testing.assert_close(x["params"][name], y["params"][name], rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_with_compression_off_the_parameters_equal_native_hsdp(tmp_path: Path, optimizer: str) -> None:
    """DGC at density 1 (exact, no masking) across the nodes, and ``density="auto"`` on one host (which must choose
    dense): after 4 steps every rank's parameters equal native HSDP's within 1e-6 (fp32), with SGD (momentum and
    weight decay taken over by the exchange) and with AdamW (plain error feedback)."""
    _run(tmp_path, "--runs", "native", "dense_hsdp", "auto_hsdp", "--steps", "6", "--optimizer", optimizer)
    native = _load(tmp_path, "native")
    for run in ("dense_hsdp", "auto_hsdp"):
        ours = _load(tmp_path, run)
        _assert_params_close(ours, native, atol=1e-6)
        for r, n in zip(ours, native, strict=True):
            assert r["global_step"] == 6 and r["losses"] == pytest.approx(n["losses"], rel=1e-5)
        assert ours[0]["hook_calls"] == 6 * 4  # every step, every FSDP group (3 blocks and the root)
    assert _load(tmp_path, "auto_hsdp")[0]["stats"]["auto_density"] == 1.0  # one host: dense


def test_accumulation_mixed_precision_and_activation_checkpointing_equal_native_hsdp(tmp_path: Path) -> None:
    """What users combine with FSDP2, all at once: 2 micro-steps per step (the exchange runs once, at the sync step),
    a ``MixedPrecisionPolicy`` of bf16 parameters with an fp32 reduce, and activation checkpointing of the blocks.
    The parameters equal native HSDP's within 1e-6; the exchange's memory is fp32."""
    _run(tmp_path, "--runs", "native", "dense_hsdp", "--steps", "4", "--accumulate", "2", "--mp", "bf16",
         "--checkpointing")  # fmt: skip
    ours, native = _load(tmp_path, "dense_hsdp"), _load(tmp_path, "native")
    _assert_params_close(ours, native, atol=1e-6)
    assert ours[0]["hook_calls"] == 4 * 4  # once per optimizer step, not per micro-step
    assert ours[0]["memory"] and {dtype for dtype, _ in ours[0]["memory"].values()} == {"torch.float32"}


def test_a_bf16_reduce_keeps_fp32_memory_and_ends_within_bf16_rounding_of_native_hsdp(tmp_path: Path) -> None:
    """``reduce_dtype=bf16``: FSDP hands the exchange a bf16 shard; the exchange averages in fp32 (native HSDP
    all-reduces in bf16), so the two differ by bf16 rounding only."""
    _run(tmp_path, "--runs", "native", "dense_hsdp", "--steps", "4", "--mp", "bf16-reduce")
    ours, native = _load(tmp_path, "dense_hsdp"), _load(tmp_path, "native")
    _assert_params_close(ours, native, atol=4e-3)
    assert {dtype for dtype, _ in ours[0]["memory"].values()} == {"torch.float32"}


@pytest.mark.parametrize("run", sorted(COMPRESSED))
def test_every_replica_of_every_shard_agrees_and_the_model_trains(tmp_path: Path, run: str) -> None:
    """Compressed across the nodes: the ranks that hold the same shard hold it bit for bit (the parameters gathered
    inside each node are the same on all 4 ranks), and the loss falls over an epoch (16 steps)."""
    _run(tmp_path, "--runs", run, "--steps", "16", "--options", json.dumps(COMPRESSED[run]))
    ranks = _load(tmp_path, run)
    for rank in ranks[1:]:
        for name, value in ranks[0]["params"].items():
            assert torch.equal(rank["params"][name], value), name
    losses = torch.tensor([r["losses"] for r in ranks]).mean(0)
    assert losses[-4:].mean() < 0.8 * losses[:4].mean(), losses
    assert ranks[0]["stats"]["compression_ratio"] > 2.0


def test_nodes_that_initialise_differently_start_from_node_0s_shards(tmp_path: Path) -> None:
    """Each process initialises the model from its own seed (FSDP2 shards what each holds): the strategy gives
    every node node 0's shards before the first step, as DDP gives every rank rank 0's model, so the replicas agree
    (the rank check after every step would stop ``fit`` otherwise) and train."""
    _run(tmp_path, "--runs", "dgc_hsdp", "--steps", "4", "--unseeded", "--options", json.dumps(COMPRESSED["dgc_hsdp"]))
    ranks = _load(tmp_path, "dgc_hsdp")
    for rank in ranks[1:]:
        assert all(torch.equal(rank["params"][n], ranks[0]["params"][n]) for n in ranks[0]["params"])


def test_resume_is_bit_identical_and_another_layout_is_refused_unless_told(tmp_path: Path) -> None:
    """A checkpoint (torch.distributed.checkpoint's folder, each process's exchange state inside it) resumed at the
    same layout continues bit for bit; on 4 nodes of 1 process the exchange state is refused with the fix, and with
    ``resume_exchange_state=False`` the model and optimizer reshard and training goes on."""
    options = ["--options", json.dumps(COMPRESSED["dgc_hsdp"]), "--samples", "96"]  # an epoch: 3 steps
    _run(tmp_path / "whole", "--runs", "dgc_hsdp", "--steps", "6", "--checkpoint-every", "3", *options)
    checkpoint = tmp_path / "whole" / "dgc_hsdp.ckpt" / "step=3.ckpt"
    assert sorted(p.name for p in (checkpoint / "lightning_dgc.exchange").iterdir())[0].startswith("rank-00000.")
    _run(tmp_path / "resumed", "--runs", "dgc_hsdp", "--steps", "6", "--resume", str(checkpoint), *options)
    whole, resumed = _load(tmp_path / "whole", "dgc_hsdp"), _load(tmp_path / "resumed", "dgc_hsdp")
    for a, b in zip(whole, resumed, strict=True):
        assert a["losses"][3:] == b["losses"]
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
    with pytest.raises(AssertionError, match="saved by a sharded model on 2 node.*resume_exchange_state=False"):
        _run(tmp_path / "other", "--runs", "dgc_hsdp", "--steps", "6", "--resume", str(checkpoint), *options, nodes=4)
    _run(tmp_path / "restarted", "--runs", "dgc_hsdp", "--steps", "6", "--resume", str(checkpoint),
         "--keep-exchange-state", "false", *options, nodes=4)  # fmt: skip
    restarted = _load(tmp_path / "restarted", "dgc_hsdp")
    assert all(r["global_step"] == 6 and len(r["losses"]) == 3 for r in restarted)


def test_misuses_fail_at_setup_with_the_fix(tmp_path: Path) -> None:
    """Each misuse stops ``fit`` at setup, on every rank alike, with an error that says how to fix it; a module
    without ``configure_model`` trains when the strategy is told which classes to shard."""
    tmp_path.mkdir(exist_ok=True)
    run_nodes("hsdp_misuse_script.py", tmp_path)
    seen = [json.loads((tmp_path / f"misuse.rank{r}.json").read_text()) for r in RANKS]
    expected = {
        "no configure_model": ("TypeError", r"was not sharded: add to it\n    def configure_model.*sharded_modules="),
        "blocks only": ("ValueError", r"4 trainable parameter\(s\) are not sharded.*`embed.weight`.*fully_shard"),
        "over the whole world": ("ValueError", r"sharded over the processes \[0, 1, 2, 3\].*node is \[\d, \d\]"),
        "HSDP of FSDP's own": ("ValueError", r"mesh of two dimensions \(HSDP\).*data_parallel"),
        "CPU offload": ("ValueError", r"does not support FSDP2's CPU offload.*Drop the offload policy"),
        "fp16 reduce": ("ValueError", r"reduces its gradients in torch.float16.*reduce_dtype=torch.float32"),
    }
    for rank in seen:
        for case, (kind, pattern) in expected.items():
            assert rank[case].get("error") == kind and re.search(pattern, rank[case]["message"], re.S), rank[case]
        assert rank["sharded_modules"] == {"trained": 3, "sharded": True}


def test_fabric_loops_equal_native_hsdp_agree_across_nodes_and_resume_exactly(tmp_path: Path) -> None:
    """Fabric's door (``fabric_hsdp_script.py``), with a ``parallelize_fn`` written for Fabric's ModelParallelStrategy
    and 2 micro-batches a step under ``no_backward_sync``: compression off equals native HSDP within 1e-6; DGC keeps
    the replicas bit-identical; a loop loaded from ``fabric.save`` at step 3 ends bit for bit where the whole loop
    does; SGD gets its momentum back after the loop."""
    tmp_path.mkdir(exist_ok=True)
    run_nodes("fabric_hsdp_script.py", tmp_path)
    ranks = [torch.load(tmp_path / f"fabric.rank{r}.pt", weights_only=True) for r in RANKS]
    for rank in ranks:
        for name, native in rank["native"]["params"].items():
            torch.testing.assert_close(rank["dense"]["params"][name], native, rtol=0, atol=1e-6)
            assert torch.equal(rank["dgc"]["params"][name], ranks[0]["dgc"]["params"][name])
            assert torch.equal(rank["dgc_loaded"]["params"][name], rank["dgc"]["params"][name])
        assert rank["dgc"]["momentum"] == 0.9
