"""Bad input gets a clear error: densities, sample ratios, optimizers, hooks."""

from __future__ import annotations

import math

import pytest

from lightning_dgc import DGCConfig, DGCStrategy


@pytest.mark.parametrize("density", [0.0, -0.1, 1.5, math.nan, math.inf, "0.1", True])
def test_bad_density_is_rejected_with_fix(density: object) -> None:
    with pytest.raises(ValueError, match="density"):
        DGCStrategy(density=density)  # type: ignore[arg-type]


@pytest.mark.parametrize("ratio", [0.0, -1.0, 1.01, math.nan])
def test_bad_sample_ratio_is_rejected(ratio: float) -> None:
    with pytest.raises(ValueError, match="sample_ratio"):
        DGCStrategy(sample_ratio=ratio)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"selection": "random"}, "selection"),
        ({"value_dtype": "int8"}, "value_dtype"),
        ({"momentum": 1.0}, "momentum"),
        ({"nesterov": True}, "nesterov"),
        ({"local_clip_norm": 0.0}, "local_clip_norm"),
        ({"min_compress_numel": 0}, "min_compress_numel"),
    ],
)
def test_other_bad_settings(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DGCConfig(**kwargs)


def test_another_comm_hook_is_rejected() -> None:
    with pytest.raises(ValueError, match="installs its own DDP communication hook"):
        DGCStrategy(ddp_comm_hook=lambda state, bucket: None)


def test_density_setter_validates() -> None:
    s = DGCStrategy(density=0.01)
    s.density = 0.5
    assert s.density == 0.5
    with pytest.raises(ValueError, match="density"):
        s.density = 2.0


def test_valid_boundaries_accepted() -> None:
    assert DGCStrategy(density=1.0).density == 1.0
    assert DGCConfig(density=1e-6, sample_ratio=1.0).sample_ratio == 1.0


def test_fingerprint_ignores_density_but_not_other_settings() -> None:
    assert DGCConfig(density=0.1).fingerprint() == DGCConfig(density=0.2).fingerprint()
    assert DGCConfig(momentum=0.9).fingerprint() != DGCConfig(momentum=0.8).fingerprint()
