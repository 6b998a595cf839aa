"""Ranks that stop agreeing raise on every rank with an error that names what differs, instead of training on
silently (parameters) or blocking in the exchange until the process group's timeout (settings)."""

from __future__ import annotations

import time

import pytest
import torch

from lightning_dgc.exchange.agreement import check_ranks_every_value, check_same_on_every_rank, rank_check_due
from tests.lightning.run import params, results, run_script


def test_hierarchical_differing_between_ranks_names_the_option_and_every_rank_s_value() -> None:
    everyone = ["auto", "auto", "auto", False]  # what every rank gathers: each raises the same error
    with pytest.raises(ValueError, match=r"`hierarchical` differs between ranks \(rank 0: 'auto', .* rank 3: False\)"):
        check_same_on_every_rank("hierarchical", "auto", "DGCStrategy", everyone)
    with pytest.raises(ValueError, match=r"rank 0: True, rank 1: 1"):  # True == 1, but not the same option
        check_same_on_every_rank("hierarchical", True, "DGCStrategy", [True, 1])
    check_same_on_every_rank("hierarchical", True, "DGCStrategy", [True, True])


def test_check_ranks_every_is_validated() -> None:
    assert check_ranks_every_value(None) == 0 and check_ranks_every_value(5) == 5
    with pytest.raises(ValueError, match="check_ranks_every"):
        check_ranks_every_value(-1)


def test_the_ranks_are_checked_early_then_every_check_ranks_every_steps() -> None:
    due = [step for step in range(1, 401) if rank_check_due(step, 100)]
    assert due == [1, 2, 4, 8, 16, 32, 64, 100, 200, 300, 400]
    assert [step for step in range(1, 13) if rank_check_due(step, 5)] == [1, 2, 4, 5, 10]
    assert [step for step in range(1, 5) if rank_check_due(step, 1)] == [1, 2, 3, 4]
    assert not any(rank_check_due(step, 0) for step in range(1, 200))  # None or 0: off


@pytest.mark.slow
def test_ranks_that_diverge_stop_on_every_rank_by_step_2_naming_the_parameters(tmp_path, monkeypatch) -> None:
    """Draws seeded with hash(name): each process has its own hash salt, so the ranks' parameters drift apart; with
    the default ``check_ranks_every`` the run stops within its first two steps, not at step 100."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)  # every rank draws its own salt
    out = tmp_path / "hash"
    proc = run_script(  # fresh interpreters: ranks forked from one process would share its salt
        "ranks_script.py", out, "--strategy", "hashseeded_randomk", "--density", "0.1", check=False,
        launcher="external",
    )  # fmt: skip
    assert proc.returncode != 0
    for rank in (0, 1):
        stderr = (out.parent / f"hash.rank{rank}.stderr").read_text()
        errors = [line for line in stderr.splitlines() if "parameters differ after optimizer step" in line]
        assert errors, f"rank {rank} did not name the divergence: {stderr[-2000:]}"
        step = int(errors[-1].split("after optimizer step ")[1].split(":")[0])
        assert step <= 2 and "ranks [1] differ from rank 0" in errors[-1] and "hash()" in errors[-1]
        assert "`net.0.weight`" in errors[-1], errors[-1]  # the first layer's weight is drawn differently


@pytest.mark.slow
def test_a_normal_run_passes_every_rank_check(tmp_path) -> None:
    out = tmp_path / "ok"
    run_script("ranks_script.py", out, "--check-ranks-every", "2")
    assert [r["global_step"] for r in results(out)] == [8, 8]
    assert torch.equal(params(out, 0), params(out, 1))


@pytest.mark.slow
@pytest.mark.parametrize("density", ["0.01", "1"])  # 1: in DDP's own step when rank 0 changes it
def test_density_set_on_one_rank_mid_run_raises_on_every_rank_within_seconds(tmp_path, density: str) -> None:
    out = tmp_path / "density"
    start = time.monotonic()
    proc = run_script("ranks_script.py", out, "--density", density, "--density-on", "0:3:0.5", "--timeout", "120",
                      check=False)  # fmt: skip
    assert proc.returncode != 0 and time.monotonic() - start < 100  # not the process group's timeout
    for rank in (0, 1):
        stderr = (out.parent / f"density.rank{rank}.stderr").read_text()
        want = f"`density` differs between ranks at step 3 (rank 0: 0.5, rank 1: {density})"
        assert want in stderr, stderr[-3000:]
