"""``Trainer(strategy="dgc")`` with 2 real CPU processes through Lightning's own popen launcher (the refusal
and DEFT's run fork their ranks from the test's pre-imported process: the launcher is not what they check)."""

from __future__ import annotations

import pytest
import torch

from tests.lightning.run import params, results, run_script

pytestmark = pytest.mark.slow


def test_fit_with_strategy_string_registers_and_calls_the_hook(tmp_path) -> None:
    out = tmp_path / "dgc"
    run_script("fit_script.py", out, "--strategy", "dgc", "--max-steps", "40", launcher="popen")
    summary = results(out)
    for s in summary:
        assert s["strategy"] == "DGCStrategy" and s["world_size"] == 2
        assert s["hook_calls"] >= 40  # one call per bucket per step
        assert all(r["sgd_momentum"] == [0.0] for r in s["records"]), "DGC applies SGD's momentum, not SGD"
        assert s["optimizer_momentum"] == [0.9], "after fit the optimizer holds the user's momentum again"
        last = s["stats"][-1]
        assert last["density"] == 0.001
        assert last["compression_ratio"] > 5
        assert last["bytes_sent"] < last["dense_bytes"]
    assert summary[0]["pid"] != summary[1]["pid"]
    assert torch.equal(params(out, 0), params(out, 1)), "ranks ended with different parameters"
    losses = summary[0]["losses"]
    assert sum(losses[-10:]) < sum(losses[:10])


def test_density_one_through_lightning_equals_ddp(tmp_path) -> None:
    """Same seed, same data: DGCStrategy(density=1) with plain SGD ends where strategy='ddp' does."""
    sgd = ("--momentum", "0", "--max-steps", "15")
    run_script("fit_script.py", tmp_path / "ddp", "--strategy", "ddp", *sgd, launcher="popen")
    run_script("fit_script.py", tmp_path / "dgc", "--density", "1.0", *sgd, launcher="popen")
    torch.testing.assert_close(params(tmp_path / "dgc", 0), params(tmp_path / "ddp", 0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["rmsprop"])
def test_optimizer_with_its_own_momentum_is_rejected(tmp_path, optimizer: str) -> None:
    proc = run_script("fit_script.py", tmp_path / "bad", "--optimizer", optimizer, "--max-steps", "2", check=False)
    assert proc.returncode != 0
    assert "would apply it a second time" in proc.stderr


def test_fit_with_deft_shares_selection_without_buildup(tmp_path) -> None:
    out = tmp_path / "deft"
    run_script("fit_script.py", out, "--strategy", "deft", "--max-steps", "40")
    summary = results(out)
    for s in summary:
        assert s["strategy"] == "DEFTStrategy" and s["hook_calls"] >= 40
        assert s["optimizer_momentum"] == [0.9], "DEFT leaves momentum to the optimizer"
        assert all(r["sgd_momentum"] == [0.9] for r in s["records"])
        last = s["stats"][-1]
        assert last["buildup_factor"] == 1.0 and last["compression_ratio"] > 5
        assert len(last["rank_selection_ms"]) == 2 and last["max_rank_selection_ms"] >= 0
    assert sum(s["stats"][-1]["rank_selected"] for s in summary) == summary[0]["stats"][-1]["k"]
    assert torch.equal(params(out, 0), params(out, 1))
    losses = summary[0]["losses"]
    assert sum(losses[-10:]) < sum(losses[:10])
