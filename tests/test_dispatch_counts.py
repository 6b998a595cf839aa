"""The device code path (``selection_backend="torch"``) works per bucket, not per tensor: its kernels do
not grow with the number of tensors, and it reads from the device at most once per bucket.

Counted on the CPU, where the same torch code runs: every aten operation (a kernel launch on a GPU)
under a ``TorchDispatchMode``, and every call that would stall the host on a GPU tensor: the aten
operations ``_local_scalar_dense`` (``.item()``, ``bool(t)``), ``nonzero``, ``unique*`` and
``masked_select``, plus the Python-level reads ``.tolist()``, ``.item()``, ``bool()``, ``int()``,
``float()``, ``.cpu()`` and ``.numpy()`` (a ``TorchFunctionMode``: ``.tolist()`` never reaches aten).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_dgc import algorithms
from lightning_dgc.exchange import hook
from lightning_dgc.exchange.state import ExchangeState

SYNC_OPS = ("_local_scalar_dense", "nonzero", "unique", "_unique", "_unique2", "unique_dim",
            "unique_consecutive", "masked_select")  # fmt: skip
HOST_READS = {
    torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy,
}  # fmt: skip


class Kernels(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class Reads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in HOST_READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _one_bucket_call(algorithm: str, tensors: int) -> tuple[Counter[str], int]:
    """The counts of the second hook call on a bucket of ``tensors`` compressed weights and as many biases."""
    torch.manual_seed(0)
    params = []
    for _ in range(tensors):
        params += [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(64))]
    config = algorithms.get(algorithm).config_class(
        density=0.01, selection_backend="torch", momentum=0.9, **({"momentum_correction": True} if algorithm == "deft" else {})
    )  # fmt: skip
    state = ExchangeState(config)
    state.register_parameters([(f"p{i}", p) for i, p in enumerate(params)])
    for p in params:
        p.grad = torch.zeros_like(p)
    numel = sum(p.numel() for p in params)
    hook.exchange(state, params, torch.randn(numel)).wait()  # plan, memory: made once
    state.finish_step()
    kernels, reads = Kernels(), Reads()
    with kernels, reads:
        update = hook.exchange(state, params, torch.randn(numel)).wait()
    state.finish_step()
    assert torch.isfinite(update).all() and state.compression_stats()["k"] == 21 * tensors
    return kernels.calls, reads.count


@pytest.mark.parametrize("algorithm,reads_per_bucket", [("dgc", 1), ("deft", 2)])
def test_kernels_do_not_grow_with_the_tensors_and_the_host_reads_once(
    algorithm: str, reads_per_bucket: int
) -> None:
    """DGC reads the candidate counts once; DEFT also copies its plan's norms to the host (what it must)."""
    small, small_reads = _one_bucket_call(algorithm, 20)
    large, large_reads = _one_bucket_call(algorithm, 60)
    assert sum(large.values()) <= 1.5 * sum(small.values()), (sum(small.values()), sum(large.values()))
    for calls, reads in ((small, small_reads), (large, large_reads)):
        syncs = sum(calls[op] for op in SYNC_OPS)
        assert syncs + reads <= reads_per_bucket, (dict(calls), reads)


def test_the_numpy_path_is_per_tensor_and_the_torch_path_selects_the_same() -> None:
    """The CPU's default path works tensor by tensor (its launches grow with the tensors); both paths
    select the exact top-k of every tensor, so they decode the same update."""
    numpy_calls, _ = _count_with_backend("numpy", 20)
    numpy_large, _ = _count_with_backend("numpy", 60)
    assert sum(numpy_large.values()) > 2 * sum(numpy_calls.values())
    updates = {backend: _update(backend) for backend in ("numpy", "torch")}
    assert torch.equal(updates["numpy"], updates["torch"])


def _count_with_backend(backend: str, tensors: int) -> tuple[Counter[str], int]:
    return second_exchange_counts(algorithms.get("dgc").config_class(density=0.01, selection_backend=backend), tensors)


def second_exchange_counts(config: object, tensors: int) -> tuple[Counter[str], int]:
    """The operations and host reads of the second exchange of ``tensors`` 64 x 32 parameters under ``config`` (the
    first builds the plans)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 32)) for _ in range(tensors)]
    state = ExchangeState(config)
    state.register_parameters([(f"p{i}", p) for i, p in enumerate(params)])
    for p in params:
        p.grad = torch.zeros_like(p)
    numel = sum(p.numel() for p in params)
    hook.exchange(state, params, torch.randn(numel)).wait()
    state.finish_step()
    kernels, reads = Kernels(), Reads()
    with kernels, reads:
        hook.exchange(state, params, torch.randn(numel)).wait()
    return kernels.calls, reads.count


def _update(backend: str) -> torch.Tensor:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(256, 64)) for _ in range(6)]
    state = ExchangeState(algorithms.get("dgc").config_class(density=0.01, selection_backend=backend))
    state.register_parameters([(f"p{i}", p) for i, p in enumerate(params)])
    for p in params:
        p.grad = torch.zeros_like(p)
    numel = sum(p.numel() for p in params)
    generator = torch.Generator().manual_seed(1)
    updates = []
    for _ in range(3):
        updates.append(hook.exchange(state, params, torch.randn(numel, generator=generator)).wait().clone())
        state.finish_step()
    return torch.stack(updates)
