"""Mixed precision, forced overflow, gradient accumulation, manual optimization, clipping, misconfiguration.

Each test is a real 2-process ``Trainer.fit`` on CPU (gloo), both ranks started by the test.
"""

from __future__ import annotations

import pytest
import torch

from tests.lightning.run import params, results, run_script

pytestmark = pytest.mark.slow


def _skipped_record(summary: dict) -> int:
    bad = [i for i, s in enumerate(summary["stats"]) if not s["finite"]]
    assert len(bad) == 1, f"expected exactly one skipped step, got {bad}"
    return bad[0]


def test_fp16_grad_scaler_forced_inf_skips_step_without_poisoning_memory(tmp_path) -> None:
    out = tmp_path / "amp"
    run_script("fit_script.py", out, "--fp16-scaler", "--inf-at", "1:6", "--max-steps", "12")
    summaries = results(out)
    for s in summaries:
        i = _skipped_record(s)
        before, at = s["records"][i - 1], s["records"][i]
        assert at["velocity_sum"] == before["velocity_sum"], "the residual changed on a skipped step"
        assert at["momentum_sum"] == before["momentum_sum"], "the momentum changed on a skipped step"
        assert at["update_norm"] == 0.0, "parameters moved on a skipped step"
        assert at["scale"] == before["scale"] / 2, "the GradScaler did not back off"
        assert all(r["params_finite"] for r in s["records"])
        assert s["records"][-1]["update_norm"] > 0
    assert torch.equal(params(out, 0), params(out, 1))


def test_fp32_forced_inf_skips_step_on_every_rank(tmp_path) -> None:
    out = tmp_path / "fp32"
    proc = run_script("fit_script.py", out, "--inf-at", "0:4", "--max-steps", "10")
    assert "non-finite gradients" in proc.stderr + proc.stdout
    for s in results(out):
        i = _skipped_record(s)
        assert s["records"][i]["update_norm"] == 0.0
        assert s["records"][i]["velocity_sum"] == s["records"][i - 1]["velocity_sum"]
        assert all(r["params_finite"] for r in s["records"])
    assert torch.equal(params(out, 0), params(out, 1))


@pytest.mark.parametrize(
    "precision,dtype", [("bf16-mixed", "torch.float32"), ("bf16-true", "torch.bfloat16")]
)
def test_bf16_precisions_train_and_ranks_agree(tmp_path, precision: str, dtype: str) -> None:
    out = tmp_path / precision
    run_script("fit_script.py", out, "--precision", precision, "--max-steps", "30", "--lr", "0.1")
    summaries = results(out)
    for s in summaries:
        assert s["param_dtype"] == dtype
        assert s["stats"][-1]["compression_ratio"] > 5
        assert all(r["params_finite"] for r in s["records"])
    losses = summaries[0]["losses"]
    assert sum(losses[-5:]) < sum(losses[:5])
    assert torch.equal(params(out, 0), params(out, 1))


def test_accumulation_compresses_once_per_optimizer_step_and_matches_ddp(tmp_path) -> None:
    ddp, dgc = tmp_path / "ddp", tmp_path / "dgc"
    run_script(
        "fit_script.py", ddp, "--strategy", "ddp", "--momentum", "0", "--accumulate", "3", "--max-steps", "6"
    )
    run_script(
        "fit_script.py", dgc, "--density", "1", "--momentum", "0", "--accumulate", "3", "--max-steps", "6"
    )
    for s in results(dgc):
        assert s["global_step"] == 6
        assert s["stats"][-1]["step"] == 6, "memory must advance once per optimizer step"
        assert s["records"][-1]["hook_calls"] == 6 * s["stats"][-1]["buckets"]
        assert len(s["records"]) > 2 * 6, "batches were accumulated"
    torch.testing.assert_close(params(dgc, 0), params(ddp, 0), rtol=1e-5, atol=1e-6)


def test_manual_optimization(tmp_path) -> None:
    out = tmp_path / "manual"
    run_script("fit_script.py", out, "--manual", "--max-steps", "20")
    for s in results(out):
        assert s["stats"][-1]["step"] == 20
        assert s["records"][-1]["hook_calls"] >= 20
    assert torch.equal(params(out, 0), params(out, 1))


def test_trainer_gradient_clipping_acts_on_the_averaged_update(tmp_path) -> None:
    """``gradient_clip_val`` clips what the hook returned, so every SGD update is at most lr * clip long."""
    out = tmp_path / "clip"
    lr, clip = 0.05, 1e-3
    run_script("fit_script.py", out, "--clip-val", str(clip), "--lr", str(lr), "--max-steps", "10")
    for s in results(out):
        norms = [r["update_norm"] for r in s["records"]]
        assert max(norms) <= lr * clip * 1.001
        assert min(norms) > 0


def test_gradients_as_bucket_views_change_no_result_even_through_accumulation_clipping_and_a_skip(tmp_path) -> None:
    """The default ``gradient_as_bucket_view=True`` (``.grad`` are views into DDP's bucket: one model size less)
    gives bit for bit the parameters and memory of ``gradient_as_bucket_view=False``, through gradient
    accumulation (``no_sync``), clipping, ``zero_grad(set_to_none=True)`` and a step skipped for a non-finite
    gradient on one rank."""
    runs = {}
    for name, extra in (("views", []), ("copies", ["--grad-copy"])):
        out = runs[name] = tmp_path / name
        run_script(
            "fit_script.py", out, "--density", "0.05", "--accumulate", "2", "--clip-val", "0.5",
            "--inf-at", "1:3", "--max-steps", "6", "--dump-memory", *extra,
        )  # fmt: skip
    for name, storages in (("views", 1), ("copies", 6)):  # 6 parameters, one bucket
        for s in results(runs[name]):
            # recorded before every optimizer step but the skipped one (its gradients are dropped)
            assert [r["grad_storages"] for r in s["records"] if r["grad_storages"]] == [storages] * 5
            skipped = {st["step"] for st in s["stats"] if st and not st["finite"]}
            assert len(skipped) == 1, "the forced overflow was not skipped"
    for rank in (0, 1):
        assert torch.equal(params(runs["views"], rank), params(runs["copies"], rank))
        views, copies = (torch.load(f"{runs[n]}.rank{rank}.end.pt", weights_only=True) for n in ("views", "copies"))
        assert views.keys() == copies.keys() and views
        for kind in views:
            assert views[kind].keys() == copies[kind].keys()
            for key in views[kind]:
                assert torch.equal(views[kind][key], copies[kind][key]), (kind, key)


def test_ranks_with_different_settings_fail_fast_instead_of_hanging(tmp_path) -> None:
    proc = run_script(
        "fit_script.py", tmp_path / "bad", "--mismatch", "--max-steps", "3", check=False, timeout=120
    )
    assert proc.returncode != 0
    assert "settings differ between ranks" in proc.stderr
