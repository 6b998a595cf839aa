"""``DGCStrategy(density="auto")`` with 2 real CPU processes: on loopback it measures, goes dense, takes DDP's
own step, and ends where DDP does."""

from __future__ import annotations

import pytest
import torch

from tests.lightning.run import params, results, run_script

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("momentum", ["0", "0.9"])
def test_auto_on_loopback_goes_dense_and_equals_ddp(tmp_path, momentum: str) -> None:
    sgd = ("--momentum", momentum, "--max-steps", "15")
    run_script("fit_script.py", tmp_path / "ddp", "--strategy", "ddp", *sgd)
    run_script("fit_script.py", tmp_path / "auto", "--density", "auto", *sgd)
    for summary in results(tmp_path / "auto"):
        last = summary["stats"][-1]
        assert last["auto_measuring"] is False, "the measuring phase did not end"
        assert last["auto_density"] == 1.0 and last["density"] == 1.0
        assert last["k"] == 0 and last["compression_ratio"] == pytest.approx(1.0)  # nothing selected: DDP's bytes
        assert last["measured_exchange_ms"] > 0 and last["compute_window_ms"] > 0
        assert all(s["density"] == 1.0 for s in summary["stats"])
        assert all(s["ddp_step"] for s in summary["stats"]), "DDP's own step from the first"
        momentum_free = summary["records"][-1]
        assert momentum_free["velocity_sum"] == 0.0, "a dense exchange holds nothing back"
    for rank in (0, 1):  # DDP's own step from the first: DDP's weights, bit for bit
        assert torch.equal(params(tmp_path / "auto", rank), params(tmp_path / "ddp", rank))
