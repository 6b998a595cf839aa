"""Single-tensor math of the selection: exactly k, and the right k."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_dgc.tensor_ops.selection import sampled as dgc_selection
from lightning_dgc.tensor_ops.selection import sampled_topk, topk_among, topk_indices


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _values(dist: str, n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` test values: Gaussian, heavy-tailed, all tied, or almost all zero."""
    return {
        "normal": lambda: torch.randn(n, generator=g),
        "heavy": lambda: torch.randn(n, generator=g) ** 5,
        "constant": lambda: torch.full((n,), 0.5),
        "sparse": lambda: torch.where(torch.rand(n, generator=g) < 0.0005, 1.0, 0.0),
    }[dist]()


@pytest.mark.parametrize("n,k", [(1, 1), (10, 3), (5000, 5), (100_000, 100), (100_000, 1), (4096, 4096)])
@pytest.mark.parametrize("dist", ["normal", "heavy", "constant", "sparse"])
def test_both_selections_return_exactly_k_distinct_indices(n: int, k: int, dist: str) -> None:
    g = _gen(n + k)
    x = _values(dist, n, g)
    for idx in (topk_indices(x, k), sampled_topk(x, k, 0.01, g)):
        assert idx.numel() == k
        assert idx.unique().numel() == k
        assert int(idx.min()) >= 0 and int(idx.max()) < n


@pytest.mark.parametrize("seed", range(5))
def test_sampled_selection_is_exact_topk_when_threshold_admits_enough(seed: int) -> None:
    """Every value above the sampled threshold is a candidate, so re-selection gives the exact top-k set."""
    x = torch.randn(200_000, generator=_gen(seed))
    k = 200
    got = set(sampled_topk(x, k, 0.01, _gen(seed)).tolist())
    want = set(topk_indices(x, k).tolist())
    assert got == want


def test_sampled_selection_lowers_threshold_when_too_few_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sample that overestimates the threshold (all sampled values huge) still yields k indices."""
    x = torch.randn(50_000, generator=_gen(1))
    x[:300] = 1000.0  # 300 huge values; a sample of only these gives a threshold of 1000
    k = 500
    monkeypatch.setattr(dgc_selection, "MIN_SAMPLES", 1)
    idx = sampled_topk(x, k, 1e-4, _gen(0))
    assert idx.numel() == k
    assert set(range(300)) <= set(idx.tolist())


def test_topk_among_keeps_largest_candidates() -> None:
    mags = torch.tensor([5.0, 1.0, 7.0, 3.0, 9.0])
    cand = torch.tensor([0, 1, 2, 3])
    assert sorted(topk_among(mags, cand, 2).tolist()) == [0, 2]
    assert topk_among(mags, cand, 10).tolist() == [0, 1, 2, 3]


def test_selection_by_magnitude_not_sign() -> None:
    x = torch.tensor([0.1, -5.0, 2.0, -0.2])
    assert sorted(topk_indices(x, 2).tolist()) == [1, 2]


# -- the fast CPU path (numpy), its torch twin, and the workspace ----------------------------------

BACKENDS = ["numpy", "torch"]


@pytest.fixture
def force_sampling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sample even tensors small enough for exact top-k, so that small cases exercise sampling."""
    monkeypatch.setattr(dgc_selection, "EXACT_NUMEL", 0)
    monkeypatch.setattr(dgc_selection, "CPU_EXACT_NUMEL", 0)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Take the chunked CPU pass (and its word scan) on tensors of a few thousand values."""
    monkeypatch.setattr(dgc_selection, "DIRECT_NUMEL", 2_000)
    monkeypatch.setattr(dgc_selection, "CHUNK", 1_000)


@pytest.mark.usefixtures("force_sampling")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_workspace", [False, True])
@pytest.mark.parametrize("n,k", [(10, 3), (4097, 5), (5000, 50), (100_003, 100), (4096, 4095)])
@pytest.mark.parametrize("dist", ["normal", "heavy", "constant", "sparse"])
def test_sampling_returns_exactly_k_distinct_indices_on_every_path(
    n: int, k: int, dist: str, backend: str, with_workspace: bool
) -> None:
    g = _gen(n + k)
    x = _values(dist, n, g)
    workspace = dgc_selection.SelectionWorkspace() if with_workspace else None
    idx = sampled_topk(x, k, 0.01, g, workspace=workspace, backend=backend)
    assert idx.dtype == torch.int64 and idx.numel() == k and idx.unique().numel() == k
    assert int(idx.min()) >= 0 and int(idx.max()) < n
    # The k-th largest magnitude is the same as exact top-k's (sets may differ only within ties).
    assert x.abs()[idx].min() == x.abs()[topk_indices(x, k)].min()


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("n", [40_000, 40_003, 262_147])
def test_numpy_and_torch_paths_select_the_same_set(
    n: int, chunked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same generator state, same sample, same threshold: both passes find the same exact top-k."""
    if chunked:
        monkeypatch.setattr(dgc_selection, "DIRECT_NUMEL", 10_000)
        monkeypatch.setattr(dgc_selection, "CHUNK", 4_096)
    x = torch.randn(n, generator=_gen(n)) * torch.rand(n, generator=_gen(n + 1))
    k = n // 1000
    want = set(topk_indices(x, k).tolist())
    via_numpy = sampled_topk(x, k, 0.01, _gen(7), backend="numpy")
    via_torch = sampled_topk(x, k, 0.01, _gen(7), backend="torch")
    assert set(via_numpy.tolist()) == set(via_torch.tolist()) == want
    assert sampled_topk(x, k, 0.01, _gen(7)).tolist() == via_numpy.tolist()  # "auto" is numpy on CPU


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_workspace_serves_tensors_of_any_size_in_any_order(backend: str) -> None:
    """Buffers grow to the largest tensor and are reused; results never alias them."""
    workspace = dgc_selection.SelectionWorkspace()
    g = _gen(3)
    sizes = [50_000, 1_500_000, 33_000, 700_001, 1_500_000, 40_000]
    results = []
    for n in sizes:
        x = torch.randn(n, generator=g)
        k = max(1, n // 1000)
        idx = sampled_topk(x, k, 0.01, g, workspace=workspace, backend=backend)
        assert set(idx.tolist()) == set(topk_indices(x, k).tolist())
        results.append((x, k, idx.clone(), idx))
    held = workspace.nbytes()
    assert held > 0
    for n in sizes[:3]:  # nothing grows once the largest tensor has been seen
        sampled_topk(torch.randn(n, generator=g), n // 1000, 0.01, g, workspace=workspace, backend=backend)
    assert workspace.nbytes() == held
    for _, _, before, idx in results:  # later calls did not overwrite earlier results
        assert torch.equal(before, idx)


def test_chunked_pass_keeps_one_block_of_mask_not_one_byte_per_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above DIRECT_NUMEL the mask covers one block: the workspace does not grow with the tensor, and
    the candidates (in increasing order, across blocks and a ragged last word) are a whole-tensor mask's."""
    from lightning_dgc.tensor_ops.selection import workspace as scratch

    for module in (dgc_selection, scratch):  # the pass and its scratch buffers read both
        monkeypatch.setattr(module, "DIRECT_NUMEL", 10_000)
        monkeypatch.setattr(module, "CHUNK", 4_096)
    workspace = dgc_selection.SelectionWorkspace()
    for n in (200_003, 8_192 * 3):
        x = torch.randn(n, generator=_gen(n))
        threshold = np.float32(2.5)
        got = dgc_selection._candidates_chunked(x.numpy(), threshold, workspace)
        assert got.tolist() == np.flatnonzero(np.abs(x.numpy()) >= threshold).tolist()
        k = n // 1000
        idx = sampled_topk(x, k, 0.01, _gen(1), workspace=workspace)
        assert set(idx.tolist()) == set(topk_indices(x, k).tolist())
    assert workspace._mask is not None and workspace._mask.size == 8_192
    assert workspace.nbytes() < 200_003  # it held more than a byte per value before


def test_workspace_buffers_are_reused_not_reallocated() -> None:
    workspace = dgc_selection.SelectionWorkspace()
    mask, flags = workspace.mask(1000)
    assert mask.size == 1000 and flags.size == 125
    again, _ = workspace.mask(17)
    assert again.size == 24 and np.shares_memory(again, mask)
    floats = workspace.floats(100, np.dtype(np.float32))
    assert np.shares_memory(workspace.floats(50, np.dtype(np.float32)), floats)
    assert not np.shares_memory(workspace.floats(50, np.dtype(np.float64)), floats)
    like = torch.zeros(3)
    assert workspace.magnitudes(like, 10).data_ptr() == workspace.magnitudes(like, 5).data_ptr()


def test_kept_views_follow_the_path_and_the_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The workspace keeps per-size views; a size seen on the direct pass takes the chunked one once
    DIRECT_NUMEL says so (and back), and views made before a buffer grew are not reused."""
    workspace = dgc_selection.SelectionWorkspace()
    x = torch.randn(60_000, generator=_gen(16))
    want = set(topk_indices(x, 60).tolist())
    chunked_calls = []
    real_chunked = dgc_selection._candidates_chunked
    monkeypatch.setattr(
        dgc_selection, "_candidates_chunked", lambda *a: chunked_calls.append(1) or real_chunked(*a)
    )
    assert set(sampled_topk(x, 60, 0.01, _gen(0), workspace=workspace).tolist()) == want
    assert not chunked_calls
    monkeypatch.setattr(dgc_selection, "DIRECT_NUMEL", 10_000)
    assert set(sampled_topk(x, 60, 0.01, _gen(0), workspace=workspace).tolist()) == want
    assert chunked_calls
    monkeypatch.setattr(dgc_selection, "DIRECT_NUMEL", 1 << 20)
    chunked_calls.clear()
    sampled_topk(torch.randn(900_000, generator=_gen(17)), 900, 0.01, _gen(1), workspace=workspace)  # grows
    assert set(sampled_topk(x, 60, 0.01, _gen(0), workspace=workspace).tolist()) == want
    assert not chunked_calls


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["direct", "chunked"])
def test_lowering_recovers_without_exact_fallback(
    backend: str, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sample that hits mostly the few huge values sets the threshold too high; lowering it (not the
    exact fallback) then finds k candidates, and the result is still the exact top-k."""
    if layout == "chunked":
        monkeypatch.setattr(dgc_selection, "DIRECT_NUMEL", 10_000)
        monkeypatch.setattr(dgc_selection, "CHUNK", 4_096)
    n, k = 50_000, 500
    x = torch.randn(n, generator=_gen(5))
    x[:300] = 1000.0
    huge = torch.arange(100)  # 100 of the 500 sampled positions land on huge values
    ordinary = torch.randint(300, n, (400,), generator=_gen(6))
    monkeypatch.setattr(
        dgc_selection, "_draw_positions", lambda out, n, g: out.copy_(torch.cat([huge, ordinary]))
    )

    def no_fallback(values: torch.Tensor, k: int) -> torch.Tensor:
        raise AssertionError("fell back to exact top-k")

    monkeypatch.setattr(dgc_selection, "topk_indices", no_fallback)
    idx = sampled_topk(x, k, 0.01, _gen(0), backend=backend)
    monkeypatch.undo()
    assert set(idx.tolist()) == set(topk_indices(x, k).tolist())


@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_fallback_when_no_lowering_admits_k(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    n, k = 50_000, 500
    x = torch.randn(n, generator=_gen(8))
    x[:300] = 1000.0
    monkeypatch.setattr(
        dgc_selection, "_draw_positions", lambda out, n, g: out.copy_(torch.arange(out.numel()) % 300)
    )
    calls = []
    real = dgc_selection.topk_indices
    monkeypatch.setattr(dgc_selection, "topk_indices", lambda v, k: calls.append(k) or real(v, k))
    idx = sampled_topk(x, k, 0.01, None, backend=backend)
    assert calls == [k]
    assert set(idx.tolist()) == set(real(x, k).tolist())


@pytest.mark.parametrize("backend", BACKENDS)
def test_precomputed_magnitudes_give_the_same_selection(backend: str) -> None:
    x = torch.randn(80_000, generator=_gen(9))
    plain = sampled_topk(x, 80, 0.01, _gen(1), backend=backend)
    with_mags = sampled_topk(x, 80, 0.01, _gen(1), magnitudes=x.abs(), backend=backend)
    assert set(plain.tolist()) == set(with_mags.tolist()) == set(topk_indices(x, 80).tolist())


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_tensors_take_exact_topk_without_drawing(backend: str) -> None:
    exact_numel = dgc_selection.CPU_EXACT_NUMEL if backend == "numpy" else dgc_selection.EXACT_NUMEL
    g = _gen(2)
    state = g.get_state()
    x = torch.randn(exact_numel - 1, generator=_gen(4))
    idx = sampled_topk(x, 20, 0.01, g, backend=backend)
    assert torch.equal(g.get_state(), state)
    assert idx.dtype == torch.int64
    assert set(idx.tolist()) == set(topk_indices(x, 20).tolist())
    # From the threshold on, the sample is drawn.
    sampled_topk(torch.randn(exact_numel, generator=_gen(4)), 20, 0.01, g, backend=backend)
    assert not torch.equal(g.get_state(), state)


def test_numpy_path_takes_float64_and_tensors_that_require_grad() -> None:
    x = torch.randn(60_000, generator=_gen(11), dtype=torch.float64)
    assert set(sampled_topk(x, 60, 0.01, _gen(0), backend="numpy").tolist()) == set(
        topk_indices(x, 60).tolist()
    )
    w = torch.randn(60_000, generator=_gen(12), requires_grad=True)
    assert set(sampled_topk(w, 60, 0.01, _gen(0)).tolist()) == set(topk_indices(w.detach(), 60).tolist())


def test_backend_errors_name_the_fix() -> None:
    x = torch.randn(40_000, generator=_gen(13)).to(torch.bfloat16)
    with pytest.raises(ValueError, match="backend='auto' or 'torch'"):
        sampled_topk(x, 40, 0.01, _gen(0), backend="numpy")
    with pytest.raises(ValueError, match="'auto', 'numpy' or 'torch'"):
        sampled_topk(x.float(), 40, 0.01, _gen(0), backend="cupy")  # type: ignore[arg-type]
    idx = sampled_topk(x, 40, 0.01, _gen(0))  # bfloat16 goes to the torch path on its own
    assert idx.numel() == 40 and idx.unique().numel() == 40


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_selection_with_a_cpu_generator() -> None:
    x = torch.randn(300_000, generator=_gen(14)).cuda()
    idx = sampled_topk(x, 300, 0.01, _gen(0), workspace=dgc_selection.SelectionWorkspace())
    assert idx.device == x.device
    assert set(idx.tolist()) == set(topk_indices(x, 300).tolist())


def test_default_workspace_is_reused_per_thread() -> None:
    """Without a workspace argument the CPU path reuses the calling thread's own buffers."""
    import threading

    x = torch.randn(200_000, generator=_gen(15))
    sampled_topk(x, 200, 0.01, _gen(0))
    mine = dgc_selection.default_workspace()
    held = mine.nbytes()
    assert held >= x.numel()  # the byte mask, at least
    sampled_topk(x, 200, 0.01, _gen(1))
    assert dgc_selection.default_workspace() is mine and mine.nbytes() == held
    other: list[dgc_selection.SelectionWorkspace] = []
    thread = threading.Thread(target=lambda: other.append(dgc_selection.default_workspace()))
    thread.start()
    thread.join()
    assert other[0] is not mine


def _velocity_parts(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    return torch.randn(n, generator=g), torch.randn(n, generator=g) * 3, torch.randn(n, generator=g) * 0.3


@pytest.mark.parametrize(("momentum", "nesterov"), [(0.9, False), (0.9, True), (0.0, False)])
@pytest.mark.parametrize("path", ["first threshold", "lowered", "exact fallback"])
def test_selection_from_chunks_gives_the_whole_vectors_indices_bit_for_bit(
    momentum: float, nesterov: bool, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sampled_topk_of`` (DGC's v' made chunk by chunk, never whole) selects what ``sampled_topk`` selects
    from the whole v', with the same draws, on every path of the pass; its values at the result are v''s."""
    from lightning_dgc.tensor_ops.momentum import compensated_velocity_each
    from lightning_dgc.tensor_ops.selection import workspace as scratch

    for module in (dgc_selection, scratch):  # the pass and its scratch buffers read both
        monkeypatch.setattr(module, "DIRECT_NUMEL", 10_000)
        monkeypatch.setattr(module, "CHUNK", 4_096)
    n, k = 50_001, 500
    grad, velocity, u = _velocity_parts(n, 11)
    if path != "first threshold":  # a few huge values that the sample mostly hits: the threshold is too high
        grad[:300] = 1000.0
        def draws(out: torch.Tensor, n: int, g: object) -> torch.Tensor:
            if path == "exact fallback":  # every draw on a huge value
                return out.copy_(torch.arange(out.numel()) % 300)
            return out.copy_(torch.cat([torch.arange(100), torch.arange(300, 200 + out.numel())]))

        monkeypatch.setattr(dgc_selection, "_draw_positions", draws)
    momentum_buf = [u] if momentum else []
    whole = torch.empty(n)
    compensated_velocity_each([grad], [velocity], [whole], momentum, nesterov, momentum_buf)
    made_whole = []

    def fill(start: int, stop: int, out: torch.Tensor) -> None:
        u_part = [u[start:stop]] if momentum else []
        compensated_velocity_each([grad[start:stop]], [velocity[start:stop]], [out], momentum, nesterov, u_part)

    def take(positions: torch.Tensor) -> torch.Tensor:
        out = torch.empty(positions.numel())
        u_part = [u[positions]] if momentum else []
        compensated_velocity_each([grad[positions]], [velocity[positions]], [out], momentum, nesterov, u_part)
        return out

    a, b = _gen(3), _gen(3)
    expected = sampled_topk(whole, k, 0.01, a, backend="numpy")
    got = dgc_selection.sampled_topk_of(
        n, torch.float32, k, fill, take, 0.01, b, whole=lambda: made_whole.append(1) or whole
    )
    assert torch.equal(got, expected)
    assert torch.equal(take(got), whole[got])
    assert torch.equal(a.get_state(), b.get_state())
    assert made_whole == ([1] if path == "exact fallback" else [])
