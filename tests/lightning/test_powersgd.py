"""``Trainer(strategy="powersgd")``: registered on the CPU too, and resumable exactly from a checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_dgc.checkpoint.exchange import inline_exchange_state
from tests.lightning.run import params, results, run_script

pytestmark = pytest.mark.slow

#: One step per epoch (32 samples, 16 per batch and rank): a resumed run sees a straight run's batches.
EPOCH = ("--samples", "32", "--no-shuffle")
POWERSGD = (
    "--strategy",
    "powersgd",
    "--options",
    json.dumps({"matrix_approximation_rank": 2, "start_iter": 2}),
)


def test_resumes_exactly_with_each_ranks_error_and_q(tmp_path) -> None:
    straight = tmp_path / "straight"
    run_script("fit_script.py", straight, *POWERSGD, "--max-steps", "10", *EPOCH)
    for summary in results(straight):  # the hook ran on the CPU, and compressed from step 2
        assert summary["strategy"] == "CompressionStrategy" and summary["hook_calls"] >= 10
        assert (
            summary["stats"][-1]["algorithm"] == "powersgd" and summary["stats"][-1]["compression_ratio"] > 2
        )
        assert all(r["sgd_momentum"] == [0.9] for r in summary["records"]), "PowerSGD leaves momentum to SGD"
    assert torch.equal(params(straight, 0), params(straight, 1))

    ckpt = tmp_path / "five.ckpt"
    run_script("fit_script.py", tmp_path / "five", *POWERSGD, "--max-steps", "5", *EPOCH, "--dump-memory",
               "--save-ckpt", str(ckpt))  # fmt: skip
    entry = inline_exchange_state(ckpt)["lightning_dgc"]
    assert entry["algorithm"] == "powersgd" and set(entry["ranks"][0]["memory"]) == {"error", "q"}
    resumed = tmp_path / "resumed"
    run_script("fit_script.py", resumed, *POWERSGD, "--max-steps", "10", *EPOCH, "--dump-memory",
               "--resume", str(ckpt))  # fmt: skip
    for rank in range(2):
        saved = torch.load(f"{tmp_path / 'five'}.rank{rank}.end.pt", weights_only=True)
        restored = torch.load(f"{resumed}.rank{rank}.start.pt", weights_only=True)
        for kind in ("error", "q"):
            for name, t in saved[kind].items():
                assert torch.equal(restored[kind][name], t), f"{kind}/{name} of rank {rank}"
    torch.testing.assert_close(params(resumed, 0), params(straight, 0), rtol=0, atol=0)
