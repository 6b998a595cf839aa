"""``benchmarks.step_terms``: a collective's latency measured in a real gloo group."""

from __future__ import annotations

from tests.distributed.launch import run_ranks


def _latency(rank: int, world_size: int) -> dict[str, float]:
    from benchmarks.step_terms import collective_s

    return collective_s(repeats=3)


def test_a_collective_s_latency_is_measured_for_both_kinds() -> None:
    for result in run_ranks(_latency, 2):
        assert set(result) == {"all_reduce", "all_gather"}
        assert all(0 < seconds < 5 for seconds in result.values()), result
