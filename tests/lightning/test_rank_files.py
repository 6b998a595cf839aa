"""Every rank writes its own exchange state beside the checkpoint: layout, rotation, bad files, the single-file
form, and checkpoints without the exchange memory. Real Trainers on 2 ranks, checkpoints on disk."""

from __future__ import annotations

import shutil

import pytest
import torch

from lightning_dgc.checkpoint.exchange import inline_exchange_state
from tests.lightning.run import launch_ranks, results, run_script
from tests.lightning.test_no_silent_stall import _wait
from tests.lightning.test_resume import _assert_memory_equal, _memory

pytestmark = pytest.mark.slow


def _one_rank_resume(tmp_path, ckpt, name: str) -> str:
    proc = run_script("fit_script.py", tmp_path / name, "--devices", "1", "--max-steps", "8", "--resume", str(ckpt),
                      check=False)  # fmt: skip
    assert proc.returncode != 0, f"{name}: resumed from a damaged checkpoint"
    return proc.stderr


def test_rank_files_rotate_resume_from_one_file_and_refuse_damage(tmp_path) -> None:
    run, ckpt = tmp_path / "run", tmp_path / "six.ckpt"
    run_script("fit_script.py", run, "--max-steps", "6", "--ckpt-every", "2", "--top-k", "1", "--dump-memory",
               "--save-ckpt", str(ckpt))  # fmt: skip

    # save_top_k=1 kept one checkpoint besides last.ckpt, and their rank folders only; each folder holds the
    # files its manifest names (last.ckpt was saved three times: the earlier saves' files are gone)
    folder = run.parent / "run.ckpts"
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["epoch=0-step=6.ckpt", "epoch=0-step=6.ckpt.exchange", "last.ckpt", "last.ckpt.exchange"], names
    for name in ("epoch=0-step=6.ckpt", "last.ckpt"):
        manifest = torch.load(folder / name, weights_only=True)["lightning_dgc"]
        assert manifest["step"] == 6 and len(manifest["files"]) == 2
        assert sorted(p.name for p in (folder / f"{name}.exchange").iterdir()) == [f["name"] for f in manifest["files"]]

    # the single-file form (every rank's state in the entry, as earlier versions wrote) resumes bit for bit
    single = tmp_path / "single.ckpt"
    torch.save(inline_exchange_state(ckpt), single)
    assert torch.load(single, weights_only=True)["lightning_dgc"]["format"] == 2
    resumed = tmp_path / "resumed"
    run_script("fit_script.py", resumed, "--max-steps", "8", "--dump-memory", "--resume", str(single))
    for r in range(2):
        _assert_memory_equal(_memory(resumed, r, "start"), _memory(run, r, "end"))
    assert all(s["global_step"] == 8 for s in results(resumed))

    exchange = tmp_path / "six.ckpt.exchange"
    files = sorted(exchange.iterdir())
    whole = [f.read_bytes() for f in files]
    fix = "copy or move it with the file"

    # a rank file from another save or run: the manifest's hash does not match
    files[1].write_bytes(whole[0])
    stderr = _one_rank_resume(tmp_path, ckpt, "foreign")
    assert f"the rank file {str(files[1])!r} does not match the manifest's SHA-256" in stderr and fix in stderr

    # a truncated rank file
    files[1].write_bytes(whole[1][: len(whole[1]) // 2])
    stderr = _one_rank_resume(tmp_path, ckpt, "truncated")
    assert f"the rank file {str(files[1])!r} has {len(whole[1]) // 2} bytes, the manifest says {len(whole[1])}" in stderr
    files[1].write_bytes(whole[1])

    # a manifest that names more ranks than there are files
    checkpoint = torch.load(ckpt, weights_only=True)
    manifest = checkpoint["lightning_dgc"]
    extra = [dict(f, name=f["name"].replace("rank-0000", "rank-0001")) for f in manifest["files"]]
    manifest |= {"world_size": 4, "files": manifest["files"] + extra, "topology": manifest["topology"] | {"nodes": 4}}
    torch.save(checkpoint, tmp_path / "four.ckpt")
    shutil.copytree(exchange, tmp_path / "four.ckpt.exchange")
    stderr = _one_rank_resume(tmp_path, tmp_path / "four.ckpt", "four")
    assert "names 4 rank files of exchange state" in stderr
    assert f"the rank file {str(tmp_path / 'six.ckpt.exchange' / extra[1]['name'])!r} is missing" in stderr

    # a missing rank file: an error on every rank (each reads its own file only), before any step
    files[0].unlink()
    ranks = launch_ranks("fit_script.py", tmp_path / "missing", "--max-steps", "8", "--resume", str(ckpt),
                         "--log-steps")  # fmt: skip
    for rank, (returncode, stdout, stderr) in enumerate(_wait(ranks)):
        assert returncode != 0, f"rank {rank} trained on:\n{stdout[-2000:]}"
        assert f"the rank file {str(files[0])!r} is missing" in stderr and fix in stderr, stderr[-3000:]
        assert f"rank {rank} step" not in stdout, "a step was taken before the check"


def test_a_checkpoint_without_the_exchange_memory_resumes_from_empty_residuals_with_a_warning(tmp_path) -> None:
    ckpt = tmp_path / "four.ckpt"
    run_script("fit_script.py", tmp_path / "first", "--strategy", "dgc", "--no-exchange-state", "--max-steps", "4",
               "--save-ckpt", str(ckpt))  # fmt: skip
    checkpoint = torch.load(ckpt, weights_only=True)
    assert checkpoint["lightning_dgc"]["files"] is None and not (tmp_path / "four.ckpt.exchange").exists()
    state = checkpoint["optimizer_states"][0]["state"]
    assert state and all("momentum_buffer" in s for s in state.values()), "the mean momentum, as SGD's buffers"
    resumed = tmp_path / "resumed"
    proc = run_script("fit_script.py", resumed, "--max-steps", "6", "--dump-memory", "--resume", str(ckpt))
    assert "saved without the exchange memory (save_exchange_state=False)" in proc.stderr + proc.stdout
    assert "continued SGD's momentum buffers" in proc.stderr + proc.stdout
    for r in range(2):
        start = _memory(resumed, r, "start")
        assert not start.get("velocity") and start["momentum"], "residuals from zero, momentum carried on"
    assert all(s["global_step"] == 6 for s in results(resumed))
