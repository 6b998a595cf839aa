"""The algorithm contract: CUDA buffer lifetimes (tripwires that run on the CPU), the declared attributes,
the error-feedback helper, per-tensor draws, and the authors' kit on the package's own algorithms."""

from __future__ import annotations

import ast
import dataclasses
import gc
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_dgc
from lightning_dgc import comm
from lightning_dgc.algorithms.deft import DEFTConfig
from lightning_dgc.algorithms.dgc import DGCConfig
from lightning_dgc.algorithms.powersgd import PowerSGDConfig
from lightning_dgc.comm import collectives as comm_collectives
from lightning_dgc.exchange import hook
from lightning_dgc.exchange.state import ExchangeState
from lightning_dgc.kit import check_algorithm
from tests.extending.randomk import RandomKConfig

PACKAGE = Path(lightning_dgc.__file__).parent


# -- 1. CUDA buffer lifetimes ------------------------------------------------------------------------------
def test_futures_are_chained_only_in_when_all() -> None:
    """``.then``, ``collect_all`` and ``add_done_callback`` order CUDA streams correctly only as
    ``comm.when_all`` uses them (see its docstring): nowhere else in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        allowed: set[int] = set()
        if path == PACKAGE / "comm" / "collectives.py":
            when_all = next(
                n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "when_all"
            )
            allowed = {id(n) for n in ast.walk(when_all)}
        for node in ast.walk(tree):
            name = (
                node.attr
                if isinstance(node, ast.Attribute)
                else node.id
                if isinstance(node, ast.Name)
                else None
            )
            if name in ("then", "collect_all", "add_done_callback") and id(node) not in allowed:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {name}")
    assert not found, f"futures chained outside comm.when_all: {found}"


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 48)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "config",
    [
        DGCConfig(density=0.05),
        DEFTConfig(density=0.05),
        PowerSGDConfig(start_iter=2),
        RandomKConfig(density=0.1),
    ],
    ids=["dgc", "deft", "powersgd", "randomk"],
)
def test_the_fp32_copy_of_a_non_fp32_bucket_is_kept_until_the_decode_ran(config, dtype: torch.dtype) -> None:
    """The decode reads and writes the bucket's fp32 copy on another CUDA stream: it must be in
    ``work.keep`` (recorded on that stream), with every collective's output, when the decode runs."""

    def rank_run(collectives: comm.Collectives) -> list[bool]:
        model = _model(dtype)
        state = ExchangeState(config, collectives=collectives)
        state.register_parameters(model.named_parameters())
        params = list(model.parameters())
        decode, seen = state.algorithm.decode, []

        def observed_decode(plan, work):  # the algorithm's own decode, observed
            seen.append(work.flat.dtype == torch.float32 and any(t is work.flat for t in work.keep))
            return decode(plan, work)

        state.algorithm.decode = observed_decode  # type: ignore[method-assign]
        for step in range(3):
            for p in params:
                p.grad = torch.zeros_like(p)
            buffer = torch.randn(
                sum(p.numel() for p in params), generator=torch.Generator().manual_seed(step)
            )
            update = hook.exchange(state, params, buffer.to(dtype)).wait()
            assert update.dtype == dtype and bool(update.isfinite().all())
            state.finish_step()
        return seen

    for seen in comm.simulate(2, rank_run):
        assert seen == [True, True, True]


def test_when_all_holds_what_it_keeps_until_the_decode_ran() -> None:
    future: torch.futures.Future = torch.futures.Future()
    pending = comm.Pending("all-reduce", future, torch.zeros(2))
    copy = torch.ones(3)
    alive = weakref.ref(copy)
    ran = []
    result = comm.when_all([pending], lambda: ran.append(alive() is not None) or pending.output, torch.device("cpu"),
                           keep=[copy])  # fmt: skip
    del copy
    gc.collect()
    assert alive() is not None and not ran, "dropped before the collective finished"
    future.set_result(None)
    result.wait()
    assert ran == [True]


def test_an_older_torch_is_refused_for_cuda_exchanges() -> None:
    comm_collectives._check_device_futures("2.11.0+cu130")  # what pyproject.toml accepts
    comm_collectives._check_device_futures("2.12.0a0")
    with pytest.raises(RuntimeError, match=r"torch >= 2.11 .*this is torch 2.10.1.*pip install 'torch>=2.11"):
        comm_collectives._check_device_futures("2.10.1+cu128")


def test_powersgd_allocates_its_memory_before_the_collectives() -> None:
    """Q and the error exist once step 2 ran, on the hook's stream: the decode only writes into them."""
    model = _model(torch.float32)
    state = ExchangeState(PowerSGDConfig(start_iter=2))
    state.register_parameters(model.named_parameters())
    state.step = 2  # compressing
    params = list(model.parameters())
    plan = state.plan(params, torch.zeros(sum(p.numel() for p in params)))
    grads = list(torch.zeros(sum(s.numel for s in plan.layout)).split([s.numel for s in plan.layout]))
    state.algorithm.compensate(plan, grads, torch.cat(grads))
    assert all(state.memory.has("error", s.name) for s in plan.layout)
    assert [f.spec.name for f in plan.factors] and all(
        state.memory.has("q", f.spec.name) for f in plan.factors
    )


# -- 2. the declared contract ------------------------------------------------------------------------------
def _state(config) -> tuple[ExchangeState, list[nn.Parameter]]:
    model = _model(torch.float32)
    state = ExchangeState(config)
    state.register_parameters(model.named_parameters())
    return state, list(model.parameters())


def test_error_feedback_adds_what_was_held_back_and_commits_what_stays() -> None:
    state, params = _state(RandomKConfig(density=0.1))
    plan = state.plan(params, torch.zeros(sum(p.numel() for p in params)))
    first = torch.randn(sum(s.numel for s in plan.layout))
    residual = state.algorithm.error_feedback(plan.layout, first)
    assert torch.equal(residual, first)  # nothing held back yet
    residual[:10] = 0.0  # "sent"
    state.memory.commit()
    second = torch.randn_like(first)
    residual = state.algorithm.error_feedback(plan.layout, second)
    expected = first + second
    expected[:10] = second[:10]
    assert torch.allclose(residual, expected)
    state.memory.discard()  # a skipped step: the residual stays what the first step left
    kept = first.clone()
    kept[:10] = 0.0
    assert torch.equal(state.algorithm.error_feedback(plan.layout, torch.zeros_like(first)), kept)


def test_error_feedback_errors_name_the_fix() -> None:
    state, params = _state(DGCConfig())
    plan = state.plan(params, torch.zeros(sum(p.numel() for p in params)))
    with pytest.raises(ValueError, match="holds 3 values but the tensors of `layout`"):
        state.algorithm.error_feedback(plan.layout, torch.zeros(3))
    state.algorithm.residual_kind = None  # type: ignore[misc]
    with pytest.raises(ValueError, match="pass `kind=` or set the class attribute `residual_kind`"):
        state.algorithm.error_feedback(plan.layout, torch.zeros(1))
    assert state.residual_norm() is None, "an algorithm that holds nothing back reports no norm"


def test_a_plan_without_layout_is_a_clear_error() -> None:
    state, params = _state(DGCConfig())
    state.algorithm.plan = lambda layout, buffer: {"layout": layout}  # type: ignore[method-assign]
    with pytest.raises(TypeError, match="without `layout` and `dense_bytes`.*BucketPlan"):
        state.plan(params, torch.zeros(sum(p.numel() for p in params)))


def test_density_and_seed_are_declared_by_the_config_base() -> None:
    assert (
        PowerSGDConfig().density is None and RandomKConfig().density == 0.01 and DGCConfig(seed=3).seed == 3
    )
    assert [f.name for f in dataclasses.fields(DGCConfig)][:2] == [
        "density",
        "sample_ratio",
    ]  # positions kept
    state, _ = _state(PowerSGDConfig())
    assert state.density is None
    with pytest.raises(AttributeError, match="declares no `density` field"):
        state.density = 0.1


def test_tensor_draws_depend_on_name_and_step_only() -> None:
    state, _ = _state(RandomKConfig(seed=1))
    cpu = torch.device("cpu")

    def draw(name: str) -> torch.Tensor:
        return torch.randperm(100, generator=state.tensor_generator(name, cpu))

    a, b = draw("0.weight"), draw("2.weight")
    assert torch.equal(draw("2.weight"), b) and torch.equal(draw("0.weight"), a)  # any order
    assert not torch.equal(a, b)
    state.step += 1
    assert not torch.equal(draw("0.weight"), a)
    other, _ = _state(RandomKConfig(seed=2))
    assert not torch.equal(torch.randperm(100, generator=other.tensor_generator("0.weight", cpu)), a)


def test_buildup_is_reported_only_when_measured() -> None:
    """An algorithm that selects but does not count the union (random-k) reports no build-up factor, not 0."""

    def rank_run(collectives: comm.Collectives) -> dict:
        model = _model(torch.float32)
        state = ExchangeState(RandomKConfig(density=0.1), collectives=collectives, measure_buildup=True)
        state.register_parameters(model.named_parameters())
        params = list(model.parameters())
        for p in params:
            p.grad = torch.zeros_like(p)
        hook.exchange(state, params, torch.randn(sum(p.numel() for p in params))).wait()
        state.finish_step()
        return state.compression_stats()

    for stats in comm.simulate(2, rank_run):
        assert stats["k"] > 0 and "buildup_factor" not in stats and "union_values" not in stats


# -- 3. the authors' kit on the package's algorithms ---------------------------------------------------------
SMALL = {"min_compress_numel": 64}


@pytest.mark.parametrize(
    "config,lossless",
    [
        (DGCConfig(density=0.1, **SMALL), DGCConfig(density=1.0, **SMALL)),
        (
            DGCConfig(density=0.1, selection_backend="torch", **SMALL),
            DGCConfig(density=1.0, selection_backend="torch", **SMALL),
        ),
        (DGCConfig(density=0.1, selection="exact", value_dtype="fp16", **SMALL), None),
        (DGCConfig(density=0.1, value_dtype="int8", **SMALL), None),
        (DGCConfig(density=0.1, selection_backend="torch", value_dtype="int8", **SMALL), None),
        (DGCConfig(density=0.1, value_dtype="int8", compress_vectors=True, min_compress_numel=1), None),
        (DGCConfig(density=0.1, value_dtype="int8", small_density=0.5, **SMALL), None),
        (DGCConfig(density=0.1, value_dtype="int8", small_every=3, **SMALL), None),
        (DEFTConfig(density=0.1, **SMALL), DEFTConfig(density=1.0, **SMALL)),
        (DEFTConfig(density=0.1, selection_backend="torch", selectors="all", **SMALL), None),
        (DEFTConfig(density=0.1, k_allocation="size", fragmenting=False, **SMALL), None),
        (
            PowerSGDConfig(start_iter=2, matrix_approximation_rank=2),
            PowerSGDConfig(start_iter=2, min_compression_rate=1e9),
        ),
        (PowerSGDConfig(start_iter=2, warm_start=False), None),
    ],
    ids=[
        "dgc",
        "dgc-batched",
        "dgc-exact-fp16",
        "dgc-int8",
        "dgc-batched-int8",
        "dgc-int8-every-tensor",
        "dgc-int8-small-density",
        "dgc-int8-small-every",
        "deft",
        "deft-batched-all",
        "deft-size",
        "powersgd",
        "powersgd-cold",
    ],
)
def test_package_algorithms_pass_check_algorithm(config, lossless) -> None:
    # fp16 on the wire drops its rounding error (int8's dense tensors travel in fp16)
    fp16 = getattr(config, "value_dtype", "fp32") in ("fp16", "int8")
    check_algorithm(config, lossless=lossless, conservation_rtol=2e-3 if fp16 else 1e-4)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_int8_values_keep_their_rounding_error_in_the_error_feedback(backend: str) -> None:
    """Only compressed tensors (no dense one in fp16): what int8 rounds off is held back, as fp32 conserves."""
    shapes = {"a.weight": (32, 16), "b.weight": (8, 40), "c.weight": (3, 5, 7)}
    config = DGCConfig(density=0.1, value_dtype="int8", selection_backend=backend, min_compress_numel=64)
    check_algorithm(config, lossless=None, shapes=shapes, conservation_rtol=1e-4)


def test_dgc_with_momentum_passes_everything_but_conservation() -> None:
    check_algorithm(DGCConfig(density=0.1, momentum=0.9, **SMALL), conservation=False)
    with pytest.raises(AssertionError, match="conservation"):
        check_algorithm(DGCConfig(density=0.1, momentum=0.9, **SMALL))


def test_check_algorithm_catches_a_wrong_lossless_setting() -> None:
    with pytest.raises(AssertionError, match="lossless: step 0"):
        check_algorithm(DGCConfig(density=0.1, **SMALL), lossless=DGCConfig(density=0.3, **SMALL))


def test_check_algorithm_catches_draws_that_do_not_resume() -> None:
    """PowerSGD's random Q comes from a sequence drawn bucket after bucket: another bucket order on resume
    changes it (DDP's buckets are in their final order from step 2 on, where PowerSGD starts)."""
    with pytest.raises(AssertionError, match="resume"):
        check_algorithm(PowerSGDConfig(start_iter=2), reorder_buckets_on_resume=True)


def test_compress_vectors_sends_every_tensor_sparse_with_its_own_residual() -> None:
    """``compress_vectors`` with ``min_compress_numel=1``: a bias and a 7-value norm are selected like a weight (no
    dense all-reduce at all); without it they are averaged dense."""
    from lightning_dgc.algorithms.base import layout_of
    from lightning_dgc.algorithms.dgc import DGC

    layout = layout_of(["w", "b", "norm"], [(40, 30), (16,), (7,)])
    every = DGCConfig(density=0.1, compress_vectors=True, min_compress_numel=1)
    cost = DGC.wire_cost(every, layout, 2, 4 * 1223)
    assert cost.bytes_of("dense") == 0 and cost.k == 120 + 2 + 1
    default = DGC.wire_cost(DGCConfig(density=0.1, min_compress_numel=1), layout, 2, 4 * 1223)
    assert default.bytes_of("dense") == 4 * 23 and default.k == 120


def test_small_density_compresses_the_small_tensors_at_their_own_density_never_below_the_step_s() -> None:
    """``small_density``: the tensors averaged dense by default (1-D, under ``min_compress_numel`` values) are
    compressed at it instead, each with its own residual; a warm-up stage denser than it takes them along."""
    import dataclasses

    from lightning_dgc.algorithms.base import layout_of
    from lightning_dgc.algorithms.dgc import DGC

    layout = layout_of(["w", "b", "norm", "small"], [(40, 30), (16,), (7,), (8, 4)])
    config = DGCConfig(density=0.1, small_density=0.25, min_compress_numel=64)
    cost = DGC.wire_cost(config, layout, 2, 4 * 1255)
    assert cost.bytes_of("dense") == 0 and cost.k == 120 + 4 + 2 + 8
    denser = DGC.wire_cost(dataclasses.replace(config, density=0.3), layout, 2, 4 * 1255)
    assert denser.k == 360 + 5 + 3 + 10
    assert not config.averaged_dense(16, 1) and config.tensor_density(1200, 2, 0.1) == 0.1


def test_small_every_sends_the_small_tensors_whole_every_few_steps_and_nothing_is_lost() -> None:
    """``small_every=3`` on 2 simulated ranks (plain error feedback): a bias is averaged whole in steps 0 and 3, its
    update zero in steps 1 and 2, and step 3 sends what steps 1 to 3 accumulated; the weight is compressed every
    step; no dense all-reduce while the bias is held."""
    config = DGCConfig(density=0.1, small_every=3, min_compress_numel=64)
    grads = {(t, r): torch.randn(1240, generator=torch.Generator().manual_seed(10 * t + r)) for t in range(4) for r in (0, 1)}

    def rank_run(collectives: comm.Collectives) -> list[tuple[torch.Tensor, int, int]]:
        model = nn.Linear(30, 40)  # weight (40, 30) compressed, bias (40,) small
        state = ExchangeState(config, collectives=collectives)
        state.register_parameters(model.named_parameters())
        steps = []
        for t in range(4):
            for p in model.parameters():
                p.grad = torch.zeros_like(p)  # (what DDP's bucket would be a view of: every parameter used)
            update = hook.exchange(state, list(model.parameters()), grads[t, collectives.rank].clone()).wait()
            assert state.finish_step()
            stats = state.compression_stats()
            steps.append((update[1200:].clone(), stats["dense_exchange_bytes"], stats["k"]))
        return steps

    mean = {t: (grads[t, 0][1200:] + grads[t, 1][1200:]) / 2 for t in range(4)}
    for (b0, d0, k0), (b1, d1, k1), (b2, d2, k2), (b3, d3, k3) in comm.simulate(2, rank_run):
        torch.testing.assert_close(b0, mean[0])
        assert not b1.any() and not b2.any()
        torch.testing.assert_close(b3, mean[1] + mean[2] + mean[3])
        assert d0 == d3 == 4 * 40 and d1 == d2 == 0 and k0 == k1 == k2 == k3 == 120
