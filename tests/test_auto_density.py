"""``density="auto"``: the pure decision on a fake link, the link's estimate from timed steps, the settings."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import pytest
import torch

from lightning_dgc import DGCStrategy, algorithms
from lightning_dgc.algorithms import layout_of
from lightning_dgc.algorithms.deft import DEFTConfig
from lightning_dgc.algorithms.dgc import DGCConfig
from lightning_dgc.comm import Pending, TimedCollectives
from lightning_dgc.perfmodel import Network
from lightning_dgc.schedules.auto_density import (
    AUTO_MARGIN,
    MEASURE_STEPS,
    AutoDensity,
    candidate_densities,
    choose_density,
    exchange_time,
)
from lightning_dgc.schedules.link_measure import (
    ExchangeRecorder,
    LinkEstimate,
    StepSample,
    estimate_link,
    link_from_ranks,
)

# A ResNet-20-like model in two buckets: conv weights, a classifier, biases and norms.
SHAPES = [[16, 3, 3, 3]] + [[16, 16, 3, 3]] * 6 + [[32, 16, 3, 3]] + [[32, 32, 3, 3]] * 5 + [[64, 32, 3, 3]]
SHAPES += [[64, 64, 3, 3]] * 5 + [[10, 64], [10], [64], [64]]


def buckets() -> list[tuple[list, int]]:
    half = len(SHAPES) // 2
    out = []
    for part in (SHAPES[:half], SHAPES[half:]):
        layout = layout_of([f"t{i}" for i in range(len(part))], part)
        out.append((layout, 4 * sum(s.numel for s in layout)))
    return out


DGC = algorithms.get("dgc")
DEFT = algorithms.get("deft")


def fake_link(bits_per_s: float, latency_s: float, window_s: float) -> LinkEstimate:
    return LinkEstimate(bits_per_s, latency_s, window_s)


def time_at(algorithm, config, density: float, link: LinkEstimate, n: int = 2) -> float:
    network = Network(bandwidth=link.throughput_bps, latency=link.latency_s)
    return exchange_time(algorithm, replace(config, density=density), buckets(), n, network)


def test_candidates_halve_from_dense_down_to_the_floor() -> None:
    assert candidate_densities(0.1) == [1.0, 0.5, 0.25, 0.125, 0.1]
    assert candidate_densities(1.0) == [1.0]


@pytest.mark.parametrize("algorithm, config", [(DGC, DGCConfig()), (DEFT, DEFTConfig())])
def test_a_fast_link_stays_dense(algorithm, config) -> None:
    link = fake_link(10e9, 50e-6, 0.8)
    choice = choose_density(link, buckets(), 2, algorithm, config, 0.001)
    assert choice.density == 1.0
    assert choice.predicted_s == choice.dense_s == pytest.approx(time_at(algorithm, config, 1.0, link))
    assert choice.dense_s <= AUTO_MARGIN * link.window_s


@pytest.mark.parametrize("value_dtype", ["fp16", "int8"])
def test_dense_as_ddp_s_own_step_is_priced_at_its_fp32_all_reduce_whatever_the_values(value_dtype: str) -> None:
    """Where density 1 is DDP's own step, it all-reduces each bucket in fp32, not in the algorithm's value dtype
    (fp16 for the tensors DGC sends dense): a link on which fp16 would fit the window but fp32 does not gets a
    compressed density, priced below 1 exactly as before."""
    config, n = DGCConfig(value_dtype=value_dtype), 2
    network = Network(bandwidth=100e6, latency=1e-4)
    ddp = sum(network.allreduce(dense_bytes, n) for _, dense_bytes in buckets())
    link = fake_link(100e6, 1e-4, 1.5 * ddp / AUTO_MARGIN / 2)  # between the fp16 and the fp32 all-reduce
    algorithms_own = choose_density(link, buckets(), n, DGC, config, 0.001)
    assert algorithms_own.density == 1.0 and algorithms_own.dense_s == pytest.approx(time_at(DGC, config, 1.0, link))
    assert algorithms_own.dense_s < 0.55 * ddp  # its dense exchange in half precision
    as_ddp = choose_density(link, buckets(), n, DGC, config, 0.001, dense_is_ddp=True)
    assert as_ddp.dense_s == pytest.approx(ddp) and as_ddp.density < 1.0
    assert as_ddp.predicted_s == pytest.approx(time_at(DGC, config, as_ddp.density, link))


@pytest.mark.parametrize("algorithm, config", [(DGC, DGCConfig()), (DEFT, DEFTConfig())])
@pytest.mark.parametrize("n", [2, 8])
def test_a_slow_link_gets_the_largest_density_that_fits(algorithm, config, n: int) -> None:
    link = fake_link(10e6, 1e-3, 0.5)  # 10 Mbit/s: DDP's all-reduce of 1.1 MB takes about a second
    choice = choose_density(link, buckets(), n, algorithm, config, 0.001)
    budget = AUTO_MARGIN * link.window_s
    assert 0.001 <= choice.density < 1.0
    assert choice.dense_s > budget
    assert choice.predicted_s == pytest.approx(time_at(algorithm, config, choice.density, link, n))
    assert choice.predicted_s <= budget
    larger = [d for d in candidate_densities(0.001) if d > choice.density]
    assert all(time_at(algorithm, config, d, link, n) > budget for d in larger)


def test_a_very_slow_link_gets_the_floor_and_a_higher_floor_holds() -> None:
    link = fake_link(50e3, 1e-3, 0.5)
    assert choose_density(link, buckets(), 2, DGC, DGCConfig(), 0.001).density == 0.001
    choice = choose_density(link, buckets(), 2, DGC, DGCConfig(), 0.02)
    assert choice.density == 0.02 and choice.predicted_s > AUTO_MARGIN * link.window_s


def test_ranks_on_one_host_are_dense_whatever_the_link_measured() -> None:
    """Ranks on one machine time their waits for each other, not a link: dense; the key that tells is stable."""
    from lightning_dgc.comm import host_key

    link = fake_link(10e6, 1e-3, 0.5)  # what would compress on its own (see the test above)
    assert choose_density(link, buckets(), 2, DGC, DGCConfig(), 0.001).density < 1.0
    choice = choose_density(link, buckets(), 2, DGC, DGCConfig(), 0.001, one_host=True)
    assert choice.density == 1.0 and "one host" in choice.reason
    key = host_key()
    assert key == host_key() and key == float(int(key)) and 0 <= key < 2**32  # exact in an all-gather's float64


def test_a_latency_bound_link_stays_dense() -> None:
    # every byte free, each message step 100 ms: DGC's two collectives cost more than DDP's one all-reduce
    link = fake_link(1e15, 0.1, 0.1)
    choice = choose_density(link, buckets(), 2, DGC, DGCConfig(), 0.001)
    assert choice.density == 1.0 and "latency" in choice.reason


def test_every_compressed_density_pays_the_settings_check() -> None:
    """Below density 1 every step runs the settings check first (an all-gather over every rank), which DDP's own
    step skips: on a link of long round trips it decides against compression where the buckets alone would not."""
    link = fake_link(2e9, 1e-3, 0.01)  # 2 Gbit/s, 1 ms a message step, a short window: nothing fits
    dense = time_at(DGC, DGCConfig(), 1.0, link, 4)
    lowest = time_at(DGC, DGCConfig(), 0.001, link, 4)
    check = 3 * 1e-3  # 4 ranks: 3 steps
    assert lowest < dense < lowest + check  # the buckets alone would compress
    without = choose_density(link, buckets(), 4, DGC, DGCConfig(), 0.001)
    assert without.density < 1.0
    choice = choose_density(link, buckets(), 4, DGC, DGCConfig(), 0.001, check_s=check)
    assert choice.density == 1.0 and choice.dense_s == pytest.approx(dense) and "latency" in choice.reason
    slow = fake_link(10e6, 1e-3, 0.5)  # where bytes dominate, the check changes the price, not the choice
    cheap, checked = (choose_density(slow, buckets(), 4, DGC, DGCConfig(), 0.001, check_s=c) for c in (0.0, check))
    assert checked.density == cheap.density < 1.0 and checked.predicted_s == pytest.approx(cheap.predicted_s + check)


def test_a_link_too_fast_to_time_is_dense_and_one_rank_exchanges_nothing() -> None:
    choice = choose_density(fake_link(math.inf, 0.0, 0.01), buckets(), 2, DGC, DGCConfig(), 0.001)
    assert choice.density == 1.0 and "too fast" in choice.reason
    assert choose_density(fake_link(1e6, 1e-3, 0.01), buckets(), 1, DGC, DGCConfig(), 0.001).density == 1.0


def test_the_estimate_recovers_a_fake_link() -> None:
    bandwidth, latency, n = 80e6, 2e-3, 4
    sizes = [400_000, 650_000]  # two buckets, all-reduced one after the other
    samples = []
    for window in (0.30, 0.31, 0.29):
        volume = sum(2 * (n - 1) / n * s for s in sizes)
        busy = sum(2 * (n - 1) * latency + 2 * (n - 1) / n * 8 * s / bandwidth for s in sizes)
        samples.append(StepSample(volume, 2 * 2 * (n - 1), busy, window, (n - 1) * latency))
    link = estimate_link(samples, n)
    assert link.throughput_bps == pytest.approx(bandwidth)
    assert link.latency_s == pytest.approx(latency)
    assert link.window_s == pytest.approx(0.30)
    fast = estimate_link([StepSample(1e3, 2, 2 * latency, 0.3, latency)], 2)
    assert not fast.measurable  # all of its time was latency


def test_the_ranks_combine_to_the_least_waited_figures() -> None:
    # 1 MB in 4 latency steps of 10 ms: rank 0 waited 0.3 s for rank 1 in its all-reduces and 0.2 s in one check
    bandwidth, latency = 10e6, 0.01
    transfer = 4 * latency + 8e6 / bandwidth
    ranks = [[1e6, transfer + 0.3, 4, 0.2, 2.5], [1e6, transfer, 4, latency, 2.4]]
    link = link_from_ranks(ranks, 2)
    assert link.throughput_bps == pytest.approx(bandwidth)
    assert link.latency_s == pytest.approx(latency) and link.window_s == 2.4
    # a rank whose checks all waited long cannot make the link look too fast to time
    assert link_from_ranks([[1e6, transfer, 4, 0.5, 2.5], ranks[1]], 2).throughput_bps == pytest.approx(bandwidth)
    assert not link_from_ranks([[1e3, 4 * latency, 4, latency, 2.5]] * 2, 2).measurable


def test_the_recorder_counts_ring_volumes_and_the_time_in_flight() -> None:
    recorder = ExchangeRecorder(world_size=2)
    first, second = torch.futures.Future(), torch.futures.Future()
    start = time.perf_counter()
    recorder.issued("all_reduce", 1000, Pending("a", first, torch.zeros(250)))
    recorder.issued("all_gather", 300, Pending("b", second, torch.zeros(150)))
    time.sleep(0.02)
    first.set_result(None)
    second.set_result(None)
    sample = recorder.close_step(0.5, 0.001)
    assert sample.volume_bytes == 1000 + 300  # ring all-reduce 2 (n-1)/n S, all-gather (n-1) P
    assert sample.latency_steps == 2 + 1
    assert 0.02 <= sample.busy_s <= time.perf_counter() - start  # overlapping intervals counted once
    assert recorder.close_step(None, None).volume_bytes == 0


def test_a_schedule_is_a_floor_under_the_links_density() -> None:
    auto = AutoDensity(DGCConfig(density="auto", min_density=0.01), "DGCStrategy")
    assert auto.density == 1.0  # measuring
    auto.measuring, auto.link_density = False, 0.05
    assert auto.density == 0.05
    auto.set_floor(0.25, None)
    assert auto.density == 0.25
    auto.set_floor(0.01, None)
    assert auto.density == 0.05


def test_the_settings_are_checked() -> None:
    assert DGCConfig(density="auto").density == "auto"
    with pytest.raises(ValueError, match="'auto'"):
        DGCConfig(density="fast")
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="min_density"):
            DGCConfig(density="auto", min_density=bad)
    with pytest.raises(ValueError, match="auto_every"):
        DGCStrategy(density="auto", auto_every=-1)
    strategy = DGCStrategy(density="auto", min_density=0.01, auto_every=50)
    assert strategy.density == "auto" and strategy.config.min_density == 0.01
    assert strategy.auto_density is not None and strategy.auto_density.every == 50
    assert DGCStrategy(density=0.01).auto_density is None


def test_the_link_is_measured_first_and_again_every_auto_every_steps() -> None:
    """One process (nothing to exchange, so dense throughout): the run's first step and five measured ones,
    a choice, and a new measuring phase every `auto_every` optimizer steps."""
    from lightning_dgc.exchange.hook import exchange
    from lightning_dgc.exchange.state import ExchangeState

    config = DGCConfig(density="auto", auto_every=10)
    state = ExchangeState(config)
    param = torch.nn.Parameter(torch.randn(32, 64))
    state.register_parameters([("w", param)])
    auto = AutoDensity(config, "test")
    auto.attach(state)
    assert state.density == 1.0 and isinstance(state.collectives, TimedCollectives)
    measuring = []
    for _ in range(22):
        param.grad = torch.randn_like(param)
        auto.hooked(probe_s=1e-4)
        exchange(state, [param], param.grad.reshape(-1).clone()).wait()
        state.finish_step()
        auto.exchange_done()
        auto.step_done(state)
        measuring.append(auto.measuring)
    assert measuring == [True] * 5 + [False] * 4 + [True] * 5 + [False] * 5 + [True] * 3
    assert auto.choice is not None and auto.choice.density == 1.0 and auto.steps == 22
    assert set(auto.stats()) >= {"auto_density", "auto_measuring", "measured_exchange_ms", "compute_window_ms"}


def test_a_compressed_choice_that_steps_no_faster_than_dense_goes_back_to_dense() -> None:
    """The model prices bytes only: the steps after a compressed choice are timed against the dense steps
    measured, and the exchange goes back to dense when they were no faster (one process, real clocks)."""
    from lightning_dgc.exchange.hook import exchange
    from lightning_dgc.exchange.state import ExchangeState

    config = DGCConfig(density="auto", auto_every=0)
    state = ExchangeState(config)
    param = torch.nn.Parameter(torch.randn(32, 64))
    state.register_parameters([("w", param)])
    auto = AutoDensity(config, "test")
    auto.attach(state)

    def step(extra_s: float) -> None:
        param.grad = torch.randn_like(param)
        auto.hooked(probe_s=1e-4)
        exchange(state, [param], param.grad.reshape(-1).clone()).wait()
        state.finish_step()
        auto.exchange_done()
        time.sleep(extra_s)  # the step's own work
        auto.step_done(state)

    for _ in range(MEASURE_STEPS + 1):
        step(0.0)
    assert not auto.measuring and not auto.checking and auto.dense_step_s is not None
    # one process exchanges nothing, so the link asked for 1: start the check as a choice of 0.25 would
    auto.link_density, auto.checking = 0.25, True
    state.density = auto.density
    for _ in range(MEASURE_STEPS + 1):
        assert state.density == 0.25
        step(0.2)  # compressed steps slower than the dense ones, by more than a busy machine's jitter
    assert not auto.checking and auto.checked_step_s > auto.dense_step_s
    assert auto.link_density == 1.0 and state.density == 1.0 and "no faster" in auto.choice.reason
    auto.link_density, auto.checking, auto.dense_step_s = 0.25, True, 10.0  # now faster than dense
    state.density = auto.density
    for _ in range(MEASURE_STEPS + 1):
        step(0.0)
    assert not auto.checking and auto.link_density == 0.25 and state.density == 0.25
    assert auto.stats()["checked_step_ms"] < auto.stats()["dense_step_ms"]
