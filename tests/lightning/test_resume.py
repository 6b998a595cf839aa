"""Resume keeps every rank's memory: real checkpoints on disk, fresh processes, direct buffer comparison."""

from __future__ import annotations

import glob
import json

import pytest
import torch

from lightning_dgc.checkpoint.exchange import inline_exchange_state
from tests.lightning.run import params, results, run_script

pytestmark = pytest.mark.slow


def _memory(prefix, rank: int, tag: str) -> dict:
    return torch.load(f"{prefix}.rank{rank}.{tag}.pt", weights_only=True)


def _assert_memory_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and "velocity" in a
    for kind in a:
        assert a[kind].keys() == b[kind].keys()
        for name in a[kind]:
            assert torch.equal(a[kind][name], b[kind][name]), f"{kind}/{name} differs"


@pytest.mark.parametrize("strategy", ["dgc", "deft"])
def test_each_rank_gets_its_own_memory_back_bit_for_bit(tmp_path, strategy: str) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    ckpt = tmp_path / "step10.ckpt"
    s = ("--strategy", strategy)
    run_script("fit_script.py", first, *s, "--max-steps", "10", "--dump-memory", "--save-ckpt", str(ckpt))
    # Rank 0's file holds the manifest; each rank's buffers are in its own file beside it, and every file loads
    # without unpickling arbitrary objects.
    manifest = torch.load(ckpt, weights_only=True)["lightning_dgc"]
    assert manifest["format"] == 3 and manifest["world_size"] == 2 and manifest["step"] == 10
    files = sorted(p.name for p in (tmp_path / "step10.ckpt.exchange").iterdir())
    assert files == [f["name"] for f in manifest["files"]] and files[0].startswith("rank-00000.")
    entry = inline_exchange_state(ckpt)["lightning_dgc"]
    assert entry["algorithm"] == strategy and entry["world_size"] == 2 and len(entry["ranks"]) == 2
    for r in range(2):
        _assert_memory_equal(entry["ranks"][r]["memory"], _memory(first, r, "end"))
    velocity = entry["ranks"][0]["memory"]["velocity"]
    assert any(not torch.equal(velocity[n], entry["ranks"][1]["memory"]["velocity"][n]) for n in velocity)

    run_script("fit_script.py", second, *s, "--max-steps", "14", "--dump-memory", "--resume", str(ckpt))
    for r in range(2):
        _assert_memory_equal(_memory(second, r, "start"), _memory(first, r, "end"))
    assert all(s["global_step"] == 14 for s in results(second))
    if strategy == "deft":  # a DEFT checkpoint is refused by DGC: its residuals mean something else
        proc = run_script(
            "fit_script.py", tmp_path / "x", "--max-steps", "12", "--resume", str(ckpt), check=False
        )
        assert proc.returncode != 0 and "holds the exchange state of 'deft'" in proc.stderr


def test_a_checkpoint_that_lost_one_parameters_buffers_is_refused_and_the_unmodified_one_resumes(tmp_path) -> None:
    ckpt, damaged = tmp_path / "step6.ckpt", tmp_path / "damaged.ckpt"
    run_script("fit_script.py", tmp_path / "first", "--max-steps", "6", "--save-ckpt", str(ckpt))
    saved = inline_exchange_state(ckpt)  # the single-file form, which resumes as well
    for state in saved["lightning_dgc"]["ranks"]:
        assert "net.2.weight" in state["memory"]["velocity"]
        for by_name in state["memory"].values():
            del by_name["net.2.weight"]
    torch.save(saved, damaged)
    proc = run_script("fit_script.py", tmp_path / "x", "--max-steps", "8", "--resume", str(damaged), check=False)
    assert proc.returncode != 0
    assert "['memory'] lacks buffers that the run which wrote it kept" in proc.stderr
    assert "'velocity' of 'net.2.weight'" in proc.stderr and "'momentum' of 'net.2.weight'" in proc.stderr
    assert "delete checkpoint['lightning_dgc'] to start the exchange with empty buffers" in proc.stderr
    resumed = tmp_path / "resumed"
    run_script("fit_script.py", resumed, "--max-steps", "8", "--resume", str(ckpt))
    assert all(s["global_step"] == 8 for s in results(resumed))


def test_resuming_from_a_truncated_checkpoint_is_an_error_naming_the_file_and_the_fix(tmp_path) -> None:
    whole, cut = tmp_path / "whole.ckpt", tmp_path / "last.ckpt"
    torch.save({"state_dict": {"net.0.weight": torch.zeros(64, 32)}, "global_step": 4}, whole)
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])  # the end of the archive is lost
    proc = run_script("fit_script.py", tmp_path / "x", "--devices", "1", "--max-steps", "6", "--resume", str(cut),
                      check=False)  # fmt: skip
    assert proc.returncode != 0
    assert f"The checkpoint '{cut}' is incomplete or damaged" in proc.stderr
    assert "Resume from an earlier checkpoint (ckpt_path=<another file>), or delete this file" in proc.stderr


def test_resume_on_another_world_size_gives_every_rank_the_mean(tmp_path) -> None:
    first, single = tmp_path / "first", tmp_path / "single"
    ckpt = tmp_path / "two_ranks.ckpt"
    run_script("fit_script.py", first, "--max-steps", "6", "--dump-memory", "--save-ckpt", str(ckpt))
    proc = run_script(
        "fit_script.py", single, "--devices", "1", "--max-steps", "8", "--dump-memory", "--resume", str(ckpt)
    )
    assert "resumed by 1" in proc.stderr + proc.stdout
    restored = _memory(single, 0, "start")
    saved = [_memory(first, r, "end") for r in range(2)]
    assert restored.keys() == saved[0].keys()
    for kind in restored:
        for name, t in restored[kind].items():
            torch.testing.assert_close(t, (saved[0][kind][name] + saved[1][kind][name]) / 2)


def test_killed_rank_resumes_from_last_checkpoint_and_finishes(tmp_path) -> None:
    run = tmp_path / "run"
    proc = run_script(
        "fit_script.py",
        run,
        "--max-steps",
        "20",
        "--ckpt-every",
        "5",
        "--kill",
        "1:12",
        timeout=180,
        check=False,
    )
    assert proc.returncode != 0, "the run should have died with its rank"
    ckpts = sorted(glob.glob(f"{run}.ckpts/*.ckpt"))
    assert any("last" in c for c in ckpts), ckpts
    last = inline_exchange_state(f"{run}.ckpts/last.ckpt")
    assert last["global_step"] == 10 and len(last["lightning_dgc"]["ranks"]) == 2
    resumed = tmp_path / "resumed"
    run_script(
        "fit_script.py", resumed, "--max-steps", "20", "--dump-memory", "--resume", f"{run}.ckpts/last.ckpt"
    )
    assert all(s["global_step"] == 20 for s in results(resumed))
    for r in range(2):
        _assert_memory_equal(_memory(resumed, r, "start"), last["lightning_dgc"]["ranks"][r]["memory"])


def test_checkpoint_of_plain_ddp_resumes_with_empty_memory(tmp_path) -> None:
    ckpt = tmp_path / "ddp.ckpt"
    run_script(
        "fit_script.py", tmp_path / "ddp", "--strategy", "ddp", "--max-steps", "4", "--save-ckpt", str(ckpt)
    )
    proc = run_script(
        "fit_script.py", tmp_path / "dgc", "--max-steps", "6", "--dump-memory", "--resume", str(ckpt)
    )
    assert "holds no DGCStrategy state" in proc.stderr + proc.stdout


def test_saving_a_checkpoint_costs_rank_zero_what_ddp_s_does_and_other_ranks_nothing(tmp_path) -> None:
    """Peak extra resident memory during save_checkpoint (benchmarks.checkpoint_memory, 4M parameters): rank 0
    holds what DDP's checkpoint holds (parameters and SGD momentum, the exchange's mean momentum written as it,
    2 model sizes) plus at most 10%; every rank writes its own exchange memory as it is, without a copy."""
    from benchmarks.checkpoint_memory import measure

    for rank in measure("dgc", 4e6, steps=3, folder=tmp_path):
        bound = 2.2 if rank["rank"] == 0 else 0.25  # (a rank file is hashed 1 MiB at a time)
        assert rank["save_peak_model_sizes"] <= bound, rank
        assert rank["training_model_sizes"] < 20, rank  # a sanity check of the measurement itself


def test_small_every_resumed_between_two_sends_ends_where_the_straight_run_does(tmp_path) -> None:
    """``small_every=3`` under a real ``Trainer``: the small tensors (biases, the 256-weight last layer) go out in
    steps 0, 3 and 6 only; a checkpoint after step 4 holds what they gathered since step 3, and the run resumed
    from it ends bit for bit where the straight run does, on both ranks."""
    s = ("--options", json.dumps({"density": 0.1, "small_every": 3}), "--samples", "32", "--no-shuffle")
    run_script("fit_script.py", tmp_path / "straight", *s, "--max-steps", "8")
    dense = [stats["dense_exchange_bytes"] for stats in results(tmp_path / "straight")[0]["stats"]]
    assert [step for step, sent in enumerate(dense) if sent] == [0, 3, 6] and len(dense) == 8, dense
    ckpt = tmp_path / "step5.ckpt"
    run_script("fit_script.py", tmp_path / "first", *s, "--max-steps", "5", "--save-ckpt", str(ckpt))
    run_script("fit_script.py", tmp_path / "resumed", *s, "--max-steps", "8", "--resume", str(ckpt))
    for rank in range(2):
        assert torch.equal(params(tmp_path / "resumed", rank), params(tmp_path / "straight", 0))
