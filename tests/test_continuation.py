"""Another backward pass of the same optimizer step (``ExchangeState.continuing``): the exchange adds what its
gradient contributes, with no second momentum decay and no second weight decay, on every selection path.

With masking off, the momentum after passes ``g_1`` (a fresh step) and ``g_2`` (continuing) is what one pass
of ``g_1 + g_2`` gives: ``u' = m u + g_1 + g_2`` (Nesterov ``m (u + g_1 + g_2)``), with weight decay added
once. The Lightning-level proof (DGC at density 1 equals DDP) is ``tests/lightning/test_accumulation.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dgc import algorithms, comm
from lightning_dgc.exchange import hook
from lightning_dgc.exchange.state import ExchangeState
from lightning_dgc.tensor_ops.momentum import continuation_factors


def _model() -> nn.Module:
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 48), nn.Linear(48, 4))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return model


def _passes(name: str, options: dict, continuing: bool) -> list[dict]:
    config = algorithms.get(name).config_class(**options)

    def rank_run(collectives: comm.Collectives) -> dict:
        model = _model()
        state = ExchangeState(config, collectives=collectives, finish_writes_grads=True)
        state.register_parameters(model.named_parameters())
        params = list(model.parameters())
        numel = sum(p.numel() for p in params)
        sent = torch.zeros(numel)
        grads = []
        for step in range(3):
            local = torch.randn(numel, generator=torch.Generator().manual_seed(10 * step + collectives.rank))
            grads.append(local.clone())
            if step == 2 and continuing:
                state.continuing = frozenset(state.param_names.values())
            for p, g in zip(params, local.split([p.numel() for p in params]), strict=True):
                p.grad = g.view_as(p).clone()
            hook.exchange(state, params, local).wait()
            assert state.finish_step()
            sent += torch.cat([p.grad.reshape(-1) for p in params])
            state.continuing = frozenset()
        memory = {k: {n: t.clone() for n, t in d.items()} for k, d in state.memory.committed.items()}
        return {"grads": grads, "memory": memory, "sent": sent}

    return comm.simulate(2, rank_run)


@pytest.mark.parametrize("backend", ["numpy", "numpy_chunks", "torch"])
@pytest.mark.parametrize("nesterov", [False, True])
def test_a_continuing_pass_applies_momentum_once_per_optimizer_step(
    backend: str, nesterov: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend == "numpy_chunks":  # the CPU's selection from chunks of v', never made whole
        from lightning_dgc.algorithms import dgc as dgc_algorithm
        from lightning_dgc.tensor_ops.selection import sampled as dgc_selection

        monkeypatch.setattr(dgc_algorithm, "DIRECT_NUMEL", 1_000)
        monkeypatch.setattr(dgc_selection, "DIRECT_NUMEL", 1_000)
        monkeypatch.setattr(dgc_selection, "CHUNK", 512)
        backend = "numpy"
    m, decay = 0.9, 1e-2
    options = {"density": 0.05, "momentum": m, "nesterov": nesterov, "momentum_masking": False,
               "weight_decay": decay, "selection_backend": backend}  # fmt: skip
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    ranks = _passes("dgc", options, continuing=True)
    for r in ranks:
        g0, g1, g2 = (g.split([p.numel() for p in model.parameters()]) for g in r["grads"])
        for i, (name, p) in enumerate(model.named_parameters()):
            if name not in r["memory"].get("momentum", {}) or p.dim() == 1 or p.numel() < 1024:
                continue  # tensors averaged dense keep SGD's momentum of the average (the Lightning test)
            w = p.detach().reshape(-1)
            step0 = g0[i] + decay * w  # weight decay once per optimizer step, at its first pass
            u1 = m * step0 if nesterov else step0
            step1 = g1[i] + decay * w
            expected = m * (u1 + step1 + g2[i]) if nesterov else m * u1 + step1 + g2[i]
            torch.testing.assert_close(r["memory"]["momentum"][name].reshape(-1), expected, rtol=1e-5, atol=1e-6)
    assert names  # the model has compressed tensors
    assert any(n in ranks[0]["memory"]["momentum"] for n in names if "weight" in n)


def test_continuation_factors() -> None:
    assert continuation_factors(0.0, False) == (0.0, 1.0)
    assert continuation_factors(0.9, False) == (1.0, 1.0)
    assert continuation_factors(0.9, True) == (0.9, 1.9)


def test_without_the_continuation_the_momentum_is_applied_twice() -> None:
    """The same passes treated as two optimizer steps decay the momentum once more: the test above can fail."""
    options = {"density": 0.05, "momentum": 0.9, "momentum_masking": False, "selection_backend": "numpy"}
    once, twice = _passes("dgc", options, True), _passes("dgc", options, False)
    name = "2.weight"
    assert not torch.allclose(once[0]["memory"]["momentum"][name], twice[0]["memory"]["momentum"][name])
