"""The two-level exchange (dense inside the node, the algorithm across nodes) on simulated ranks.

``comm.simulate_nodes`` runs ``nodes x per_node`` ranks as threads of this process, with one
``LocalGroup`` per node and one per local rank across the nodes: the same collectives as over gloo.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from torch import nn

from lightning_dgc import algorithms, comm
from lightning_dgc.algorithms.base import layout_of
from lightning_dgc.algorithms.dgc import DGCConfig
from lightning_dgc.comm import CollectiveError
from lightning_dgc.exchange import hook, shards
from lightning_dgc.exchange.entry import state_for_topology
from lightning_dgc.exchange.state import ExchangeState

CONFIGS = {
    "dgc": {"density": 0.05},
    "deft": {"density": 0.05},
    "powersgd": {"matrix_approximation_rank": 2, "start_iter": 2},
}
#: Density 1 with exact selection and no masking: every algorithm with a density is the plain mean.
EXACT = {"density": 1.0, "selection": "exact", "momentum_masking": False}


def _model() -> nn.Module:
    torch.manual_seed(0)
    # a 3-row weight: fewer rows than the 4 local ranks of some tests (one gets no piece of it)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 3))


def _train(config: algorithms.AlgorithmConfig, nodes: int = 2, per_node: int = 2, steps: int = 3,
           buckets: list[list[int]] | None = None, deferred: bool = False, **faults: int) -> list[dict]:  # fmt: skip
    """Each simulated rank exchanges ``steps`` random gradients (``buckets``: parameter indices per bucket,
    a list per step or one for all steps; default one bucket)."""

    def rank_run(topology: comm.Topology) -> dict:
        model = _model()
        state = ExchangeState(config, topology=topology, finish_writes_grads=deferred)
        state.register_parameters(model.named_parameters())
        params = list(model.parameters())
        numel = sum(p.numel() for p in params)
        rank = topology.node_rank * topology.per_node + topology.local_rank
        updates, sent = [], []
        for step in range(steps):
            local = torch.randn(numel, generator=torch.Generator().manual_seed(100 * step + rank))
            sent.append(local.clone())
            for p in params:
                p.grad = torch.zeros_like(p)
            groups = (buckets[step] if buckets and isinstance(buckets[0][0], list) else buckets) or [
                list(range(len(params)))
            ]
            pieces, start = [], 0
            for group in groups:  # DDP's buckets: consecutive parameters
                size = sum(params[i].numel() for i in group)
                future = hook.exchange(state, [params[i] for i in group], local[start : start + size].clone())
                pieces.append(future.wait().clone())
                start += size
            updates.append(torch.cat(pieces))
            state.finish_step()
        return {"updates": updates, "local": sent, "stats": state.compression_stats(), "state": state}

    return comm.simulate_nodes(nodes, per_node, rank_run, **faults)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_rank_decodes_the_same_update_in_two_levels(name: str) -> None:
    config = algorithms.get(name).config_class(**CONFIGS[name])
    ranks = _train(config, nodes=2, per_node=3)
    for r in ranks[1:]:
        for a, b in zip(ranks[0]["updates"], r["updates"], strict=True):
            assert torch.equal(a, b)
    assert all(torch.isfinite(u).all() for u in ranks[0]["updates"])
    # the algorithm ran across the 2 nodes, on a third of the bucket
    stats = ranks[0]["stats"]
    assert ranks[0]["state"].world_size == 2 and stats["numel"] < sum(p.numel() for p in _model().parameters()) / 2
    assert 0 < stats["inter_node_bytes"] < stats["link_bytes"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_two_level_exchange_never_defers_its_decode_even_when_asked(name: str) -> None:
    """The strategies ask every state to write the gradients at finish_step (the commit then reads the local
    gradient in the bucket); a two-level state declines, since its algorithm's local gradient is the node's
    shard, which its decode overwrites: memory and updates are those of the plain two-level exchange."""
    config = algorithms.get(name).config_class(**CONFIGS[name])
    asked, plain = _train(config, deferred=True), _train(config)
    for a, p in zip(asked, plain, strict=True):
        assert a["state"].finish_writes_grads is False
        for got, want in zip(a["updates"], p["updates"], strict=True):
            assert torch.equal(got, want)
        for kind, by_name in p["state"].memory.committed.items():
            for n, t in by_name.items():
                assert torch.equal(a["state"].memory.committed[kind][n], t), (kind, n)


@pytest.mark.parametrize("name", ["dgc", "deft"])
def test_two_levels_at_density_one_are_the_plain_mean_of_every_rank(name: str) -> None:
    config = algorithms.get(name).config_class(**EXACT)
    ranks = _train(config, nodes=2, per_node=2)
    for step in range(3):
        mean = torch.stack([r["local"][step] for r in ranks]).mean(0)
        torch.testing.assert_close(ranks[0]["updates"][step], mean, rtol=1e-6, atol=1e-6)


def test_powersgd_in_two_levels_is_the_plain_mean_before_its_start_iteration() -> None:
    ranks = _train(algorithms.get("powersgd").config_class(matrix_approximation_rank=1, start_iter=2))
    for step in range(2):
        mean = torch.stack([r["local"][step] for r in ranks]).mean(0)
        torch.testing.assert_close(ranks[0]["updates"][step], mean, rtol=1e-6, atol=1e-6)
    mean = torch.stack([r["local"][2] for r in ranks]).mean(0)
    assert not torch.allclose(ranks[0]["updates"][2], mean)
    # PowerSGD's matrices are the pieces' rows: every local rank keeps a q per compressed piece
    q = ranks[1]["state"].memory.committed["q"]
    assert q and all(shards.parse_piece(name) is not None for name in q)


def test_memory_is_keyed_by_pieces_and_survives_ddp_rebuilding_its_buckets() -> None:
    """Exact top-k per piece does not depend on the buckets: three bucketings, the same updates and memory."""
    config = DGCConfig(density=0.1, selection="exact")
    one = _train(config)
    rebuilt = _train(config, buckets=[[[0, 1], [2, 3, 4, 5]], [[0, 1, 2, 3, 4, 5]], [[0, 1, 2], [3, 4, 5]]])
    for a, b in zip(one, rebuilt, strict=True):
        for x, y in zip(a["updates"], b["updates"], strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
        velocity = a["state"].memory.committed["velocity"]
        assert velocity.keys() == b["state"].memory.committed["velocity"].keys()
        assert all(shards.parse_piece(name) for name in velocity)


def test_two_levels_send_a_fraction_across_nodes_of_what_flat_dgc_sends() -> None:
    config = DGCConfig(density=0.05)
    two_level = _train(config, nodes=2, per_node=2)[0]["stats"]

    def flat_run(collectives: comm.Collectives) -> dict:
        model = _model()
        state = ExchangeState(config, collectives=collectives)
        state.register_parameters(model.named_parameters())
        params = list(model.parameters())
        for p in params:
            p.grad = torch.zeros_like(p)
        hook.exchange(state, params, torch.randn(sum(p.numel() for p in params))).wait()
        state.finish_step()
        return state.compression_stats()

    flat = comm.simulate(4, flat_run)[0]
    assert flat["inter_node_bytes"] == flat["link_bytes"]
    # flat: every rank's payload reaches every other rank (3 P); two levels: half a payload from 1 other node
    assert two_level["inter_node_bytes"] < flat["link_bytes"] / 4


@pytest.mark.parametrize("level", ["fail_at_node", "fail_at_across"])
@pytest.mark.parametrize("index", [0, 1])
def test_a_failed_collective_at_either_level_raises_on_every_rank_naming_its_global_rank(level: str, index: int) -> None:
    """Inside the node the 0th collective is the reduce-scatter and the 1st the all-gather. Each rank names
    itself by its rank in the job, not by its rank in the group of that level."""
    config = algorithms.get("deft").config_class(density=0.05)
    errors: list[BaseException] = []

    def rank_run(topology: comm.Topology) -> None:
        model = _model()
        state = ExchangeState(config, topology=topology)
        state.register_parameters(model.named_parameters())
        params = list(model.parameters())
        # the hook's future holds the error (DDP raises it from backward), and so does the memory's step
        with pytest.raises((CollectiveError, RuntimeError), match=r"lightning_dgc: the .* failed on rank") as error:
            hook.exchange(state, params, torch.randn(sum(p.numel() for p in params))).wait()
        errors.append(error.value)
        assert f"failed on rank {topology.node_rank * topology.per_node + topology.local_rank}:" in str(error.value)
        with pytest.raises((CollectiveError, RuntimeError), match="simulated failure"):
            state.finish_step()

    comm.simulate_nodes(2, 2, rank_run, **{level: index})
    assert len(errors) == 4
    where = {"fail_at_node": ["reduce-scatter inside", "all-gather inside"][index], "fail_at_across": "the "}
    assert all(where[level] in str(e) and "simulated failure" in str(e) for e in errors)


def test_hierarchical_option_and_node_layout_errors_name_the_fix() -> None:
    assert comm.resolve_hierarchical("auto", 2, 8) is True
    assert comm.resolve_hierarchical("auto", 1, 8) is False
    assert comm.resolve_hierarchical("auto", 4, 4) is False
    assert comm.resolve_hierarchical(False, 2, 8) is False
    with pytest.raises(ValueError, match="needs more than one node.*num_nodes"):
        comm.resolve_hierarchical(True, 1, 4)
    with pytest.raises(ValueError, match="divide evenly.*hierarchical=False"):
        comm.resolve_hierarchical("auto", 2, 5)
    with pytest.raises(ValueError, match="'auto', True or False"):
        comm.resolve_hierarchical("yes", 2, 4)
    assert comm.check_node_layout([(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)], 2) == 2
    with pytest.raises(ValueError, match="same number of devices on every node"):
        comm.check_node_layout([(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 0)], 2)
    with pytest.raises(ValueError, match="numbered node by node"):
        comm.check_node_layout([(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)], 2)


def test_the_shards_cover_the_bucket_once_in_whole_rows() -> None:
    layout = layout_of(["w", "b", "s", "v"], [(5, 3), (7,), (), (2, 2, 2)])
    covered = torch.zeros(sum(s.numel for s in layout), dtype=torch.long)
    bucket = torch.arange(1, covered.numel() + 1, dtype=torch.float32)
    for index in range(3):
        shard = shards.shard_layout(layout, 3, index)
        node = shard.to_node(bucket, torch.full((3 * shard.shard_numel,), math.nan))
        assert torch.equal(shard.to_bucket(node), bucket)  # every value once in the node layout, and back
        mine = node[index * shard.shard_numel : (index + 1) * shard.shard_numel]
        assert not mine[shard.numel :].any()  # the padding is 0
        values = []
        for piece in shard.pieces:
            parent, a, b = shards.parse_piece(piece.name)  # type: ignore[misc]
            spec = next(s for s in layout if s.name == parent)
            covered[spec.offset + a : spec.offset + b] += 1
            values.append(bucket[spec.offset + a : spec.offset + b])
            assert math.prod(piece.shape) == b - a and piece.shape[1:] == spec.shape[1:]
        assert torch.equal(mine[: shard.numel], torch.cat(values))  # this rank's block: its pieces, in order
    assert torch.equal(covered, torch.ones_like(covered))


def test_resume_on_another_topology_keeps_the_pending_update() -> None:
    """Saved as 2 nodes x 2, resumed as 2 x 2 (exact), 4 flat ranks and 1 node x 2 (the mean over nodes)."""
    ranks = _train(DGCConfig(density=0.05))
    saved = {
        "algorithm": "dgc",
        "world_size": 4,
        "topology": ranks[0]["state"].topology_signature,
        "ranks": [r["state"].state_dict() for r in ranks],
    }
    shapes = {n: tuple(p.shape) for n, p in _model().named_parameters()}
    numels = {n: math.prod(s) for n, s in shapes.items()}
    nodes = [shards.assemble([r["memory"] for r in saved["ranks"][n * 2 : n * 2 + 2]], numels) for n in range(2)]
    owed = {name: (nodes[0]["velocity"][name] + nodes[1]["velocity"][name]) / 2 for name in nodes[0]["velocity"]}

    same, redistributed = state_for_topology(saved, saved["topology"], 3, shapes)
    assert not redistributed and same is saved["ranks"][3]

    flat = {"hierarchical": False, "nodes": 4, "per_node": 1}
    for rank in range(4):
        state, redistributed = state_for_topology(saved, flat, rank, shapes)
        assert redistributed
        for name, value in owed.items():
            torch.testing.assert_close(state["memory"]["velocity"][name], value)

    two = {"hierarchical": True, "nodes": 1, "per_node": 2}
    pieces = [state_for_topology(saved, two, rank, shapes)[0]["memory"]["velocity"] for rank in range(2)]
    back = shards.assemble([{"velocity": p} for p in pieces], numels)["velocity"]
    for name, value in owed.items():
        torch.testing.assert_close(back[name], value)

    lost = next(iter(saved["ranks"][1]["memory"]["velocity"]))  # a piece of rank 1 and of rank 3
    for r in (1, 3):
        del saved["ranks"][r]["memory"]["velocity"][lost]
    for topology in (saved["topology"], flat, two):  # refused, not restarted from zeros, whatever the topology
        with pytest.raises(ValueError, match=rf"\['ranks'\]\[1\]\['memory'\] lacks buffers .*'velocity' of '{re.escape(lost)}'"):
            state_for_topology(saved, topology, 0, shapes)


def test_the_model_charges_the_inter_node_bytes_the_two_level_run_reports() -> None:
    """perfmodel's <algorithm>_node and compression_stats()["inter_node_bytes"] come from one wire_cost."""
    from lightning_dgc.perfmodel import BucketProfile, Profile, wire_bytes

    model = _model()
    bucket = BucketProfile([list(p.shape) for p in model.parameters()], 4 * sum(p.numel() for p in model.parameters()),
                           [n for n, _ in model.named_parameters()])  # fmt: skip
    for name in sorted(CONFIGS):
        config = algorithms.get(name).config_class(**CONFIGS[name])
        stats = _train(config, nodes=2, per_node=2)[0]["stats"]  # local rank 0: the longest shard
        profile = Profile("toy", [bucket], compute_s=1.0, configs={name: dataclasses.asdict(config)}, world_size=4)
        assert wire_bytes(profile, f"{name}_node", 4, gpus_per_node=2) == stats["inter_node_bytes"], name


def test_the_model_puts_two_level_dgc_ahead_of_flat_dgc_and_of_dense_on_ten_times_the_bandwidth() -> None:
    """ResNet-50 as profiled on one H100 (``benchmarks/results/profile_resnet50_h100.json``), 64 nodes of 8 GPUs."""
    from pathlib import Path

    from benchmarks.scaling_model import highlights
    from lightning_dgc.perfmodel import METHODS, NODE_METHODS, Network, Profile, predict

    profile = Profile.load(Path(__file__).parents[1] / "benchmarks" / "results" / "profile_resnet50_h100.json")
    for nic in ("node", "gpu"):
        network = Network(bandwidth=1e9, gpus_per_node=8, nic=nic)
        h = highlights(predict(profile, (1, 8), (1e9, 10e9), METHODS + NODE_METHODS, network))
        assert h["dgc_node_1g"] >= 3 * h["dgc_1g"] and h["dgc_node_1g"] > h["ddp_10g"], (nic, h)
        assert [r["selection_ms"] for r in h["selection_sweep"]][0] == 0.0
    assert h["dgc_node_1g"] > 30  # a card per GPU: 8 x the bandwidth of a node's shared card


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_rank_that_owns_no_piece_of_a_bucket_takes_part_in_the_node_only(name: str) -> None:
    """4 ranks per node, the last buckets a (3, 48) weight and a (3,) bias: local rank 3 owns nothing of them."""
    options = EXACT if name != "powersgd" else {"matrix_approximation_rank": 1, "start_iter": 2}
    ranks = _train(algorithms.get(name).config_class(**options), nodes=2, per_node=4, steps=2,
                   buckets=[[0, 1, 2, 3], [4], [5]])  # fmt: skip
    for step in range(2):
        mean = torch.stack([r["local"][step] for r in ranks]).mean(0)
        for r in ranks:
            torch.testing.assert_close(r["updates"][step], mean, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_every_compression_strategy_takes_the_option_and_true_on_one_node_fails_at_setup(tmp_path) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_dgc import CompressionStrategy, DEFTStrategy, DGCStrategy
    from tests.lightning.fit_script import Regression, dataset

    for strategy in (DGCStrategy(hierarchical=True), DEFTStrategy(hierarchical=False),
                     CompressionStrategy("powersgd", hierarchical="auto")):  # fmt: skip
        assert strategy._hierarchical in ("auto", True, False)
    with pytest.raises(ValueError, match="hierarchical must be 'auto', True or False, got 'yes'"):
        DGCStrategy(hierarchical="yes")  # type: ignore[arg-type]
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=DGCStrategy(hierarchical=True), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )  # fmt: skip
    with pytest.raises(ValueError, match="hierarchical=True needs more than one node.*num_nodes=1"):
        trainer.fit(Regression(), DataLoader(dataset(64), batch_size=16))
