"""Momentum is applied exactly once, with the user's value, across checkpoints and strategies.

Every run is a real 2-process ``Trainer.fit``. An epoch is one step (32 samples, 16 per batch and
rank), so that a run resumed from a checkpoint sees the batches a straight run sees (Lightning does
not replay a multi-batch epoch's order exactly on resume). DGC runs at density 1 with exact selection and masking off: then it is DDP + SGD
momentum to float tolerance, so any momentum applied twice, or lost, shows as a difference.
"""

from __future__ import annotations

import pytest
import torch

from lightning_dgc.checkpoint.exchange import CHECKPOINT_FORMAT
from tests.lightning.run import params, results, run_script

pytestmark = pytest.mark.slow

EPOCH = ("--samples", "32", "--no-shuffle")
DGC_AS_DDP = ("--density", "1.0", "--no-masking", "--selection", "exact")


@pytest.fixture(scope="module")
def ddp_ten_steps(tmp_path_factory) -> torch.Tensor:
    out = tmp_path_factory.mktemp("ddp10") / "ddp10"
    run_script("fit_script.py", out, "--strategy", "ddp", "--max-steps", "10", *EPOCH)
    return params(out, 0)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def test_ddp_checkpoint_resumed_under_dgc_continues_sgd_momentum_once(tmp_path, ddp_ten_steps) -> None:
    """DDP for 5 steps, then DGC for 5: SGD's buffers become DGC's momentum, SGD's momentum stays 0."""
    ckpt = tmp_path / "ddp5.ckpt"
    run_script("fit_script.py", tmp_path / "ddp5", "--strategy", "ddp", "--max-steps", "5", *EPOCH,
               "--save-ckpt", str(ckpt))  # fmt: skip
    out = tmp_path / "dgc"
    proc = run_script("fit_script.py", out, *DGC_AS_DDP, "--max-steps", "10", *EPOCH, "--resume", str(ckpt))
    assert "continue as the exchange's momentum" in proc.stderr + proc.stdout
    for summary in results(out):
        assert all(r["sgd_momentum"] == [0.0] for r in summary["records"]), "momentum applied twice"
    _assert_close(params(out, 0), ddp_ten_steps)


def test_dgc_checkpoint_resumed_under_ddp_keeps_the_users_momentum(tmp_path, ddp_ten_steps) -> None:
    """DGC for 5 steps, then plain DDP for 5: the checkpoint holds SGD(momentum=0.9) and its buffers."""
    ckpt = tmp_path / "dgc5.ckpt"
    run_script(
        "fit_script.py", tmp_path / "dgc5", *DGC_AS_DDP, "--max-steps", "5", *EPOCH, "--save-ckpt", str(ckpt)
    )
    saved = torch.load(ckpt, weights_only=True)
    group = saved["optimizer_states"][0]["param_groups"][0]
    assert (group["momentum"], group["nesterov"], group["weight_decay"]) == (0.9, False, 0.0)
    assert all("momentum_buffer" in s for s in saved["optimizer_states"][0]["state"].values())
    assert saved["lightning_dgc"]["format"] == CHECKPOINT_FORMAT
    out = tmp_path / "ddp"
    run_script("fit_script.py", out, "--strategy", "ddp", "--max-steps", "10", *EPOCH, "--resume", str(ckpt))
    assert all(r["sgd_momentum"] == [0.9] for r in results(out)[0]["records"])
    _assert_close(params(out, 0), ddp_ten_steps)


@pytest.mark.parametrize("strategy_args", [DGC_AS_DDP, ("--strategy", "ddp")], ids=["dgc", "ddp"])
def test_fit_twice_with_the_same_optimizer_object(tmp_path, ddp_ten_steps, strategy_args) -> None:
    """fit to step 5, then fit on to step 10 with the same Trainer and the same optimizer object."""
    out = tmp_path / "twice"
    run_script("fit_script.py", out, *strategy_args, "--fit-twice", "5", "--max-steps", "10", *EPOCH)
    for summary in results(out):
        assert summary["global_step"] == 10
        assert summary["optimizer_momentum"] == [0.9]
    _assert_close(params(out, 0), ddp_ten_steps)


def test_dgc_checkpoint_resumed_under_dgc_is_exact(tmp_path, ddp_ten_steps) -> None:
    """DGC for 5 steps, resumed by DGC: the optimizer's restored momentum is taken over again, not added."""
    ckpt = tmp_path / "dgc5.ckpt"
    run_script(
        "fit_script.py", tmp_path / "dgc5", *DGC_AS_DDP, "--max-steps", "5", *EPOCH, "--save-ckpt", str(ckpt)
    )
    out = tmp_path / "dgc10"
    run_script("fit_script.py", out, *DGC_AS_DDP, "--max-steps", "10", *EPOCH, "--resume", str(ckpt))
    for summary in results(out):
        assert all(r["sgd_momentum"] == [0.0] for r in summary["records"])
    _assert_close(params(out, 0), ddp_ten_steps)
