"""``density="auto"`` under the two-level exchange, on simulated ranks (``comm.simulate_nodes``: 2 nodes of 2 ranks as
threads): only the collectives across nodes are timed and priced, and every rank of every node picks the same
density. A link is made slow by delaying the completion of one level's collectives, as a slow wire would."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from lightning_dgc import comm
from lightning_dgc.algorithms import TensorSpec
from lightning_dgc.algorithms.base import allgather_volume, layout_of, ring_allreduce_volume
from lightning_dgc.algorithms.deft import DEFTConfig
from lightning_dgc.algorithms.dgc import DGC, DGCConfig
from lightning_dgc.comm import Collectives, LocalGroup, Pending
from lightning_dgc.exchange import shards
from lightning_dgc.exchange.hook import exchange
from lightning_dgc.exchange.state import ExchangeState
from lightning_dgc.schedules.auto_density import AUTO_MARGIN, MEASURE_STEPS, AutoDensity, choose_density
from lightning_dgc.schedules.auto_levels import check_nodes_on_hosts, longest_shard, priced_buckets

NODES, PER_NODE = 2, 2
#: Two (256, 256) weights, a bucket each: 512 KiB of fp32 gradient, a 256 KiB shard per local rank.
SHAPE = (256, 256)
#: The step's compute, slept before the hook: the window the exchange is priced against.
COMPUTE_S = 0.05


class SlowWire(Collectives):
    """``inner``'s collectives, each completed ``latency_s`` plus its ring volume at ``bits_per_s`` after it was
    issued (a background thread holds the result back): a slow link, seen by whoever times the collectives."""

    def __init__(self, inner: Collectives, bits_per_s: float, latency_s: float = 1e-3) -> None:
        self.inner, self.bits_per_s, self.latency_s = inner, bits_per_s, latency_s
        self.world_size, self.rank = inner.world_size, inner.rank

    @property
    def global_rank(self) -> int:
        return self.inner.global_rank

    def _slow(self, pending: Pending, volume: float) -> Pending:
        delayed: torch.futures.Future = torch.futures.Future()
        delay = self.latency_s + 8 * volume / self.bits_per_s

        def complete() -> None:
            pending.future.wait()
            time.sleep(delay)
            delayed.set_result(pending.output)

        threading.Thread(target=complete, daemon=True).start()
        return Pending(pending.what, delayed, pending.output, pending.rank)

    def all_reduce(self, tensor: torch.Tensor, what: str) -> Pending:
        nbytes = tensor.numel() * tensor.element_size()
        return self._slow(self.inner.all_reduce(tensor, what), ring_allreduce_volume(nbytes, self.world_size))

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor, what: str) -> Pending:
        nbytes = tensor.numel() * tensor.element_size()
        return self._slow(self.inner.all_gather(tensor, out, what), allgather_volume(nbytes, self.world_size))


def _rank() -> int:
    return int(threading.current_thread().name.removeprefix("rank"))  # comm.simulate_nodes' thread names


@pytest.fixture
def every_rank(monkeypatch: pytest.MonkeyPatch):
    """The decision's host collectives among the simulated ranks (one all-gather of every rank, in rank order),
    and ``host_key`` per simulated rank: ``hosts(rank)``, by default each node its own machine."""
    world = LocalGroup(NODES * PER_NODE)

    def all_gather_host(tensor: torch.Tensor, group: object = None, what: str = "") -> list[torch.Tensor]:
        out = torch.empty(world.world_size * tensor.numel(), dtype=tensor.dtype)
        world.meet(_rank(), "all_gather", what, tensor.clone(), out).wait()
        return list(out.view(world.world_size, -1))

    hosts = {"of": lambda rank: rank // PER_NODE}
    monkeypatch.setattr(comm, "all_gather_host", all_gather_host)
    monkeypatch.setattr(comm, "host_key", lambda: float(hosts["of"](_rank())))
    return hosts


def _measure(node_bits: float | None = None, across_bits: float | None = None, config_class: type = DGCConfig) -> list:
    """Every simulated rank trains through one measuring phase with ``density="auto"`` (the level given a rate runs
    on a slow wire of that rate, the other as fast as threads go); each rank's :class:`AutoDensity` after it."""

    def rank_run(topology: comm.Topology) -> AutoDensity:
        if node_bits is not None:
            topology = dataclasses.replace(topology, node=SlowWire(topology.node, node_bits))
        if across_bits is not None:
            topology = dataclasses.replace(topology, across=SlowWire(topology.across, across_bits))
        config = config_class(density="auto", auto_every=0)
        state = ExchangeState(config, topology=topology)
        params = [torch.nn.Parameter(torch.zeros(SHAPE)) for _ in range(2)]
        state.register_parameters([("w0", params[0]), ("w1", params[1])])
        auto = AutoDensity(config, "DGCStrategy")
        auto.attach(state)
        rank = topology.node_rank * PER_NODE + topology.local_rank
        for step in range(MEASURE_STEPS + 1):
            generator = torch.Generator().manual_seed(10 * step + rank)
            for param in params:
                param.grad = torch.randn(SHAPE, generator=generator)
            time.sleep(COMPUTE_S)
            futures = []
            for param in params:  # the hook of each bucket, as the front doors call it (the second one's too)
                auto.hooked(probe_s=1e-4 if param is params[0] else None)
                futures.append(exchange(state, [param], param.grad.reshape(-1).clone()))
                auto.hook_done()
            torch.futures.wait_all(futures)
            state.finish_step()
            auto.exchange_done()
            auto.step_done(state)
        assert not auto.measuring and state.density == auto.link_density
        return auto

    return comm.simulate_nodes(NODES, PER_NODE, rank_run)


@pytest.mark.parametrize("config_class", [DGCConfig, DEFTConfig], ids=["dgc", "deft"])
def test_a_slow_link_between_the_nodes_gets_a_sparse_density_on_every_rank(every_rank, config_class: type) -> None:
    """20 Mbit/s across the nodes: the shard's dense all-reduce takes about 0.1 s against a 50 ms window."""
    autos = _measure(across_bits=20e6, config_class=config_class)
    densities = {auto.choice.density for auto in autos}
    assert len(densities) == 1, f"the ranks chose {densities}"
    density = densities.pop()
    assert density < 1.0, autos[0].choice.reason
    for auto in autos:
        assert 10e6 < auto.link.throughput_bps < 40e6  # the wire across the nodes, not the fast one inside them
        assert auto.choice.predicted_s <= auto.choice.dense_s
        # the first bucket's hook waited for its slow exchange across the nodes: not compute
        assert COMPUTE_S <= auto.link.window_s < COMPUTE_S + 0.03


def test_a_slow_link_inside_the_nodes_alone_stays_dense(every_rank) -> None:
    """The same slow wire inside the nodes: paid at every density, not timed, not priced: dense, unless the fast wire
    across the nodes was itself timed too slow for the window (a busy machine), which the same pricing then says."""
    autos = _measure(node_bits=20e6)
    assert len({auto.choice.density for auto in autos}) == 1, [auto.choice for auto in autos]
    for auto in autos:
        # the fast wire across the nodes, not the 20 Mbit/s one inside them (3x its rate: a busy machine slows the
        # unthrottled wire's timing, never down to the slow one's)
        assert not auto.link.measurable or auto.link.throughput_bps > 3 * 20e6
        config = DGCConfig(density="auto", auto_every=0)
        priced = choose_density(auto.link, auto.priced, NODES, DGC, config, auto.min_density, check_s=auto.priced_check_s)
        assert auto.choice.density == priced.density, (auto.choice, priced)
        assert auto.choice.density == 1.0 or priced.dense_s > AUTO_MARGIN * auto.link.window_s, auto.choice


def test_every_rank_prices_the_longest_shard_across_the_nodes() -> None:
    """A 3-row tensor shared by 2 local ranks: rank 0 owns 1 row, rank 1 two; both price rank 1's shard, the
    longest, in fp32; a flat plan is priced as it is."""
    layout = layout_of(["a", "b"], [(3, 5), (8,)])

    def rank_run(topology: comm.Topology) -> list:
        state = ExchangeState(DGCConfig(density=0.5), topology=topology)
        params = [torch.nn.Parameter(torch.zeros(3, 5)), torch.nn.Parameter(torch.zeros(8))]
        state.register_parameters([("a", params[0]), ("b", params[1])])
        state.plan(params, torch.zeros(23))
        return priced_buckets(state.plans)

    priced = comm.simulate_nodes(NODES, PER_NODE, rank_run)
    pieces = shards.shard_pieces(layout, PER_NODE, 1)
    assert longest_shard(layout, PER_NODE) == pieces and sum(s.numel for s in pieces) == 2 * 5 + 4
    assert all(p == [(pieces, 4 * 14)] for p in priced)
    plan = type("Plan", (), {"layout": layout, "dense_bytes": 92})()
    assert priced_buckets([plan]) == [(layout, 92)]
    assert all(isinstance(s, TensorSpec) for s in pieces)


def test_a_node_whose_processes_run_on_several_hosts_is_refused() -> None:
    check_nodes_on_hosts([1.0, 1.0, 2.0, 2.0], 2, "DGCStrategy")  # a node per machine
    check_nodes_on_hosts([1.0, 1.0, 1.0, 1.0], 2, "DGCStrategy")  # every node on one machine (dense, then)
    with pytest.raises(ValueError, match=r"node 1 \(global ranks 2 to 3\) run on different hosts.*hierarchical=False"):
        check_nodes_on_hosts([1.0, 1.0, 2.0, 3.0], 2, "DGCStrategy")


def test_the_refusal_comes_on_every_rank_at_the_decision(every_rank) -> None:
    every_rank["of"] = lambda rank: rank % PER_NODE  # each node's two processes on two machines
    with pytest.raises(ValueError, match="DGCStrategy: density='auto' with the two-level exchange needs"):
        _measure()
