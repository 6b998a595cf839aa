"""The DGC hook across 2 real gloo processes (pure torch DDP, no Lightning)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import workers
from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.slow


def _assert_ranks_identical(results: list[dict]) -> None:
    for a, b in zip(results[0]["params"], results[1]["params"], strict=False):
        assert torch.equal(a, b), "ranks diverged"


def test_density_one_equals_plain_ddp() -> None:
    """Compression off (density 1, no momentum correction): parameters equal plain DDP's after 6 steps."""
    results = run_ranks(
        workers.train_many,
        runs=[{"steps": 6, "use_hook": False}, {"steps": 6, "use_hook": True, "config": {"density": 1.0}}],
    )
    ddp, dgc = [r[0] for r in results], [r[1] for r in results]
    for r in range(2):
        for a, b in zip(ddp[r]["params"], dgc[r]["params"], strict=False):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    assert dgc[0]["stats"][-1]["compression_ratio"] == pytest.approx(1.0)


def test_density_one_fp16_wire_equals_ddp_to_fp16_precision() -> None:
    """fp16 values: everything (here all dense) travels as fp16, pre-divided; DDP's result to fp16 precision."""
    results = run_ranks(
        workers.train_many,
        runs=[
            {"steps": 4, "use_hook": False},
            {"steps": 4, "use_hook": True, "config": {"density": 1.0, "value_dtype": "fp16"}},
        ],
    )
    ddp, dgc = results[0]
    for a, b in zip(ddp["params"], dgc["params"], strict=True):
        torch.testing.assert_close(b, a, rtol=2e-3, atol=2e-4)
    stats = dgc["stats"][-1]
    assert stats["dense_exchange_bytes"] == stats["numel"] * 2  # half of DDP's fp32 bytes
    assert stats["compression_ratio"] == pytest.approx(2.0)


@pytest.mark.parametrize("masking", [True, False])
def test_taken_over_sgd_momentum_equals_ddp_sgd_at_density_one(masking: bool) -> None:
    """SGD momentum + weight decay moved into the hook: same trajectory as DDP + SGD(momentum) at density 1.

    Everything is sent, so momentum correction is SGD momentum (plain and Nesterov), for compressed
    and dense parameters alike, with momentum factor masking on (the default: it does not apply to
    tensors sent whole) or off.
    """
    runs = []
    for nesterov in (False, True):
        sgd = {"lr": 0.05, "momentum": 0.9, "nesterov": nesterov, "weight_decay": 1e-3}
        runs.append({"steps": 6, "use_hook": False, "sgd": sgd})
        runs.append(
            {"steps": 6, "use_hook": True, "sgd": sgd, "take_over": True,
             "config": {"density": 1.0, "momentum_masking": masking}}
        )  # fmt: skip
    results = run_ranks(workers.train_many, runs=runs)[0]
    for ddp, dgc in zip(results[0::2], results[1::2], strict=False):
        for a, b in zip(ddp["params"], dgc["params"], strict=False):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_sparse_exchange_matches_independent_replay() -> None:
    """Density 0.05, exact top-k: .grad equals the average of every rank's error-feedback top-k."""
    results = run_ranks(workers.sparse_reference, steps=4, density=0.05)
    for r in results:
        assert r["max_err"] < 1e-6
        assert r["stats"]["compression_ratio"] > 1.0


@pytest.mark.parametrize("masking", [True, False])
def test_sparse_exchange_with_sgds_momentum_and_weight_decay_matches_the_papers_algorithm(
    masking: bool,
) -> None:
    """SGD's momentum and weight decay taken over, density 0.05: each step's update equals an independent replay
    of DGC's momentum correction (with or without momentum factor masking) for the compressed tensors and of SGD's
    momentum for the dense ones, over enough steps that every coordinate's momentum has been sent and masked."""
    results = run_ranks(
        workers.sparse_reference, steps=12, density=0.05, momentum=0.9, weight_decay=1e-3, masking=masking
    )
    for r in results:
        assert r["max_err"] < 1e-6


def test_high_compression_learns_and_ranks_agree() -> None:
    """Density 0.001 with momentum correction: the loss falls and ranks hold identical parameters every step."""
    sgd = {"lr": 0.1, "momentum": 0.9}
    results = run_ranks(
        workers.train, steps=60, use_hook=True, sgd=sgd, take_over=True, config={"density": 0.001}
    )
    _assert_ranks_identical(results)
    losses = results[0]["losses"]
    assert sum(losses[-10:]) / 10 < 0.7 * sum(losses[:10]) / 10
    stats = results[0]["stats"][-1]
    assert stats["values_sent"] < stats["numel"]
    assert stats["compression_ratio"] > 5


@pytest.mark.parametrize("value_dtype", ["fp16", "int8"])
def test_several_buckets_with_fewer_bytes_per_value(value_dtype: str) -> None:
    """Tiny buckets (one parameter each) and fp16 or int8 values: still identical ranks and learning."""
    results = run_ranks(
        workers.train, steps=20, use_hook=True, bucket_cap_mb=0.001,
        config={"density": 0.01, "value_dtype": value_dtype, "momentum": 0.9},
    )  # fmt: skip
    _assert_ranks_identical(results)
    assert results[0]["stats"][-1]["buckets"] > 1
    assert results[0]["losses"][-1] < results[0]["losses"][0]


@pytest.mark.parametrize("value_dtype", ["fp32", "int8"])
def test_non_finite_gradient_on_one_rank_skips_step_everywhere(value_dtype: str) -> None:
    """An inf gradient on rank 1 at step 2: both ranks skip that step and keep their memory unchanged (int8:
    the value's block scale carries the NaN to every receiver)."""
    results = run_ranks(
        workers.train, steps=4, use_hook=True, poison=(1, 2),
        config={"density": 0.01, "momentum": 0.9, "value_dtype": value_dtype},
    )  # fmt: skip
    for r in results:
        assert r["finite"] == [True, True, False, True]
        before, after = r["memory"][1], r["memory"][2]
        for kind in ("momentum", "velocity"):
            for name, t in before[kind].items():
                assert torch.equal(t, after[kind][name]), f"{kind} of {name} changed by a skipped step"
        assert all(torch.isfinite(p).all() for p in r["params"])
    _assert_ranks_identical(results)


def test_local_clipping_bounds_each_rank_contribution() -> None:
    """Each rank clips every tensor to c / sqrt(N) before accumulation, so the average is at most that long."""
    clip = 0.01
    for norms in run_ranks(workers.clipped_grad_norms, clip=clip, density=1.0):
        assert max(norms) <= clip / 2**0.5 * (1 + 1e-5)
        assert max(norms) > 0.5 * clip / 2**0.5, "clipping should be active, not the gradients tiny"
