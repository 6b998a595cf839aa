"""DGC's shape-static selection (``compile_selection``): the batched selection's indices, with no host read,
kernels that do not grow with the bucket's tensors, and the same result compiled and eager."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_dgc import algorithms
from lightning_dgc.algorithms.deft_config import DEFTConfig
from lightning_dgc.algorithms.dgc import DGCConfig
from lightning_dgc.exchange import hook
from lightning_dgc.exchange.state import ExchangeState
from lightning_dgc.tensor_ops.selection import static
from lightning_dgc.tensor_ops.selection.batched import batched_topk, segment_layout
from lightning_dgc.tensor_ops.selection.static import StaticSelection
from tests.test_dispatch_counts import SYNC_OPS, Kernels, Reads, second_exchange_counts

SIZES = [30_000, 2_400, 100_000, 5_000, 1_500]
KS = [30, 3, 100, 5_000, 2]  # (the fourth: every value)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("max_values", [None, 40_000])  # one group, or several
def test_the_static_form_selects_what_the_batched_selection_selects(max_values: int | None) -> None:
    flat = torch.randn(sum(SIZES), generator=_gen(0))
    layout = segment_layout(SIZES, KS, 0.01, flat.device, max_values=max_values)
    selection = StaticSelection(layout, 0.01, compiled=False)
    for seed in range(12):
        assert torch.equal(selection(flat, _gen(seed)), batched_topk(flat, layout, _gen(seed))), seed


def test_a_threshold_set_too_high_takes_the_lower_one_and_stays_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rare case, forced: segment 0's higher threshold is its largest sample, so fewer than k values pass;
    it takes its lower threshold (the 4th largest sample) and still its exact top k."""
    sizes, ks = [50_000, 20_000], [100, 20]
    rank = static.threshold_rank
    monkeypatch.setattr(static, "threshold_rank", lambda k, n, s: 1 if n == sizes[0] else rank(k, n, s))
    flat = torch.randn(sum(sizes), generator=_gen(3))
    layout = segment_layout(sizes, ks, 0.01, flat.device)
    draws = torch.rand(layout.sample_scale.numel(), generator=_gen(1), dtype=torch.float64)  # the call's draws
    sampled = flat.abs()[(draws * layout.sample_scale).long() + layout.sample_base][layout.sample_segment == 0]
    assert int((flat[: sizes[0]].abs() >= sampled.max()).sum()) < ks[0]  # what makes segment 0 short
    chosen = StaticSelection(layout, 0.01, compiled=False)(flat, _gen(1))
    for t in range(2):
        got = chosen[layout.k_starts[t] : layout.k_starts[t + 1]]
        start, stop = layout.starts[t], layout.starts[t + 1]
        assert sorted(got.tolist()) == sorted((torch.topk(flat[start:stop].abs(), ks[t]).indices + start).tolist())


def test_candidates_past_the_capacity_still_give_k_distinct_indices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(static, "CAPACITY_FACTOR", 0.0)
    monkeypatch.setattr(static, "CAPACITY_SLACK", 0)
    flat = torch.randn(sum(SIZES), generator=_gen(4))
    layout = segment_layout(SIZES, KS, 0.01, flat.device)
    chosen = StaticSelection(layout, 0.01, compiled=False)(flat, _gen(5))
    assert chosen.numel() == layout.k_total
    for t in range(len(SIZES)):
        got = chosen[layout.k_starts[t] : layout.k_starts[t + 1]]
        assert got.unique().numel() == KS[t]
        assert bool(((got >= layout.starts[t]) & (got < layout.starts[t + 1])).all())


def _static_call(tensors: int) -> tuple[int, int]:
    """Kernels and host reads (syncs included) of one static selection over ``tensors`` segments."""
    sizes = [2048 + 64 * (t % 5) for t in range(tensors)]
    flat = torch.randn(sum(sizes), generator=_gen(tensors))
    selection = StaticSelection(segment_layout(sizes, [21] * tensors, 0.01, flat.device), 0.01, compiled=False)
    kernels, reads = Kernels(), Reads()
    with kernels, reads:
        selection(flat, _gen(0))
    return sum(kernels.calls.values()), reads.count + sum(kernels.calls[op] for op in SYNC_OPS)


def test_the_static_form_reads_nothing_on_the_host_and_its_kernels_do_not_grow() -> None:
    (small, small_reads), (large, large_reads) = _static_call(20), _static_call(60)
    assert small_reads == large_reads == 0
    assert large == small


def test_dgc_through_the_hook_reads_nothing_on_the_host_from_the_second_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook's path with the static form (run eagerly here: what compiling turns into one program)."""

    class Eager(StaticSelection):
        def __init__(self, layout, sample_ratio, compiled):  # type: ignore[no-untyped-def]
            super().__init__(layout, sample_ratio, compiled=False)

    monkeypatch.setattr("lightning_dgc.algorithms.dgc.StaticSelection", Eager)
    counts = {}
    for tensors in (20, 60):
        calls, reads = second_exchange_counts(DGCConfig(density=0.01, momentum=0.9, compile_selection=True), tensors)
        counts[tensors] = (sum(calls.values()), reads + sum(calls[op] for op in SYNC_OPS))
    assert counts[20][1] == counts[60][1] == 0, counts
    assert counts[60][0] <= 1.5 * counts[20][0], counts


def test_a_failed_compilation_warns_and_selects_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(fn, **kwargs):  # type: ignore[no-untyped-def]
        def run(*args):  # type: ignore[no-untyped-def]
            raise RuntimeError("no compiler here")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    flat = torch.randn(sum(SIZES), generator=_gen(9))
    layout = segment_layout(SIZES, KS, 0.01, flat.device)
    selection = StaticSelection(layout, 0.01, compiled=True)
    with pytest.warns(RuntimeWarning, match="no compiler here.*compile_selection=False"):
        first = selection(flat, _gen(10))
    assert torch.equal(first, batched_topk(flat, layout, _gen(10)))
    assert torch.equal(selection(flat, _gen(11)), batched_topk(flat, layout, _gen(11)))  # no second warning
    assert selection.failed is not None


def test_compile_selection_settings() -> None:
    assert DGCConfig().compile_selection == "auto"
    for bad in ("yes", 1):
        with pytest.raises(ValueError, match="compile_selection"):
            DGCConfig(compile_selection=bad).validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="selection='sampled'"):
        DGCConfig(compile_selection=True, selection="exact").validate()
    with pytest.raises(ValueError, match="selection_backend='auto'"):
        DGCConfig(compile_selection=True, selection_backend="numpy").validate()
    DGCConfig(compile_selection=False, selection="exact").validate()


def test_deft_refuses_to_compile_its_selection_and_says_why() -> None:
    with pytest.raises(ValueError, match=r"DEFT's are not.*compile_selection='auto'` or False"):
        DEFTConfig(compile_selection=True).validate()
    DEFTConfig(compile_selection=False).validate()
    DEFTConfig(compile_selection="auto").validate()
    algorithm = ExchangeState(DEFTConfig()).algorithm
    assert not algorithm.compiles_selection(torch.device("cuda"))


def test_compile_selection_is_a_strategy_argument() -> None:
    from lightning_dgc import DEFTStrategy, DGCStrategy

    assert DGCStrategy(compile_selection=False)._config.compile_selection is False
    with pytest.raises(ValueError, match="DEFT's are not"):
        DEFTStrategy(compile_selection=True)


def test_auto_compiles_on_cuda_only_and_true_makes_the_cpu_selection_batched() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    auto = ExchangeState(DGCConfig()).algorithm
    assert auto.compiles_selection(cuda) and not auto.compiles_selection(cpu) and not auto.batched(cpu)
    on = ExchangeState(DGCConfig(compile_selection=True)).algorithm
    assert on.compiles_selection(cpu) and on.batched(cpu)
    off = ExchangeState(DGCConfig(compile_selection=False)).algorithm
    assert not off.compiles_selection(cuda)


@pytest.mark.slow
def test_compiled_and_eager_select_the_same_and_the_hook_trains_the_same() -> None:
    """One compiled program (inductor's CPU backend) gives the eager form's indices; DGC with
    ``compile_selection=True`` (eager on the first step, compiled from the second) decodes the update of
    the batched selection, step after step."""
    flat = torch.randn(sum(SIZES), generator=_gen(6))
    for sizes, ks in ((SIZES, KS), ([50_000], [50])):  # several segments, and a tensor alone
        layout = segment_layout(sizes, ks, 0.01, flat.device)
        compiled, eager = StaticSelection(layout, 0.01, compiled=True), StaticSelection(layout, 0.01, compiled=False)
        for seed in (7, 8):
            values = flat[: sum(sizes)]
            assert torch.equal(compiled(values, _gen(seed)), eager(values, _gen(seed)))
        assert compiled.failed is None, compiled.failed  # (a failed compilation would select eagerly)

    def updates(config: DGCConfig) -> torch.Tensor:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(256, 64)) for _ in range(4)]
        state = ExchangeState(config)
        state.register_parameters([(f"p{i}", p) for i, p in enumerate(params)])
        for p in params:
            p.grad = torch.zeros_like(p)
        g, out = _gen(1), []
        for _ in range(3):
            out.append(hook.exchange(state, params, torch.randn(256 * 64 * 4, generator=g)).wait().clone())
            state.finish_step()
        return torch.stack(out)

    base = DGCConfig(density=0.01, momentum=0.9, selection_backend="torch", compile_selection=False)
    assert torch.equal(updates(dataclasses.replace(base, compile_selection=True)), updates(base))
    assert algorithms.get("dgc").config_class is DGCConfig


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_compiled_selection_never_synchronises_and_selects_the_batched_indices() -> None:
    """On a GPU: compiled, it matches the batched selection, and CUDA's sync debug mode raises on any host
    synchronisation during the call (after the first, which compiles)."""
    device = torch.device("cuda")
    flat = torch.randn(sum(SIZES), generator=_gen(12)).to(device)
    layout = segment_layout(SIZES, KS, 0.01, device)
    selection = StaticSelection(layout, 0.01, compiled=True)

    def draws(seed: int) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(seed)

    assert torch.equal(selection(flat, draws(1)), batched_topk(flat, layout, draws(1)))
    assert selection.failed is None, selection.failed
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        chosen = selection(flat, draws(2))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(chosen, batched_topk(flat, layout, draws(2)))


def test_the_troubleshooting_page_quotes_the_compile_selection_errors() -> None:
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md").read_text()
    for make in (lambda: DEFTConfig(compile_selection=True), lambda: DGCConfig(compile_selection=True, selection="exact")):
        with pytest.raises(ValueError) as error:
            make().validate()
        quoted = page.split(f"``ValueError: {str(error.value)[:40]}", 1)[1].split(" ...``", 1)[0]
        assert str(error.value)[40:].startswith(quoted), quoted
