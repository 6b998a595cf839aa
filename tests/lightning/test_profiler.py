"""``ExchangeProfiler``: times are measured, and its byte counts equal what the hook reports."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dgc.front.profiler import ExchangeProfiler, bucket_layout, bucket_profiles
from lightning_dgc.perfmodel import Profile
from lightning_dgc.tensor_ops.codec import payload_nbytes
from tests.lightning.run import results, run_script


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["dgc", "deft"])
def test_profile_of_two_processes_matches_compression_stats(tmp_path, strategy: str) -> None:
    out = tmp_path / strategy
    run_script("profile_script.py", out, "--strategy", strategy, "--max-steps", "6", timeout=120)
    summary = results(out)
    for s in summary:
        profile = Profile.from_dict(s["profile"])
        assert profile.world_size == 2 and profile.strategy == strategy and profile.steps == 4
        assert profile.compute_s > 0 and profile.step_s > 0 and profile.backward_s > 0
        assert profile.selection_s > 0
        assert profile.batch_size == 16 and profile.density == 0.01
        assert len(profile.buckets) >= 2, "bucket_cap_mb=0.02 should give several buckets"
        assert profile.stats_match is True
        for key, total in s["totals"].items():  # the profile's totals are what the hook reported
            assert s["stats"][key] == total, key
        assert profile.bytes_sent(strategy) < profile.dense_bytes
    assert summary[0]["totals"] == summary[1]["totals"]
    saved = Profile.load(f"{out}.profile.json")  # written by rank 0
    assert saved.totals(strategy) == Profile.from_dict(summary[0]["profile"]).totals(strategy)


class _Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, 600), nn.ReLU(), nn.Linear(600, 600), nn.ReLU(), nn.Linear(600, 8)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_layout_without_ddp_is_what_ddp_rebuilds() -> None:
    model = _Net()
    layout = bucket_layout(model)
    named = list(model.named_parameters())
    assert [n for group in layout for n, _ in group] == [n for n, _ in reversed(named)]
    expected, _ = dist._compute_bucket_assignment_by_size(  # the reference: DDP's own assignment
        [p for _, p in reversed(named)], [1024 * 1024, 25 * 1024 * 1024], [False] * len(named)
    )
    assert [len(g) for g in layout] == [len(g) for g in expected]
    assert len(layout) == 2  # the 1 MiB first bucket, then the rest


def test_bucket_profiles_follow_the_hook_rules() -> None:
    model = _Net()
    buckets = bucket_profiles(bucket_layout(model))
    assert sum(b.numel for b in buckets) == sum(p.numel() for p in model.parameters())
    assert sorted(tuple(s) for b in buckets for s in b.shapes) == sorted(
        tuple(p.shape) for p in model.parameters()
    )
    profile = Profile("net", buckets, compute_s=1.0, density=0.01, value_dtype="fp16")
    costs = [profile.cost("dgc", b, 2) for b in buckets]
    assert sum(c.k for c in costs) == 384 + 3600 + 48  # ceil(0.01 numel) of the 2-D tensors
    assert sum(c.bytes_of("dense") for c in costs) == 2 * (600 + 600 + 8)  # the biases, in fp16
    for b, c in zip(buckets, costs, strict=True):
        assert c.bytes_of("payload") == payload_nbytes(c.k, torch.float16, b.numel)


def test_single_device_profile_times_selection_offline(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 64, generator=g), torch.randint(0, 8, (96,), generator=g))
    profiler = ExchangeProfiler(warmup_steps=1, path=tmp_path / "p.json", density=0.001)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=5, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[profiler],
    )  # fmt: skip
    trainer.fit(_Net(), DataLoader(data, batch_size=12))
    profile = Profile.load(tmp_path / "p.json")
    assert profile.steps == 4 and profile.batch_size == 12 and profile.world_size == 1
    assert profile.compute_s > 0 and profile.selection_s > 0 and profile.stats_match is None
    assert profile.model == "_Net" and profile.dense_bytes == 4 * sum(p.numel() for p in _Net().parameters())
    assert any("offline" in note for note in profile.notes)


def test_too_few_steps_warns(tmp_path) -> None:
    data = TensorDataset(torch.randn(8, 64), torch.randint(0, 8, (8,)))
    profiler = ExchangeProfiler(warmup_steps=5)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[profiler],
    )  # fmt: skip
    with pytest.warns(UserWarning, match="measured no step"):
        trainer.fit(_Net(), DataLoader(data, batch_size=4))
    with pytest.raises(ValueError, match="warmup_steps"):
        ExchangeProfiler(warmup_steps=-1)
