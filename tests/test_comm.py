"""DGC's wire format: values + uint16 delta codes of the indices (pure tensor math, one process)."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_dgc import algorithms, comm
from lightning_dgc.algorithms.dgc import DGC, DGCConfig
from lightning_dgc.tensor_ops import codec
from lightning_dgc.tensor_ops.codec import (
    CODE_BYTES,
    FILLER_SPAN,
    pack_into,
    payload_nbytes,
    payload_values,
    unpack,
)

DTYPES = (torch.float32, torch.float16, torch.int8)
FLOATS = (torch.float32, torch.float16)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def value_part(k: int, dtype: torch.dtype) -> int:
    """Bytes ahead of the codes: k values, or for int8 a 4-byte scale per 32 values and k levels, padded to even."""
    if dtype != torch.int8:
        return k * dtype.itemsize
    raw = 4 * ((k + 31) // 32) + k
    return raw + raw % 2


def on_the_wire(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the receiver decodes: a cast, or for int8 each value rounded to a multiple of its block's
    max |v| / 127 (blocks of 32 in order)."""
    if dtype != torch.int8:
        return values.to(dtype)
    out = []
    for block in values.split(32):
        scale = block.abs().max() / 127
        out.append(block if scale == 0 else (block / scale).round().clamp(-127, 127) * scale)
    return torch.cat(out)


def packed(indices, values, dtype: torch.dtype, span: int, device: str = "cpu") -> torch.Tensor:
    indices = torch.as_tensor(indices, dtype=torch.int64, device=device)
    values = torch.as_tensor(values, dtype=torch.float32, device=device)
    payload = torch.full(
        (payload_nbytes(indices.numel(), dtype, span),), 0xAB, dtype=torch.uint8, device=device
    )
    pack_into(payload, indices, values, dtype, span)
    return payload


def codes_of(payload: torch.Tensor, k: int, dtype: torch.dtype, span: int) -> list[int]:
    start = value_part(k, dtype)
    raw = payload[start : start + CODE_BYTES * (k + span // FILLER_SPAN)].view(torch.int16)
    return (raw.to(torch.int32) & 0xFFFF).tolist()


def round_trip(
    rows: list[list[int]], span: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0
) -> None:
    """Pack every row's index set, stack the payloads as all_gather would, and decode them exactly."""
    g = torch.Generator().manual_seed(seed)
    k = len(rows[0])
    values = [torch.randn(k, generator=g) for _ in rows]
    gathered = torch.stack([packed(r, v, dtype, span, device) for r, v in zip(rows, values, strict=True)])
    assert gathered.shape == (len(rows), payload_nbytes(k, dtype, span)) and gathered.shape[1] % 4 == 0
    indices, decoded = unpack(gathered, k, dtype, span)
    assert indices.dtype == torch.int64 and decoded.dtype == (torch.float32 if dtype == torch.int8 else dtype)
    assert indices.shape == decoded.shape == (len(rows) * k,)
    assert indices.cpu().tolist() == [i for r in rows for i in r]
    expected = torch.cat([on_the_wire(v, dtype) for v in values])  # exact for fp32, cast for fp16, int8 levels
    assert torch.allclose(decoded.cpu(), expected, rtol=1e-6, atol=0) if dtype == torch.int8 else torch.equal(
        decoded.cpu(), expected
    )


# -- size and layout ------------------------------------------------------------------------------------
def test_payload_size_by_hand() -> None:
    # k values + (k + span // 65535) uint16 codes, rounded up to 4 bytes
    assert payload_nbytes(3, torch.float32, 5000) == 20  # 12 + 6 = 18, padded to 20
    assert payload_nbytes(3, torch.float16, 5000) == 12  # 6 + 6, aligned already
    assert payload_nbytes(3, torch.float16, 200_000) == 20  # 6 + 2 * (3 + 3 fillers) = 18, padded
    assert payload_nbytes(4, torch.float32, 65_534) == 24 and payload_nbytes(4, torch.float32, 65_535) == 28
    assert payload_nbytes(0, torch.float32, 10**6) == 0  # nothing selected: no payload at all
    # ResNet-50-like: 25 533 values in one bucket of 25 557 032 (389 filler slots)
    assert payload_nbytes(25_533, torch.float32, 25_557_032) == 4 * 25_533 + 2 * (25_533 + 389) == 153_976
    assert payload_nbytes(25_533, torch.float16, 25_557_032) == 2 * 25_533 + 2 * (25_533 + 389) + 2 == 102_912
    # int8: a 4-byte scale, k levels padded to an even length, then the codes
    assert payload_nbytes(3, torch.int8, 5000) == 16  # 4 + 3 + 1 + 6 = 14, padded
    # 798 scales (one per 32 values) and the levels, 28 725 bytes padded to even, then the codes
    assert payload_nbytes(25_533, torch.int8, 25_557_032) == 4 * 798 + 25_534 + 2 * (25_533 + 389) + 2 == 80_572
    with pytest.raises(ValueError, match="out of a bucket"):
        payload_nbytes(11, torch.float32, 10)


@pytest.mark.parametrize("dtype", DTYPES)
def test_payload_is_four_byte_aligned_and_is_what_dgc_reports(dtype: torch.dtype) -> None:
    """The payload formula, and DGC's wire cost (read by the statistics and the performance model) uses it."""
    value_dtype = {torch.float32: "fp32", torch.float16: "fp16", torch.int8: "int8"}[dtype]
    for span in (1, 7, 1000, 65_534, 65_535, 65_536, 131_070, 10**6, 25_557_032):
        for k in {min(span, k) for k in (1, 2, 3, 5, 17, 999, span // 2 or 1, span if span < 10**5 else 1)}:
            n = payload_nbytes(k, dtype, span)
            assert n % 4 == 0 and 0 <= n - (value_part(k, dtype) + 2 * (k + span // 65535)) <= 2
            assert (n, codec.payload_padding(k, dtype, span)) == codec.payload_size(k, dtype.itemsize, span)
    rng = random.Random(0)
    for _ in range(50):  # one compressed [rows, cols] tensor of `span` values: k = ceil(density * span)
        cols = rng.randint(1024, 10**6)
        density = rng.choice((0.001, 0.01))
        layout = algorithms.layout_of(["w"], [[1, cols]])
        cost = DGC.wire_cost(
            DGCConfig(density=density, value_dtype=value_dtype, min_compress_numel=1), layout, 2, 4 * cols
        )
        k = cost.k
        assert cost.bytes_of("payload") == payload_nbytes(
            k, dtype, cols
        ) and cost.padding_bytes == codec.payload_padding(k, dtype, cols)


@pytest.mark.parametrize("dtype", FLOATS)
def test_values_come_first_then_codes_then_zero_padding(dtype: torch.dtype) -> None:
    span, k = 200_000, 3  # F = 3
    p = packed([2, 70_000, 199_999], [1.0, 2.0, 3.0], dtype, span)
    assert payload_values(p, k, dtype).tolist() == [1.0, 2.0, 3.0]
    # gaps 3, 69 998, 129 999: the second needs 1 filler (69 998 = 65 535 + 4 463), the third 1
    # (129 999 = 65 535 + 64 464); one filler slot is left over at the end
    assert codes_of(p, k, dtype, span) == [3, 0, 4463, 0, 64464, 0]
    end = k * dtype.itemsize + 2 * 6
    assert p[end:].tolist() == [0] * (p.numel() - end)  # the padding is zeroed, not left as it was


def test_int8_scale_then_levels_then_codes() -> None:
    span, k = 200_000, 3
    p = packed([2, 70_000, 199_999], [0.5, -1.27, 0.01], torch.int8, span)
    assert p[:4].view(torch.float32).item() == pytest.approx(0.01)  # max |v| / 127
    assert p[4:7].view(torch.int8).tolist() == [50, -127, 1] and p[7].item() == 0  # padded to even
    assert codes_of(p, k, torch.int8, span) == [3, 0, 4463, 0, 64464, 0]
    assert payload_values(p, k, torch.int8).tolist() == pytest.approx([0.5, -1.27, 0.01])
    zeros = packed([1, 2], [0.0, 0.0], torch.int8, span)  # a scale of 0 decodes to zeros, not NaN
    assert payload_values(zeros, 2, torch.int8).tolist() == [0.0, 0.0]
    # 40 values: two blocks, each with its own scale (the second block's small values keep their precision)
    values = torch.cat([torch.full((32,), 100.0), torch.tensor([0.5, -0.25] * 4)])
    p = packed(list(range(0, 80, 2)), values, torch.int8, span)
    assert p[:8].view(torch.float32).tolist() == pytest.approx([100 / 127, 0.5 / 127])
    half_steps = [50 / 127] * 32 + [0.25 / 127] * 8  # rounding error at most half its block's scale
    assert (payload_values(p, 40, torch.int8) - values).abs().le(torch.tensor(half_steps) * 1.0001).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_an_int8_block_with_a_non_finite_value_decodes_all_non_finite(bad: float) -> None:
    """Its scale carries it: the receivers' finiteness check (a sum over every value) sees it, as it sees an
    fp32 NaN; the other block of the row decodes as usual."""
    span, k = 1000, 40
    good = packed(list(range(k)), torch.ones(k), torch.int8, span)
    values = torch.ones(k)
    values[35] = bad  # the second block
    poisoned = packed(list(range(k)), values, torch.int8, span)
    _, decoded = unpack(torch.stack([good, poisoned]), k, torch.int8, span)
    assert decoded[:k].isfinite().all() and decoded[k : k + 32].tolist() == [1.0] * 32
    assert not decoded[k + 32 :].isfinite().any() and not decoded.sum().isfinite()


# -- round trips ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_small_bucket_without_fillers(dtype: torch.dtype, device: str) -> None:
    g = torch.Generator().manual_seed(1)
    span = 60_000  # F = 0
    rows = [sorted(torch.randperm(span, generator=g)[:37].tolist()) for _ in range(3)]
    round_trip(rows, span, dtype, device)
    round_trip([[0, span - 1]], span, dtype, device)
    round_trip([[65_534]], 65_535, dtype, device)  # the largest single code, F = 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_across_huge_gaps(dtype: torch.dtype, device: str) -> None:
    span = 3_000_000
    round_trip([[0, 65_534, 65_535, 200_000, span - 1]], span, dtype, device)
    # gaps of exactly 65 535 (one code), 65 536 (a filler + 1), 131 070 (a filler + 65 535),
    # 131 071 (two fillers + 1) and multiples of 65 535
    gaps = [65_535, 65_536, 131_070, 131_071, 3 * 65_535, 5 * 65_535 + 1, 1, 1, 65_535]
    row = [sum(gaps[: i + 1]) - 1 for i in range(len(gaps))]
    assert row[-1] < span
    p = packed(row, torch.ones(len(row)), torch.float32, span)
    assert codes_of(p, len(row), torch.float32, span)[:21] == [
        65_535, 0, 1, 0, 65_535, 0, 0, 1, 0, 0, 65_535, 0, 0, 0, 0, 0, 1, 1, 1, 65_535, 0,
    ]  # fmt: skip
    other = [5, 6, 7, 100_000, 1_000_000, 2_000_000, 2_500_000, 2_999_998, 2_999_999]
    round_trip([row, other, list(range(span - len(row), span))], span, dtype, device)


@pytest.mark.parametrize("device", DEVICES)
def test_one_value_at_the_very_end_uses_every_filler(device: str) -> None:
    for span in (65_535, 65_536, 3 * 65_535, 3 * 65_535 + 1, 25_557_032):
        round_trip([[span - 1], [0], [span // 2]], span, torch.float32, device)
    span = 3 * 65_535 + 1  # F = 3 and the single gap of span values needs all 3 fillers
    assert codes_of(packed([span - 1], [1.0], torch.float32, span), 1, torch.float32, span) == [0, 0, 0, 1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_dense_selections(dtype: torch.dtype, device: str) -> None:
    for span in (1, 10, 65_535, 70_000, 140_000):
        round_trip([list(range(span))], span, dtype, device)  # every value
        round_trip([list(range(1, span)) or [0], list(range(span - 1)) or [0]], span, dtype, device)
    span = 140_000
    round_trip([list(range(0, span, 2)), list(range(1, span, 2))], span, dtype, device)


def test_filler_bound_worst_cases() -> None:
    # total fillers = sum((d_i - 1) // 65535) <= (span - K) // 65535 <= span // 65535 = F
    for span in (65_535, 65_536, 131_070, 131_071, 10**6, 25_557_032):
        for k in (1, 2, 3, 100):
            # worst case: all the span - K unselected positions in one gap (first or last)
            for row in (list(range(k - 1)) + [span - 1], [span - k + i for i in range(k)]):
                gaps = torch.diff(torch.tensor(row), prepend=torch.tensor([-1]))
                fillers = int(((gaps - 1) // 65_535).sum())
                assert fillers == (span - k) // 65_535 <= span // 65_535
                round_trip([row], span, torch.float16)
    # many gaps of 65 536 values, one filler each: still within F
    k = 300
    span = 65_536 * k
    row = [65_536 * (i + 1) - 1 for i in range(k)]
    assert span // 65_535 >= k
    round_trip([row, list(range(k))], span, torch.float32)


def test_random_index_sets() -> None:
    rng = random.Random(2)
    g = torch.Generator().manual_seed(2)
    for case in range(300):
        span = rng.choice([rng.randint(1, 70_000), rng.randint(65_535, 3_000_000)])
        if rng.random() < 0.5:  # uniform index sets
            k = rng.randint(1, min(span, 500))
            rows = [sorted(rng.sample(range(span), k)) for _ in range(rng.randint(1, 4))]
        else:  # gaps drawn near the filler boundaries, cut to the span
            k = rng.randint(1, 40)
            rows = []
            for _ in range(rng.randint(1, 3)):
                choices = [1, 2, 65_534, 65_535, 65_536, 131_071, rng.randint(1, 400_000)]
                steps = torch.tensor([rng.choice(choices) for _ in range(k)])
                row = (torch.cumsum(steps, 0) - 1).clamp(max=span - 1)
                row = torch.unique(torch.cat([row, torch.randint(span, (2 * k,), generator=g)]))[:k]
                rows.append(row.tolist())
            k = min(len(r) for r in rows)
            rows = [r[:k] for r in rows]
        for r in rows:
            gaps = torch.diff(torch.tensor(r), prepend=torch.tensor([-1]))
            assert int(((gaps - 1) // 65_535).sum()) <= span // 65_535
        round_trip(rows, span, DTYPES[case % 2], seed=case)


# -- reuse, odd rows, errors ------------------------------------------------------------------------------
def test_a_reused_payload_forgets_the_previous_step() -> None:
    span, dtype = 1_000_000, torch.float32
    payload = torch.empty(payload_nbytes(3, dtype, span), dtype=torch.uint8)
    pack_into(payload, torch.tensor([999_997, 999_998, 999_999]), torch.ones(3), dtype, span)  # 15 fillers
    pack_into(payload, torch.tensor([0, 1, 2]), torch.full((3,), 2.0), dtype, span)
    indices, values = unpack(payload.view(1, -1), 3, dtype, span)
    assert indices.tolist() == [0, 1, 2] and values.tolist() == [2.0] * 3


@pytest.mark.parametrize("span", [1000, 1_000_000])
def test_rows_not_written_by_pack_into_stay_in_range(span: int) -> None:
    k, dtype = 4, torch.float32
    poisoned = torch.zeros(payload_nbytes(k, dtype, span), dtype=torch.uint8)
    payload_values(poisoned, k, dtype).fill_(float("nan"))  # a rank with a non-finite gradient
    good = packed([1, 2, 3, span - 1], [1.0, 2.0, 3.0, 4.0], dtype, span)
    garbage = torch.randint(0, 256, good.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    indices, values = unpack(torch.stack([good, poisoned, garbage]), k, dtype, span)
    assert indices[:4].tolist() == [1, 2, 3, span - 1] and indices[4:8].tolist() == [0] * 4
    assert values[4:8].isnan().all() and ((indices >= 0) & (indices < span)).all()


def test_empty_selection() -> None:
    payload = torch.empty(0, dtype=torch.uint8)
    pack_into(payload, torch.empty(0, dtype=torch.int64), torch.empty(0), torch.float16, 10**6)
    indices, values = unpack(torch.empty(2, 0, dtype=torch.uint8), 0, torch.float16, 10**6)
    assert indices.shape == values.shape == (0,) and values.dtype == torch.float16


def test_contract_violations_raise_on_cpu() -> None:
    span, dtype = 200_000, torch.float32
    payload = torch.empty(payload_nbytes(3, dtype, span), dtype=torch.uint8)
    for bad, match in (
        ([5, 3, 9], "sorted"),
        ([3, 3, 9], "sorted"),
        ([-1, 3, 9], "sorted"),
        ([1, 3, span], "outside"),
    ):
        with pytest.raises(ValueError, match=match):
            pack_into(payload, torch.tensor(bad), torch.ones(3), dtype, span)
    with pytest.raises(ValueError, match="payload_nbytes"):
        pack_into(payload[:-4], torch.tensor([1, 2, 3]), torch.ones(3), dtype, span)
    with pytest.raises(ValueError, match="values"):
        pack_into(payload, torch.tensor([1, 2, 3]), torch.ones(2), dtype, span)
    with pytest.raises(ValueError, match="uint8"):
        unpack(payload.view(1, -1)[:, :-4], 3, dtype, span)


def _pending(what: str) -> comm.Pending:
    return comm.Pending(what, torch.futures.Future(), torch.zeros(3))


def _fails_with(message: str) -> tuple[torch.futures.Future, torch.futures.Future]:
    """``(trigger, future)``: setting ``trigger`` completes ``future`` with a C++ error, as a failed
    collective's work future is (``Future.set_exception`` only wraps the error in a successful result)."""

    def fail(_: torch.futures.Future) -> None:
        raise RuntimeError(message)

    trigger: torch.futures.Future = torch.futures.Future()
    return trigger, trigger.then(fail)


def test_when_all_runs_once_every_collective_is_done() -> None:
    first, second = _pending("first"), _pending("second")
    calls = []
    result = comm.when_all(
        [first, second], lambda: calls.append(1) or first.output + second.output, torch.device("cpu")
    )
    first.future.set_result([first.output])
    assert not result.done() and not calls
    second.output.fill_(2.0)
    second.future.set_result([second.output])
    assert torch.equal(result.wait(), torch.full((3,), 2.0)) and calls == [1]


def test_when_all_without_collectives_completes_at_once() -> None:
    assert torch.equal(comm.when_all([], lambda: torch.ones(2), torch.device("cpu")).wait(), torch.ones(2))


def test_a_failed_collective_fails_the_bucket_by_name_even_while_another_is_pending() -> None:
    """A peer's death must reach the caller as an error naming the collective, not a stale result."""
    trigger, future = _fails_with("Connection closed by peer")
    slow, failing = (
        _pending("all-gather of the sparse payload"),
        comm.Pending("all-reduce of the dense tensors", future, torch.zeros(1)),
    )
    result = comm.when_all([slow, failing], lambda: torch.zeros(1), torch.device("cpu"))
    trigger.set_result(None)
    assert result.done(), "the error must not wait for the other collective"
    with pytest.raises(RuntimeError, match=r"CollectiveError: lightning_dgc: the all-reduce of the dense tensors"
                       r" failed on rank 0: .*Connection closed by peer"):  # fmt: skip
        result.wait()


def test_pending_wait_names_the_collective() -> None:
    trigger, future = _fails_with("Timed out waiting 10000ms")
    pending = comm.Pending("all-reduce of DEFT's values", future, torch.zeros(1))
    trigger.set_result(None)
    with pytest.raises(comm.CollectiveError, match="all-reduce of DEFT's values failed .* Timed out"):
        pending.wait()


def _sub_group_ranks(rank: int, world_size: int) -> tuple[int, int, int]:
    """In a real process group: this process's ranks in the collectives of a group of rank 1 alone."""
    import torch.distributed as dist

    group = dist.new_group([1])  # every process creates every group
    if rank != 1:
        return -1, -1, -1
    collectives = comm.TorchCollectives(group)
    return collectives.rank, collectives.global_rank, collectives.all_reduce(torch.zeros(1), "x").rank


def test_collectives_of_a_sub_group_name_the_process_by_its_global_rank() -> None:
    """A two-level exchange's groups number their ranks from 0; an error must name the process in the job."""
    from tests.distributed.launch import run_ranks

    assert run_ranks(_sub_group_ranks, 2)[1] == (0, 1, 1)
