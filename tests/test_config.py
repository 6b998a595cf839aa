"""Bad input gets a clear error: densities, sample ratios, optimizers, hooks."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dgc import DEFTStrategy, DGCConfig, DGCStrategy


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
        ({"value_dtype": "int4"}, "value_dtype"),
        ({"momentum": 1.0}, "momentum"),
        ({"nesterov": True}, "nesterov"),
        ({"local_clip_norm": 0.0}, "local_clip_norm"),
        ({"min_compress_numel": 0}, "min_compress_numel"),
        ({"selection_backend": "cuda"}, "selection_backend"),
        ({"small_density": 0.0}, "small_density"),
        ({"small_density": 1.5}, "small_density"),
        (
            {"small_density": 0.125, "compress_vectors": True, "min_compress_numel": 1},
            "there are none: leave those two at their defaults",
        ),
        ({"small_every": 0}, "small_every` must be >= 1"),
        ({"small_every": 1.5}, "small_every"),
        ({"small_every": 4, "small_density": 0.125}, "pick one"),
        ({"small_every": 4, "compress_vectors": True, "min_compress_numel": 1}, "there are none: leave those two"),
    ],
)
def test_other_bad_settings(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DGCConfig(**kwargs)


def test_int8_values_are_dgcs_alone() -> None:
    """DGC gathers each rank's values with its own scale; DEFT sums values in an all-reduce, which cannot."""
    assert DGCStrategy(value_dtype="int8")._config.value_dtype == "int8"
    with pytest.raises(ValueError, match="DEFT sums its values.*value_dtype='fp16'"):
        DEFTStrategy(value_dtype="int8")


def test_small_density_is_a_dgc_strategy_argument_and_deft_refuses_it() -> None:
    assert DGCStrategy(small_density=0.125)._config.small_density == 0.125
    with pytest.raises(ValueError, match="`small_density=0.125` is DGC's.*or use DGC"):
        DEFTStrategy(small_density=0.125)


def test_small_every_is_a_dgc_strategy_argument_and_deft_refuses_it() -> None:
    assert DGCStrategy(small_every=8)._config.small_every == 8
    with pytest.raises(ValueError, match="`small_every=8` is DGC's.*or use DGC"):
        DEFTStrategy(small_every=8)


@pytest.mark.parametrize("strategy", [DGCStrategy, DEFTStrategy])
def test_selection_backend_is_a_strategy_argument(strategy: type) -> None:
    assert strategy(selection_backend="torch")._config.selection_backend == "torch"
    with pytest.raises(ValueError, match="selection_backend"):
        strategy(selection_backend="gpu")


def test_the_numpy_backend_on_a_gpu_bucket_says_what_to_use_instead() -> None:
    """(Decided per bucket from its device: checked without a GPU by asking for a CUDA device.)"""
    from lightning_dgc.exchange.state import ExchangeState

    algorithm = ExchangeState(DGCConfig(selection_backend="numpy")).algorithm
    assert not algorithm.batched(torch.device("cpu"))
    with pytest.raises(ValueError, match="selection_backend='numpy' selects on CPU tensors only.*'auto'"):
        algorithm.batched(torch.device("cuda", 0))


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


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"momentum": "0.9"}, r"`momentum` must be a number, got '0.9' \(str\)"),
        ({"min_compress_numel": "10"}, r"`min_compress_numel` must be an integer, got '10' \(str\)"),
        ({"min_compress_numel": 10.5}, r"`min_compress_numel` must be an integer"),
        ({"local_clip_norm": "5"}, r"`local_clip_norm` must be a number, got '5' \(str\)"),
        ({"sample_ratio": "0.01"}, r"`sample_ratio` must be a number"),
        ({"density": None}, r"`density` must be a number, got None"),
        ({"nesterov": "yes"}, r"`nesterov` must be True or False"),
        ({"seed": 1.5}, r"`seed` must be an integer"),
    ],
)
def test_arguments_of_the_wrong_type_name_the_argument(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DGCStrategy(**kwargs)


def test_numbers_of_any_real_type_are_accepted_and_stored_as_python_numbers() -> None:
    import fractions

    import numpy as np

    strategy = DGCStrategy(
        density=np.float32(0.1), momentum=np.float64(0.9), sample_ratio=fractions.Fraction(1, 100),
        min_compress_numel=np.int64(2048), local_clip_norm=np.float16(5), nesterov=np.bool_(True), seed=np.int32(3),
    )  # fmt: skip
    config = strategy.config
    assert config.density == pytest.approx(0.1) and type(config.density) is float
    assert (
        config.sample_ratio == 0.01
        and type(config.min_compress_numel) is int
        and config.min_compress_numel == 2048
    )
    assert config.nesterov is True and config.local_clip_norm == 5.0 and config.seed == 3
    assert DEFTStrategy(density=np.float32(0.5)).density == 0.5


def test_deft_momentum_of_the_wrong_type_names_the_argument() -> None:
    with pytest.raises(ValueError, match="`momentum` must be a number"):
        DEFTStrategy(momentum="0.9", momentum_correction=True)
