"""The sharded exchange (one FSDP group's gradient shard, the algorithm across nodes) on simulated ranks.

``comm.simulate`` runs the ranks that hold the same shard, one per node, as threads of this process: what
``exchange_shard`` does with the shard FSDP's reduce-scatter hands it, without FSDP (the real one runs in
``tests/lightning/test_hsdp.py``).
"""

from __future__ import annotations

import pytest
import torch

from lightning_dgc import algorithms, comm
from lightning_dgc.exchange.sharded import GroupShard, exchange_shard
from lightning_dgc.exchange.state import ExchangeState

#: (rows, columns) of three parameters cut among G = 2 ranks per node; the first has an odd row count (padding),
#: the last is a bias
SHAPES = ((7, 40), (64, 32), (64,))
G = 2
CONFIGS = {
    "dgc": {"density": 0.05},
    "deft": {"density": 0.05},
    "powersgd": {"matrix_approximation_rank": 2, "start_iter": 2},
}


def _group(local_rank: int) -> GroupShard:
    """The shard local rank ``local_rank`` holds of SHAPES, laid out as FSDP2 lays out its reduce-scatter output."""
    names, shapes, slots = [], [], []
    for i, shape in enumerate(SHAPES):
        rows, rest = shape[0], shape[1:]
        per = -(-rows // G)  # FSDP2: ceil(rows / G) rows each, the last ranks fewer
        mine = max(0, min(per, rows - local_rank * per))
        width = 1
        for size in rest:
            width *= size
        names.append(f"p{i}")
        shapes.append((mine, *rest))
        slots.append(per * width)
    return GroupShard(tuple(names), tuple(shapes), tuple(slots))


def _run(name: str, options: dict, nodes: int = 2, local_rank: int = 0, steps: int = 3) -> list[list[torch.Tensor]]:
    """Each node's rank of local rank ``local_rank`` exchanges ``steps`` random node-mean shards; returns, per
    node, what each step left in the shard."""
    group = _group(local_rank)

    def node_run(collectives: comm.Collectives) -> list[torch.Tensor]:
        config = algorithms.config_of(name, options)
        state = ExchangeState(config, collectives=collectives)
        params = [torch.nn.Parameter(torch.zeros(shape)) for shape in group.shapes]
        state.register_parameters(zip(group.names, params, strict=True))
        out = []
        for step in range(steps):
            shard = torch.randn(group.numel, generator=torch.Generator().manual_seed(10 * step + collectives.rank))
            for p in params:
                p.grad = torch.zeros_like(p)
            exchange_shard(state, group, shard)
            assert state.finish_step()
            out.append(shard)
        return out

    return comm.simulate(nodes, node_run)


def _padding(group: GroupShard) -> torch.Tensor:
    mask = torch.ones(group.numel, dtype=torch.bool)
    for start, numel in group.pieces:
        mask[start : start + numel] = False
    return mask


@pytest.mark.parametrize("local_rank", [0, 1])
@pytest.mark.parametrize("name", ["dgc", "deft", "powersgd"])
def test_at_density_one_every_node_gets_the_mean_of_the_nodes_shards(name: str, local_rank: int) -> None:
    """Dense (density 1, or PowerSGD before its start step): the shard becomes the mean over the nodes, its
    padding untouched; rank 1 holds fewer rows of the 7-row weight than rank 0."""
    options = {"powersgd": {"start_iter": 10}}.get(name, {"density": 1.0, "momentum_masking": False})
    group = _group(local_rank)
    nodes = _run(name, options, local_rank=local_rank)
    pad = _padding(group)
    for step in range(3):
        sent = [torch.randn(group.numel, generator=torch.Generator().manual_seed(10 * step + n)) for n in range(2)]
        mean = (sent[0] + sent[1]) / 2
        for got in (nodes[0][step], nodes[1][step]):
            torch.testing.assert_close(got[~pad], mean[~pad], rtol=1e-6, atol=1e-7)
            assert torch.equal(got[pad], sent[0][pad]) or torch.equal(got[pad], sent[1][pad])


@pytest.mark.parametrize("name", ["dgc", "deft", "powersgd"])
def test_every_node_decodes_the_same_update(name: str) -> None:
    """Compressed: the nodes' shards are identical after every step (what keeps the replicas of a shard equal)."""
    nodes = _run(name, CONFIGS[name])
    for a, b in zip(*nodes, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(nodes[0][-1], torch.zeros_like(nodes[0][-1]))


def test_the_memory_is_one_shard_per_parameter() -> None:
    """DGC's velocity and momentum are kept per local shard: the rank's row block, not the whole parameter."""
    group = _group(1)

    def node_run(collectives: comm.Collectives) -> dict[str, tuple[int, ...]]:
        state = ExchangeState(algorithms.config_of("dgc", {"density": 0.05, "momentum": 0.9}), collectives=collectives)
        params = [torch.nn.Parameter(torch.zeros(shape)) for shape in group.shapes]
        state.register_parameters(zip(group.names, params, strict=True))
        for p in params:
            p.grad = torch.zeros_like(p)
        exchange_shard(state, group, torch.randn(group.numel))
        state.finish_step()
        return {name: tuple(t.shape) for name, t in state.memory.committed["velocity"].items()}

    shapes = comm.simulate(2, node_run)[0]
    sizes = dict(zip(group.names, group.numels, strict=True))
    assert shapes and all(shape == (sizes[name],) for name, shape in shapes.items())
    assert sum(group.numels) < sum(g * (-(-s[0] // G)) for g, s in zip((40, 32, 1), SHAPES, strict=True)) * G


def test_a_shard_laid_out_otherwise_is_an_error_that_says_why() -> None:
    group = _group(0)

    def node_run(collectives: comm.Collectives) -> None:
        state = ExchangeState(algorithms.config_of("dgc", {"density": 0.05}), collectives=collectives)
        params = [torch.nn.Parameter(torch.zeros(shape)) for shape in group.shapes]
        state.register_parameters(zip(group.names, params, strict=True))
        exchange_shard(state, group, torch.randn(group.numel - group.slots[-1]))

    with pytest.raises(RuntimeError, match="got no gradient in this backward pass.*requires_grad_"):
        comm.simulate(2, node_run)
