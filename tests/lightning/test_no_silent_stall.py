"""On 2 real processes: a stalled run stops on every rank, and a checkpoint whose exchange state
does not fit the run is refused on every rank before the first step (never a silent reset or stall)."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_dgc.checkpoint.exchange import inline_exchange_state
from tests.lightning.run import Rank, launch_ranks, results, run_script

pytestmark = pytest.mark.slow


def _wait(ranks: list[Rank], timeout: float = 180) -> list[tuple[int, str, str]]:
    """Every rank's ``(returncode, stdout, stderr)`` (what is left running after ``timeout`` is killed)."""
    done = []
    try:
        for rank in ranks:
            done.append((rank.process.wait(timeout=timeout), *rank.output()))
    finally:
        for rank in ranks:
            rank.stop()
    return done


def test_a_run_that_skips_step_after_step_stops_on_every_rank_and_a_scaler_backing_off_does_not(tmp_path) -> None:
    """Rank 1's loss is inf from step 2 on: every step from then is skipped, on both ranks; with
    ``max_consecutive_skips=3`` both ranks raise after step 4, naming the count and the cause."""
    ranks = launch_ranks("fit_script.py", tmp_path / "stall", "--inf-from", "1:2", "--max-skips", "3",
                         "--max-steps", "30", "--log-steps")  # fmt: skip
    for rank, (returncode, stdout, stderr) in enumerate(_wait(ranks)):
        assert returncode != 0, f"rank {rank} did not stop:\n{stderr[-2000:]}"
        assert "the last 3 optimizer steps (up to step 4) were all skipped because the gradients exchanged" \
            " were not finite" in stderr, stderr[-3000:]
        assert "max_consecutive_skips" in stderr and f"rank {rank} step 5" not in stdout
    # Under a GradScaler the skipped steps are the scaler's (it lowers its scale): not a stall of the strategy.
    run_script("fit_script.py", tmp_path / "amp", "--fp16-scaler", "--inf-from", "1:2", "--max-skips", "3",
               "--max-steps", "8")  # fmt: skip
    for summary in results(tmp_path / "amp"):
        assert summary["global_step"] == 8 and summary["records"][-1]["scale"] < 2.0**10 / 2**4


def test_a_nan_buffer_of_one_rank_stops_both_ranks_before_the_first_step(tmp_path) -> None:
    ckpt = tmp_path / "four.ckpt"
    run_script("fit_script.py", tmp_path / "four", "--max-steps", "4", "--save-ckpt", str(ckpt))
    checkpoint = inline_exchange_state(ckpt)  # the single-file form, every rank's state in the entry
    checkpoint["lightning_dgc"]["ranks"][1]["memory"]["velocity"]["net.0.weight"][5] = float("nan")
    torch.save(checkpoint, ckpt)
    ranks = launch_ranks("fit_script.py", tmp_path / "resumed", "--max-steps", "8", "--resume", str(ckpt),
                         "--log-steps")  # fmt: skip
    for rank, (returncode, stdout, stderr) in enumerate(_wait(ranks)):
        assert returncode != 0, f"rank {rank} trained on:\n{stdout[-2000:]}"
        assert "rank 1: the checkpoint's 'velocity' buffer of parameter 'net.0.weight' holds NaN or inf" in stderr
        assert f"rank {rank} step" not in stdout, "a step was taken before the check"
    # A malformed entry (fewer rank states than it says) is named, not an IndexError, at any world size.
    checkpoint["lightning_dgc"]["ranks"] = checkpoint["lightning_dgc"]["ranks"][:1]
    torch.save(checkpoint, ckpt)
    proc = run_script("fit_script.py", tmp_path / "one", "--devices", "1", "--max-steps", "8", "--resume",
                      str(ckpt), check=False)  # fmt: skip
    assert proc.returncode != 0
    assert "checkpoint['lightning_dgc'] says it was written by world_size=2 ranks but holds 1 rank states" \
        in proc.stderr, proc.stderr[-2000:]


def test_powersgd_refuses_to_resume_with_another_matrix_approximation_rank(tmp_path) -> None:
    def powersgd(rank: int) -> tuple[str, ...]:
        return ("--strategy", "powersgd", "--options",
                json.dumps({"matrix_approximation_rank": rank, "start_iter": 2}))  # fmt: skip

    ckpt = tmp_path / "five.ckpt"
    run_script("fit_script.py", tmp_path / "five", *powersgd(2), "--max-steps", "5", "--save-ckpt", str(ckpt))
    for other in (1, 3):  # once a silent cold restart of Q, once a shape error from backward
        proc = run_script("fit_script.py", tmp_path / f"rank{other}", *powersgd(other), "--max-steps", "8",
                          "--resume", str(ckpt), check=False)  # fmt: skip
        assert proc.returncode != 0
        assert f"made with matrix_approximation_rank=2, this run has matrix_approximation_rank={other}" in proc.stderr
        assert "Resume with matrix_approximation_rank=2" in proc.stderr
