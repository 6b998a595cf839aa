"""The memory account (:mod:`lightning_dgc.exchange.memory_account`) against what a CPU exchange step allocates.

The step's temporaries are measured by tracking every tensor storage an operation creates (a
``TorchDispatchMode``; a view or an in-place result shares its input's storage and is not counted) and
summing those still alive before and after every operation: the peak of that sum is the step's. What the
exchange holds across steps is summed over the state's own tensors (memory buffers, plans' wire buffers).
"""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_dgc.algorithms.deft_config import DEFTConfig
from lightning_dgc.algorithms.dgc import DGCConfig
from lightning_dgc.exchange import hook
from lightning_dgc.exchange.memory_account import memory_account
from lightning_dgc.exchange.state import ExchangeState

#: How close the account must come: a tenth of a model size (this test model is small: plans, tables and the
#: decode's arrays, which the account adds at their largest though they peak at other moments, weigh more).
TOLERANCE_MODEL_SIZES = 0.1


class Allocations(TorchDispatchMode):
    """The peak bytes of the storages created inside the mode and still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[int, StorageWeakRef]] = {}
        self.peak = 0

    def _alive(self) -> int:
        for key in [key for key, (_, ref) in self.live.items() if ref.expired()]:
            del self.live[key]
        return sum(n for n, _ in self.live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.peak = max(self.peak, self._alive())
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in inputs and key not in self.live and storage.nbytes():
                    self.live[key] = (storage.nbytes(), StorageWeakRef(storage))
        self.peak = max(self.peak, self._alive())
        return out


SHAPES = [(256, 128), (256,), (512, 256), (512,), (64, 512), (64,)]


def _held_bytes(state: ExchangeState) -> int:
    """Bytes of the distinct storages the state holds: memory buffers and the plans' wire buffers."""
    tensors = [t for by_name in state.memory.committed.values() for t in by_name.values()]
    tensors += [t for t in getattr(state.memory, "_scratch", {}).values() if isinstance(t, torch.Tensor)]
    for plan in state.plans:
        tensors += [getattr(plan, f) for f in ("payload", "gathered", "union", "values", "control")
                    if isinstance(getattr(plan, f, None), torch.Tensor)]  # fmt: skip
    seen = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def _measure(config: DGCConfig) -> tuple[int, int]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape)) for shape in SHAPES]
    state = ExchangeState(config)
    state.register_parameters([(f"p{i}", p) for i, p in enumerate(params)])
    for p in params:
        p.grad = torch.zeros_like(p)
    numel = sum(p.numel() for p in params)
    for _ in range(2):  # the plan, the memory, and its grouping (after a layout's second step)
        hook.exchange(state, params, torch.randn(numel)).wait()
        state.finish_step()
    gradient = torch.randn(numel)
    allocations = Allocations()
    with allocations:
        hook.exchange(state, params, gradient).wait()
        state.finish_step()
    return _held_bytes(state), allocations.peak


@pytest.mark.parametrize(
    "config",
    [
        DGCConfig(density=0.01, momentum=0.9, selection_backend="torch"),
        DGCConfig(density=0.01, momentum_correction=False, selection_backend="torch"),
        DEFTConfig(density=0.01, selection_backend="torch"),
    ],
    ids=["dgc-momentum", "dgc-error-feedback", "deft"],
)
def test_the_account_matches_a_measured_cpu_step(config: DGCConfig) -> None:
    held, step_peak = _measure(config)
    tensors = [(torch.Size(s).numel(), len(s)) for s in SHAPES]
    account = memory_account(config, tensors, world_size=1, momentum=True, finish_writes_grads=False, compiled=False)
    model = account.model_bytes
    assert abs(account.nbytes("run") - held) / model <= TOLERANCE_MODEL_SIZES, (account.as_dict(), held)
    assert abs(account.nbytes("step") - step_peak) / model <= TOLERANCE_MODEL_SIZES, (account.as_dict(), step_peak)


def test_rows_name_every_buffer_and_total_in_model_sizes() -> None:
    config = DGCConfig(density=0.001)
    account = memory_account(config, [(1 << 20, 2), (1024, 1)], world_size=8)
    names = [r.name for r in account.rows]
    assert {"velocity (residual)", "momentum", "wire buffers", "v' (selected from)", "selection scratch"} <= set(names)
    data = account.as_dict()
    assert data["total_model_sizes"] == pytest.approx(data["run_model_sizes"] + data["step_model_sizes"])
    assert 2.0 < account.model_sizes("run") < 2.1  # momentum and velocity of the compressed tensor
    deft = memory_account(DEFTConfig(density=0.001), [(1 << 20, 2), (1024, 1)], world_size=8, momentum=False)
    assert deft.algorithm == "deft" and 1.0 <= deft.model_sizes("run") < 1.05  # error feedback only


def test_the_compiled_selection_s_scratch_is_counted_for_dgc_only() -> None:
    tensors = [(1 << 20, 2), (1 << 19, 2), (1024, 1)]
    eager, compiled = (memory_account(DGCConfig(density=0.001), tensors, compiled=c) for c in (False, True))
    scratch = {a: next(r.nbytes for r in a.rows if r.name == "selection scratch") for a in (eager, compiled)}
    assert scratch[eager] == 9 * 3 * (1 << 19) and scratch[compiled] == 10 * 3 * (1 << 19)
    deft = [memory_account(DEFTConfig(density=0.001), tensors, compiled=c).nbytes() for c in (False, True)]
    assert deft[0] == deft[1]
