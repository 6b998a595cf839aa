"""The memory committed in place (no scratch buffers) and the decode deferred to ``finish_step()``.

``ExchangeState(finish_writes_grads=True)`` (what the strategies use) hands DDP the bucket as it is and
writes the averaged update into ``.grad`` at ``finish_step()``, after the memory's in-place commit read
the local gradient from the bucket. It must give exactly what the future's decode gives, and a step that
is not finite on some rank must leave every rank's memory exactly as it was.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_dgc import algorithms, comm
from lightning_dgc.exchange import hook
from lightning_dgc.exchange.state import ExchangeState

CASES = [
    ("dgc", {"density": 0.05, "momentum": 0.9, "selection_backend": "numpy"}),
    ("dgc", {"density": 0.05, "momentum": 0.9, "nesterov": True, "selection_backend": "torch"}),
    ("dgc", {"density": 0.05, "momentum": 0.9, "momentum_masking": False, "weight_decay": 1e-3}),
    ("dgc", {"density": 0.6, "momentum": 0.9}),  # tensors sent whole ("full")
    ("deft", {"density": 0.05}),
    ("deft", {"density": 0.05, "momentum_correction": True, "momentum": 0.9, "selection_backend": "torch"}),
    ("deft", {"density": 0.05, "union_values": "owner"}),
    ("powersgd", {"matrix_approximation_rank": 2, "start_iter": 2}),
    ("powersgd", {"matrix_approximation_rank": 1, "start_iter": 2, "warm_start": False}),
]


def _model() -> nn.Module:
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 4))
    generator = torch.Generator().manual_seed(0)  # (ranks are threads: not the global generator)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def _train(name: str, options: dict, deferred: bool, steps: int = 4, nan_at: tuple[int, int] | None = None,
           world: int = 2):  # fmt: skip
    config = algorithms.get(name).config_class(**options)

    def rank_run(collectives: comm.Collectives) -> dict:
        model = _model()
        state = ExchangeState(config, collectives=collectives, finish_writes_grads=deferred)
        state.register_parameters(model.named_parameters())
        params = list(model.parameters())
        numel = sum(p.numel() for p in params)
        updates, memories, verdicts = [], [], []
        for step in range(steps):
            local = torch.randn(numel, generator=torch.Generator().manual_seed(100 * step + collectives.rank))
            if nan_at == (step, collectives.rank):
                local[3] = math.nan
            future = hook.exchange(state, params, local)
            returned = future.wait().clone()
            for p, g in zip(params, returned.split([p.numel() for p in params]), strict=True):
                p.grad = g.view_as(p).clone()  # what DDP copies into .grad from the future's value
            verdicts.append(state.finish_step())
            if deferred:  # the update is in .grad (and in the bucket)
                update = torch.cat([p.grad.reshape(-1) for p in params])
                assert torch.equal(update, local) or not verdicts[-1]
            else:
                update = returned
            updates.append(update)
            memories.append({k: {n: t.clone() for n, t in d.items()} for k, d in state.memory.committed.items()})
        return {"updates": updates, "memories": memories, "verdicts": verdicts}

    return comm.simulate(world, rank_run)


def _equal_memory(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].keys() == b[k].keys() and all(torch.equal(a[k][n], b[k][n]) for n in a[k]) for k in a
    )


@pytest.mark.parametrize(("name", "options"), CASES)
def test_the_deferred_decode_gives_the_future_decode_bit_for_bit(name: str, options: dict) -> None:
    # (PowerSGD draws its random Q from torch's global generator, which simulated ranks, being threads, share)
    world = 1 if name == "powersgd" else 2
    future, deferred = _train(name, options, False, world=world), _train(name, options, True, world=world)
    for f, d in zip(future, deferred, strict=True):
        for a, b in zip(f["updates"], d["updates"], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(f["memories"], d["memories"], strict=True):
            assert _equal_memory(a, b)
    last = future[0]["memories"][-1]
    assert any(torch.count_nonzero(t) for by_name in last.values() for t in by_name.values())


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize(("name", "options"), CASES[:2] + CASES[4:5] + CASES[7:8])
def test_a_step_not_finite_on_one_rank_leaves_every_rank_memory_bit_exact(
    name: str, options: dict, deferred: bool
) -> None:
    ranks = _train(name, options, deferred=deferred, nan_at=(3, 1))
    for r in ranks:
        assert r["verdicts"] == [True, True, True, False]
        assert _equal_memory(r["memories"][2], r["memories"][3])  # step 3 skipped: nothing changed
        assert not torch.isfinite(r["updates"][3]).all()  # the optimizer (or a GradScaler) sees it
    clean = _train(name, options, deferred=deferred)
    assert not _equal_memory(clean[0]["memories"][3], ranks[0]["memories"][3])


@pytest.mark.parametrize("nesterov", [False, True])
def test_dgc_selecting_from_chunks_of_v_prime_gives_the_whole_v_prime_bit_for_bit(
    nesterov: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU, DGC selects from a large tensor's v' chunk by chunk without making it whole: the same
    updates, the same memory and the same skip of a non-finite step as from the whole v'."""
    from lightning_dgc.algorithms import dgc as dgc_algorithm
    from lightning_dgc.tensor_ops.selection import sampled as dgc_selection

    monkeypatch.setattr(dgc_selection, "DIRECT_NUMEL", 1_000)  # the model's 2048- and 3072-value weights
    monkeypatch.setattr(dgc_selection, "CHUNK", 512)  # are "large": chunks, blocks, several of each
    monkeypatch.setattr(dgc_selection, "CPU_EXACT_NUMEL", 100)
    options = {"density": 0.05, "momentum": 0.9, "nesterov": nesterov, "selection_backend": "numpy"}
    made_whole = []
    velocity_of = dgc_algorithm.DGC.velocity_of
    monkeypatch.setattr(dgc_algorithm.DGC, "velocity_of", lambda self, es, w: made_whole.extend(e.name for e in es) or velocity_of(self, es, w))
    monkeypatch.setattr(dgc_algorithm, "DIRECT_NUMEL", 1_000)
    chunks = _train("dgc", options, deferred=True, nan_at=(3, 1))
    assert made_whole == []
    monkeypatch.setattr(dgc_algorithm, "DIRECT_NUMEL", 1 << 30)  # every v' made whole
    whole = _train("dgc", options, deferred=True, nan_at=(3, 1))
    assert made_whole
    for c, w in zip(chunks, whole, strict=True):
        assert c["verdicts"] == w["verdicts"] == [True, True, True, False]
        for a, b in zip(c["updates"], w["updates"], strict=True):  # (the skipped step's holds NaN)
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        for a, b in zip(c["memories"], w["memories"], strict=True):
            assert _equal_memory(a, b)
