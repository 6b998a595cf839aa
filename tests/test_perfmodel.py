"""The performance model on cases computed by hand."""

from __future__ import annotations

import json
import math
import random
import warnings
from pathlib import Path

import pytest

from lightning_dgc.algorithms.deft_partition import fragment_count, fragment_layers
from lightning_dgc.perfmodel import (
    METHODS,
    BucketProfile,
    Network,
    Profile,
    allgather_time,
    allgather_volume,
    doubling_allgather_time,
    doubling_allreduce_time,
    predict,
    ring_allreduce_time,
    ring_allreduce_volume,
    sparse_allreduce_worst_time,
    sparse_allreduce_worst_volume,
    speedup,
    step_time,
    validate,
    wire_bytes,
)
from lightning_dgc.perfmodel.prediction import measured_records, parse_bandwidth
from lightning_dgc.tensor_ops.codec import payload_size

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def bucket(numel: int = 1_000_000, sparse: tuple[int, ...] = (999_000,)) -> BucketProfile:
    """A bucket of compressed ``[n, 1]`` tensors of these sizes and one 1-D tensor of the rest."""
    shapes = [[n, 1] for n in sparse] + ([[numel - sum(sparse)]] if numel > sum(sparse) else [])
    return BucketProfile(shapes, 4 * numel)


def profile(
    buckets: list[BucketProfile] | None = None, compute: float = 0.1, density: float = 0.001,
    value_dtype: str = "fp32", **kw,
) -> Profile:  # fmt: skip
    """DGC and DEFT compress every tensor of more than one dimension (``min_compress_numel=1``)."""
    configs = {m: {"min_compress_numel": 1} for m in ("dgc", "deft")}
    return Profile("toy", buckets or [bucket()], compute_s=compute, density=density, value_dtype=value_dtype,
                   configs=configs, **kw)  # fmt: skip


def k_of(sparse: tuple[int, ...], density: float) -> int:
    return sum(math.ceil(density * n) for n in sparse)


# -- primitives ---------------------------------------------------------------------------------------
def test_one_worker_communicates_nothing() -> None:
    assert ring_allreduce_time(1e9, 1, 1e9, 1e-3) == 0.0
    assert allgather_time(1e6, 1, 1e9, 1e-3) == 0.0
    assert sparse_allreduce_worst_time(1e6, 1e9, 1, 1e9, 1e-3) == 0.0
    net = Network(1e9, gpus_per_node=4)
    p = profile(selection_s=0.05, backward_s=0.06)
    for method in ("ddp", "dgc", "deft", "sparse_allreduce"):
        t = step_time(p, method, 1, net)
        assert t.comm_s == t.blocking_comm_s == t.selection_s == 0.0 and t.total_s == p.compute_s
        assert speedup(p, method, 1, net) == 1.0
        assert wire_bytes(p, method, 1) == 0.0


def test_ring_allreduce_by_hand() -> None:
    assert ring_allreduce_volume(1000, 4) == 1500  # 2 (4-1)/4 * 1000
    assert ring_allreduce_volume(1000, 2) == 1000
    # 2 (n-1) L + 2 (n-1)/n * 8 S / B with S = 1 MB, n = 4, B = 1 Gbit/s, L = 10 us
    assert ring_allreduce_time(1e6, 4, 1e9, 1e-5) == pytest.approx(6e-5 + 1.5e6 * 8 / 1e9)
    assert ring_allreduce_time(0, 4, 1e9, 1e-5) == 0.0  # no message, no collective


def test_allgather_by_hand() -> None:
    assert allgather_volume(100, 8) == 700  # (n-1) * payload
    assert allgather_time(100, 8, 8000, 1e-3) == pytest.approx(7e-3 + 700 * 8 / 8000)
    assert doubling_allgather_time(100, 8, 8000, 1e-3) == pytest.approx(3e-3 + 700 * 8 / 8000)
    assert doubling_allreduce_time(100, 8, 8000, 1e-3) == pytest.approx(3 * (1e-3 + 0.1))


def test_density_doubling_worst_case_by_hand() -> None:
    # payload 100 B, dense cap 1000 B: steps receive 100, 200, 400, then 800, then capped at 1000
    assert sparse_allreduce_worst_volume(100, 1000, 2) == 100
    assert sparse_allreduce_worst_volume(100, 1000, 4) == 300
    assert sparse_allreduce_worst_volume(100, 1000, 8) == 700
    assert sparse_allreduce_worst_volume(100, 1000, 16) == 1500
    assert sparse_allreduce_worst_volume(100, 1000, 32) == 2500
    assert sparse_allreduce_worst_volume(100, 1000, 5) == 700  # ceil(log2 5) = 3 steps
    # 1000 B/s links (8000 bit/s), 1 ms latency: 3 steps, 700 B
    assert sparse_allreduce_worst_time(100, 1000, 8, 8000, 1e-3) == pytest.approx(3e-3 + 0.7)
    # with the first step on a 10x faster local bus (latency 0)
    local = sparse_allreduce_worst_time(100, 1000, 8, 8000, 1e-3, local_steps=1, local_bandwidth=80000,
                                        local_latency=0.0)  # fmt: skip
    assert local == pytest.approx(0.01 + 2e-3 + 0.6)


@pytest.mark.parametrize("n", [1, 2, 3, 8, 64, 256])
def test_hierarchical_with_one_gpu_per_node_is_flat(n: int) -> None:
    flat = Network(1e9, latency=2e-5)
    g1 = Network(1e9, latency=2e-5, gpus_per_node=1, local_bandwidth=1e12, local_latency=1e-7)
    assert g1.allreduce(12345, n) == flat.allreduce(12345, n) == ring_allreduce_time(12345, n, 1e9, 2e-5)
    assert g1.allgather(999, n) == flat.allgather(999, n) == allgather_time(999, n, 1e9, 2e-5)
    assert g1.sparse_allreduce_worst(99, 5000, n) == sparse_allreduce_worst_time(99, 5000, n, 1e9, 2e-5)
    p = profile([bucket(), bucket(50_000, (40_000,))], selection_s=0.01)
    for method in ("ddp", "dgc", "deft", "sparse_allreduce"):
        assert step_time(p, method, n, g1).total_s == step_time(p, method, n, flat).total_s


def test_hierarchical_by_hand() -> None:
    # 2 nodes of 2 GPUs; local bus 8e4 bit/s (1e4 B/s), slow link 8e3 bit/s (1e3 B/s), no latency
    net = Network(8e3, latency=0.0, gpus_per_node=2, local_bandwidth=8e4, local_latency=0.0)
    s = 1000.0
    # reduce in node: 2 (2-1)/2 S / 1e4 = 0.1 s; all-reduce of 2 nodes: S / 1e3 = 1 s; broadcast 0.1 s
    assert net.allreduce(s, 4) == pytest.approx(0.1 + 1.0 + 0.1)
    # gather P = 10 to the leader: 10/1e4; all-gather of 2 node blocks of 2P: 20/1e3; broadcast of 4P: 40/1e4
    assert net.allgather(10, 4) == pytest.approx(0.001 + 0.02 + 0.004)
    # worst case: the first (local) step 10 B at 1e4 B/s, the second 20 B at 1e3 B/s
    assert net.sparse_allreduce_worst(10, 1e6, 4) == pytest.approx(0.001 + 0.02)
    assert net.split(4) == (2, 2) and net.split(1) == (1, 1)


def test_best_algorithm_is_never_slower_than_the_ring() -> None:
    ring, best = Network(1e9, latency=1e-4), Network(1e9, latency=1e-4, algorithm="best")
    for n in (2, 4, 64, 256):
        for size in (16, 4096, 1e8):
            assert best.allreduce(size, n) <= ring.allreduce(size, n)
            assert best.allgather(size, n) <= ring.allgather(size, n)
    assert best.allreduce(16, 256) < ring.allreduce(16, 256)  # latency-bound: log2 n steps win
    assert best.allreduce(1e8, 256) == ring.allreduce(1e8, 256)  # bandwidth-bound: the ring wins


# -- bytes per bucket ---------------------------------------------------------------------------------
def test_payload_is_padded_to_four_bytes() -> None:
    # k values + (k + span // 65535) uint16 delta codes, padded to a multiple of 4 bytes:
    # span 5000 has no filler slot: 3 fp32 values + 3 codes = 12 + 6 = 18 -> 20; fp16: 6 + 6 = 12
    assert payload_size(3, 4, 5000) == (20, 2) and payload_size(3, 2, 5000) == (12, 0)
    # span 200 000 reserves 200 000 // 65535 = 3 filler slots: fp16 6 + 2 * (3 + 3) = 18 -> 20
    assert payload_size(3, 2, 200_000) == (20, 2)
    assert payload_size(0, 4, 10**6) == (0, 0)  # nothing selected, nothing sent
    p = profile([bucket(200_000, (190_000,))], density=3 / 190_000, value_dtype="fp16")
    dgc, deft = p.cost("dgc", p.buckets[0], 2), p.cost("deft", p.buckets[0], 2)
    # the 10 000 values averaged dense travel in the value dtype too (fp16: 2 bytes each)
    assert dgc.k == 3 and dgc.bytes_of("payload") == 20 and dgc.padding_bytes == 2
    assert dgc.bytes_sent == 20 + 20_000 and dgc.bytes_of("dense") == 20_000
    assert deft.bytes_of("payload") == 18  # DEFT: 3 int32 indices + 3 fp16 values, all-reduced unpadded
    p = profile([bucket(5000, (4000,))], density=3 / 4000, value_dtype="fp16")
    dgc = p.cost("dgc", p.buckets[0], 2)
    assert dgc.bytes_of("payload") == 12 and dgc.padding_bytes == 0 and dgc.bytes_sent == 12 + 2000
    assert (
        profile([BucketProfile([[10]], 40)]).cost("dgc", BucketProfile([[10]], 40), 2).bytes_of("payload")
        == 0
    )


def test_deft_bytes_grow_with_the_norm_vector_and_one_value_per_fragment() -> None:
    b = bucket(7000, (4000, 2000, 1000))
    p = profile([b], density=2 / 1000)  # k = 8 + 4 + 2 = 14
    # n = 4: tensors holding more than 1/4 of the 7000 values (4000, 2000) are cut in 4, 1000 stays whole
    assert fragment_count([4000, 2000, 1000], 4) == 4 + 4 + 1
    deft = p.cost("deft", b, 4)
    assert deft.bytes_of("control") == 8 * (9 + 4) and all(
        m.blocking for m in deft.messages if m.role == "control"
    )
    assert deft.bytes_sent == 8 * 13 + 14 * 8  # + k int32 indices and k fp32 values
    # n = 64: every tensor holds more than 1/64 and is cut in 64; each of the 192 fragments sends at
    # least one value, so the union grows from k = 14 to 192 (as DEFT's plan sizes it)
    assert p.cost("deft", b, 64).bytes_sent == 8 * (3 * 64 + 64) + 192 * 8


def test_fragment_count_mirrors_partition() -> None:
    rng = random.Random(0)
    for _ in range(200):
        numels = [rng.choice([0, 1, 3, 50, 1000, 2**16]) for _ in range(rng.randint(1, 8))]
        n = rng.choice([1, 2, 3, 8, 64, 256])
        expected = len(fragment_layers([f"p{i}" for i in range(len(numels))], numels, n))
        assert fragment_count(numels, n) == expected, (numels, n)


def test_wire_volume_per_method() -> None:
    b = bucket(1000, (800,))  # k = 8, payload 8 * 4 + 8 * 2 = 48 B, 200 dense values
    p = profile([b], density=0.01)
    assert wire_bytes(p, "ddp", 4) == pytest.approx(1.5 * 4000)
    assert wire_bytes(p, "dgc", 4) == pytest.approx(3 * 48 + 1.5 * 800)
    assert wire_bytes(p, "sparse_allreduce", 4) == pytest.approx(48 + 96 + 1.5 * 800)
    deft = p.cost("deft", b, 4)
    assert wire_bytes(p, "deft", 4) == pytest.approx(1.5 * (deft.bytes_sent - 800) + 1.5 * 800)
    # PowerSGD at rank 1: the [800, 1] matrix cannot be compressed (rank 1 costs 801 values): all dense
    assert wire_bytes(p, "powersgd", 4) == pytest.approx(1.5 * 4000)


def test_every_registered_algorithm_is_a_method() -> None:
    assert {"ddp", "dgc", "deft", "powersgd", "sparse_allreduce"} <= set(METHODS)


# -- the step -----------------------------------------------------------------------------------------
def test_overlap_by_hand() -> None:
    # one bucket: it is ready only when backward ends, so overlap hides nothing
    p = profile([bucket()], compute=1.0, backward_s=0.6)
    net = Network(1e9, latency=0.0)
    c = net.allreduce(4e6, 2)
    assert step_time(p, "ddp", 2, net, overlap=True).total_s == pytest.approx(1.0 + c)
    assert step_time(p, "ddp", 2, net, overlap=False).total_s == pytest.approx(1.0 + c)
    # two buckets: the first one's communication hides behind the backward window
    b0, b1 = bucket(), bucket(100_000, (90_000,))
    p = profile([b0, b1], compute=1.0, backward_s=0.01)
    c0, c1 = net.allreduce(4e6, 8), net.allreduce(4e5, 8)
    t = step_time(p, "ddp", 8, net, overlap=True)
    assert t.total_s == pytest.approx(1.0 + (c0 - 0.01) + c1)
    assert step_time(p, "ddp", 8, net, overlap=False).total_s == pytest.approx(1.0 + c0 + c1)


def test_selection_and_blocking_are_not_overlapped() -> None:
    net = Network(1e9)
    p = profile([bucket(), bucket()], compute=1.0, selection_s=0.2, backward_s=0.8)
    dgc = step_time(p, "dgc", 8, net, overlap=True)
    assert dgc.selection_s == 0.2 and dgc.blocking_comm_s == 0.0
    deft = step_time(p, "deft", 8, net, overlap=True)
    assert deft.selection_s == pytest.approx(0.2 / 8)  # DEFT splits the selection
    b = p.buckets[0]
    control, indices = (m.nbytes for m in p.cost("deft", b, 8).messages if m.blocking)
    one = net.duration("all_reduce", control, 8)[0] + net.duration("all_reduce", indices, 8)[0]
    assert indices == 4 * k_of((999_000,), 0.001)
    assert deft.blocking_comm_s == pytest.approx(2 * one)
    check = net.duration("all_gather", 16, 8)[0]  # the settings check before the first bucket
    assert deft.control_s == pytest.approx(check) == dgc.control_s
    assert deft.total_s == pytest.approx(1.0 + 0.2 / 8 + check + 2 * one + deft.exposed_comm_s)
    assert step_time(p, "ddp", 8, net).control_s == 0.0  # DDP checks nothing


def test_overlap_is_never_slower_and_speedup_is_n_c_over_t() -> None:
    rng = random.Random(1)
    for _ in range(50):
        buckets = [bucket(rng.randint(2000, 10**7), (1000,)) for _ in range(rng.randint(1, 6))]
        p = profile(buckets, compute=rng.uniform(0.01, 2), selection_s=rng.uniform(0, 0.1), density=0.01,
                    backward_s=rng.choice([None, rng.uniform(0, 0.5)]))  # fmt: skip
        net = Network(
            rng.choice([1e8, 1e9, 1e10]), latency=rng.uniform(0, 1e-4), gpus_per_node=rng.choice([1, 4])
        )
        for method in METHODS:
            for n in (1, 2, 16, 256):
                with_overlap = step_time(p, method, n, net, overlap=True).total_s
                without = step_time(p, method, n, net, overlap=False).total_s
                assert with_overlap <= without + 1e-12
                assert speedup(p, method, n, net) == pytest.approx(n * p.compute_s / with_overlap)
                assert speedup(p, method, n, net) <= n


def test_dgc_beats_dense_on_a_slow_link_and_dense_catches_up_on_a_fast_one() -> None:
    p = profile([bucket(25_000_000, (24_000_000,))], compute=0.2, selection_s=0.05, backward_s=0.13)
    slow, fast = Network(1e8), Network(1e11)
    assert speedup(p, "dgc", 64, slow) > 5 * speedup(p, "ddp", 64, slow)
    assert speedup(p, "ddp", 64, fast) > speedup(p, "dgc", 64, fast)  # selection costs more than it saves
    # the worst-case sparse all-reduce is no better than DGC's all-gather at large n (it reaches dense)
    assert wire_bytes(p, "sparse_allreduce", 256) > wire_bytes(p, "dgc", 2)


def test_errors_name_the_fix() -> None:
    with pytest.raises(ValueError, match="unknown method"):
        step_time(profile(), "signsgd", 2, Network(1e9))
    with pytest.raises(ValueError, match=">= 1"):
        step_time(profile(), "ddp", 0, Network(1e9))
    with pytest.raises(ValueError, match="bandwidths"):
        Network(0)
    with pytest.raises(ValueError, match="gpus_per_node"):
        Network(1e9, gpus_per_node=0)


# -- profile, prediction, validation --------------------------------------------------------------------
def test_profile_json_round_trip(tmp_path) -> None:
    real = BucketProfile([[64, 16, 3, 3], [64], [10, 64]], 4 * (9216 + 64 + 640), ["conv", "bias", "fc"])
    p = profile([real, bucket(4096, ())], selection_s=0.01, backward_s=0.05, stats={"bytes_sent": 1})
    loaded = Profile.load(p.save(tmp_path / "p.json"))
    assert loaded == p and loaded.totals("deft", 8) == p.totals("deft", 8)
    assert (
        p.totals("dgc")["bytes_sent"]
        == p.bytes_sent("dgc")
        == sum(p.cost("dgc", b, 1).bytes_sent for b in p.buckets)
    )
    json.dumps(p.to_dict())  # plain JSON


def test_a_profile_without_shapes_is_refused_with_the_fix() -> None:
    old = {"model": "old", "compute_s": 0.1, "buckets": [
        {"numel": 5000, "dense_bytes": 20000, "sparse_numels": [4000], "k": 4, "exchange_dense_numel": 1000}]}  # fmt: skip
    with pytest.raises(ValueError, match="not their `shapes`.*ExchangeProfiler"):
        Profile.from_dict(old)


def test_a_profile_whose_matrices_are_all_n_by_1_loads_with_a_warning(tmp_path) -> None:
    flat = profile([bucket(10_000, (4000, 5000))]).save(tmp_path / "flat.json")
    with pytest.warns(UserWarning, match=r"shape \[n, 1\].*PowerSGD"):
        Profile.load(flat)
    shaped = profile([BucketProfile([[40, 100], [50, 100], [1000]], 40_000)]).save(tmp_path / "shaped.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Profile.load(shaped)


@pytest.mark.parametrize("path", sorted(RESULTS.glob("profile_*.json")), ids=lambda p: p.stem)
def test_the_profile_records_keep_the_tensor_shapes(path) -> None:
    """Flattened to [n, 1], a profile prices PowerSGD as dense DDP: PowerSGD's rank-1 factors of ResNet-50
    are 1.1 MB per worker at 64 workers, DDP's all-reduce 201 MB."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = Profile.load(path)
    assert any(len(s) > 2 for b in p.buckets for s in b.shapes) or any(
        len(s) == 2 and s[1] > 1 for b in p.buckets for s in b.shapes
    )
    assert wire_bytes(p, "powersgd", 64) < 0.1 * wire_bytes(p, "ddp", 64)
    if p.model == "resnet50":
        assert wire_bytes(p, "powersgd", 64) < 0.01 * wire_bytes(p, "ddp", 64)


@pytest.mark.parametrize("path", sorted(RESULTS.rglob("scaling_*.json")), ids=lambda p: p.parent.name + "/" + p.stem)
def test_the_scaling_records_were_made_from_profiles_with_shapes(path) -> None:
    data = json.loads(path.read_text())
    p = Profile.from_dict(data["profile"])  # refuses a profile without shapes
    rows = {(r["method"], r["workers"], r["bandwidth_bps"], r["overlap"]): r for r in data["rows"]}
    key = (64, 1e9, True)
    assert rows[("powersgd", *key)]["wire_bytes"] == wire_bytes(p, "powersgd", 64, data["network"]["gpus_per_node"])
    assert rows[("powersgd", *key)]["wire_bytes"] < 0.1 * rows[("ddp", *key)]["wire_bytes"]


def test_predict_grid() -> None:
    p = profile(batch_size=32)
    pred = predict(p, workers=(1, 2, 64), bandwidths=(1e9, 1e10))
    assert len(pred.rows) == len(METHODS) * 2 * 2 * 3  # methods x bandwidths x overlap x workers
    row = pred.lookup("dgc", 64, 1e9, True)
    assert row["speedup"] == pytest.approx(speedup(p, "dgc", 64, Network(1e9)))
    assert row["throughput"] == pytest.approx(row["speedup"] * 32 / p.compute_s)
    assert pred.lookup("ddp", 1, 1e10, False)["speedup"] == 1.0
    json.dumps(pred.to_dict())


def test_parse_bandwidth() -> None:
    assert parse_bandwidth("1gbit") == 1e9 and parse_bandwidth("100mbit") == 1e8
    assert parse_bandwidth("1 Gbit/s") == 1e9 and parse_bandwidth("10G") == 1e10
    assert parse_bandwidth(100, "bandwidth_mbit") == 1e8 and parse_bandwidth(1e9, "bandwidth_bps") == 1e9
    assert parse_bandwidth("lstm") is None and parse_bandwidth(True) is None


def test_measured_records_in_nested_and_flat_layouts() -> None:
    nested = {"model": "toy", "results": {"1gbit": {"ddp": {"step_s": 0.5}, "dgc": {"step_ms": 200}}}}
    flat = [
        {"strategy": "deft", "bandwidth": "100mbit", "world_size": 2, "median_step_s": 0.3, "model": "toy"}
    ]
    found = measured_records(nested) + measured_records(flat)
    assert {(r["strategy"], r["bandwidth_bps"], r["step_s"]) for r in found} == {
        ("ddp", 1e9, 0.5),
        ("dgc", 1e9, 0.2),
        ("deft", 1e8, 0.3),
    }


def test_validate(tmp_path, capsys) -> None:
    pred = predict(profile(selection_s=0.01), workers=(1, 2), bandwidths=(1e9,))
    assert validate(pred, tmp_path / "missing.json") == []
    assert "No measurement" in capsys.readouterr().out
    measured = tmp_path / "slow_links.json"
    measured.write_text(json.dumps({"runs": [
        {"model": "toy", "strategy": "ddp", "bandwidth": "1gbit", "world_size": 2, "step_s": 0.2},
        {"model": "toy", "strategy": "dgc", "bandwidth_mbit": 100, "world_size": 2, "step_s": 0.15,
         "shared_cpu_one_worker_step_time_s": 0.2},
        {"model": "other", "strategy": "dgc", "bandwidth": "1gbit", "step_s": 9.0},
        {"model": "toy", "strategy": "signsgd", "bandwidth": "1gbit", "step_s": 0.3},
    ]}))  # fmt: skip
    rows = validate(pred, measured)
    assert [(r["strategy"], r["bandwidth_bps"]) for r in rows] == [("ddp", 1e9), ("dgc", 1e8)]
    expected = pred.step_time("ddp", 2, 1e9).total_s
    assert rows[0]["predicted_s"] == pytest.approx(expected)
    assert rows[0]["error"] == pytest.approx(expected / 0.2 - 1)
    assert "predicted_shared_compute_s" not in rows[0]
    # with the shared-CPU compute time (0.2 s instead of 0.1 s), only the compute part changes
    shared = rows[1]["predicted_shared_compute_s"]
    assert shared == pytest.approx(pred.step_time("dgc", 2, 1e8).total_s + 0.1)
    assert rows[1]["error_shared_compute"] == pytest.approx(shared / 0.15 - 1)


# -- latency, channels, the exchange's measured time ---------------------------------------------------------
def test_a_collective_takes_the_longer_of_its_latency_steps_and_its_bytes_plus_one_step() -> None:
    net = Network(8e6, latency=0.01)  # 1 MB/s, 10 ms a step
    # 4 workers: 6 steps of all-reduce; 100 bytes are latency-bound, 1 MB bandwidth-bound
    assert net.duration("all_reduce", 100, 4) == pytest.approx((0.06, 1.5 * 100 / 1e6))
    assert net.duration("all_reduce", 1e6, 4) == pytest.approx((1.5 + 0.01, 1.5))
    assert net.duration("all_gather", 100, 4) == pytest.approx((0.03, 300 / 1e6))
    assert net.parts("all_reduce", 1e6, 4) == pytest.approx((0.06, 1.5))


def test_channels_run_collectives_in_order_and_blocking_ones_hold_the_next() -> None:
    from lightning_dgc.perfmodel.network import channels_end

    # two channels: 3 and 5 side by side, the third (3) after the first
    assert channels_end([(3.0, False), (5.0, False), (3.0, False)], 2) == 6.0
    assert channels_end([(3.0, False), (5.0, False), (3.0, False)], 1) == 11.0
    # a blocking one is waited for before the next is issued
    assert channels_end([(3.0, True), (5.0, False)], 2) == 8.0


def test_the_timeline_of_a_latency_bound_step_by_hand() -> None:
    """DGC on 4 workers, 10 ms a step, two channels (gloo's threads): the settings check (an all-gather: 3 steps),
    then each bucket's all-gather (3 steps) and all-reduce (6 steps) side by side, the second bucket's once a channel
    is free; nothing overlaps the backward pass, which is over by then."""
    b = BucketProfile([[1000, 100], [100]], 4 * 100_100)
    p = Profile("toy", [b, b], compute_s=0.002, backward_s=0.001, density=0.001)
    net = Network(1e12, latency=0.01, concurrency=2)
    t = step_time(p, "dgc", 4, net)
    assert t.control_s == pytest.approx(0.03, rel=1e-3)
    # after the check (30 ms): AG1 [30, 60], AR1 [30, 90]; AG2 [60, 90], AR2 [90, 150] on the first free channel
    assert t.total_s == pytest.approx(0.002 - 0.001 + 0.150, rel=1e-3)
    serial = step_time(p, "dgc", 4, Network(1e12, latency=0.01))
    assert serial.total_s == pytest.approx(0.001 + 0.03 + 2 * 0.09, rel=1e-3)


def test_a_measured_exchange_time_replaces_the_selection() -> None:
    p = profile([bucket()], compute=1.0, selection_s=0.2, exchange_s={"dgc": 0.05})
    net = Network(1e9)
    dgc, deft = step_time(p, "dgc", 8, net), step_time(p, "deft", 8, net)
    assert (dgc.selection_s, dgc.exchange_s) == (0.0, 0.05)
    assert (deft.selection_s, deft.exchange_s) == (pytest.approx(0.2 / 8), 0.0)  # not measured: its selection
    assert dgc.total_s == pytest.approx(step_time(profile([bucket()], compute=1.0), "dgc", 8, net).total_s + 0.05)
