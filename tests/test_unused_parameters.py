"""A parameter unused in a step (its ``.grad`` stays ``None``, SGD skips it) keeps its exchange memory as it
was: the momentum of a tensor averaged dense too (DGC applies it in the decode, which the strategies defer to
``finish_step()``), in a flat exchange and in a two-level one (whose memory is kept per piece of a parameter).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dgc import algorithms, comm
from lightning_dgc.exchange import hook
from lightning_dgc.exchange.state import ExchangeState

OPTIONS = {"density": 0.05, "momentum": 0.9}
UNUSED = ("4.weight", "4.bias", "2.weight")  # averaged dense (small) and compressed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 4))


def _run(state: ExchangeState, model: nn.Module, rank: int) -> list[dict]:
    state.register_parameters(model.named_parameters())
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    memories = []
    for step in range(3):
        local = torch.randn(numel, generator=torch.Generator().manual_seed(100 * step + rank))
        for (name, p), g in zip(model.named_parameters(), local.split([p.numel() for p in params]), strict=True):
            unused = step == 2 and name in UNUSED
            p.grad = None if unused else g.view_as(p).clone()
            if unused:
                g.zero_()  # what DDP's bucket holds for a parameter unused on every rank
        hook.exchange(state, params, local).wait()
        assert state.finish_step()
        memories.append({k: {n: t.clone() for n, t in d.items()} for k, d in state.memory.committed.items()})
    return memories


def _check(memories: list[dict]) -> None:
    before, after = memories[1], memories[2]
    checked = 0
    for kind, by_name in after.items():
        for name, tensor in by_name.items():
            parent = name.split("[")[0]
            if parent in UNUSED:
                assert torch.equal(tensor, before[kind][name]), f"{kind} of unused {name} changed"
                checked += 1
            elif kind == "momentum":
                assert not torch.equal(tensor, before[kind][name]), f"{kind} of used {name} did not move"
    assert checked >= len(UNUSED)


@pytest.mark.parametrize("deferred", [False, True])
def test_flat_exchange_leaves_unused_parameters_memory_as_it_was(deferred: bool) -> None:
    config = algorithms.get("dgc").config_class(**OPTIONS)

    def rank_run(collectives: comm.Collectives) -> list[dict]:
        return _run(ExchangeState(config, collectives=collectives, finish_writes_grads=deferred), _model(),
                    collectives.rank)  # fmt: skip

    for memories in comm.simulate(2, rank_run):
        _check(memories)


def test_two_level_exchange_leaves_unused_parameters_memory_as_it_was() -> None:
    config = algorithms.get("dgc").config_class(**OPTIONS)

    def rank_run(topology: comm.Topology) -> list[dict]:
        rank = topology.node_rank * topology.per_node + topology.local_rank
        return _run(ExchangeState(config, topology=topology), _model(), rank)

    for memories in comm.simulate_nodes(2, 2, rank_run):
        _check(memories)
