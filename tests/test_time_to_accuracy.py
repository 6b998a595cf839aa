"""``benchmarks.time_to_accuracy``: the rates it takes, and its report on recorded runs (no training here)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import time_to_accuracy as tta


def test_rates_read_as_mbit_and_none_is_unshaped() -> None:
    assert [tta.parse_rate(r) for r in ("10mbit", "1gbit", "500kbit", "none", "100")] == [10, 1000, 0.5, None, 100]
    assert [tta.link_name(r) for r in (10.0, 1000.0, None)] == ["10mbit", "1gbit", "none"]
    assert tta.parse_delay("10ms") == 10.0
    with pytest.raises(argparse.ArgumentTypeError, match="10mbit"):
        tta.parse_rate("fast")


def _run(method: str, link: str, seed: int, accs: list[float], step_s: float) -> dict:
    history = [{"step": 10 * (i + 1), "wall_s": 100.0 * (i + 1), "val_s": 5.0 * (i + 1), "val_acc": a}
               for i, a in enumerate(accs)]  # fmt: skip
    return {"task": "cifar10", "method": method, "link": link, "seed": seed, "history": history,
            "final": history[-1], "median_step_s": step_s}  # fmt: skip


def test_the_report_times_each_method_to_ddps_accuracy_less_half_a_point() -> None:
    runs = [
        _run("ddp", "none", 42, [0.3, 0.5, 0.6], 1.0), _run("ddp", "10mbit", 42, [0.3, 0.5, 0.6], 2.0),
        _run("dgc", "10mbit", 42, [0.4, 0.596, 0.61], 1.2), _run("dgc", "10mbit", 43, [0.596, 0.6, 0.6], 1.2),
        _run("powersgd", "10mbit", 42, [0.3, 0.5, 0.59], 1.1),
    ]  # fmt: skip
    rows = {(r["link"], r["method"]): r for r in tta.report({"runs": runs})}
    assert rows["none", "ddp"]["target"] == pytest.approx(0.595)
    assert rows["10mbit", "ddp"]["time_to_target_s"] == pytest.approx(300 - 15)
    assert rows["10mbit", "dgc"]["time_to_target_s"] == pytest.approx(((200 - 10) + (100 - 5)) / 2)  # mean of 2 seeds
    assert rows["10mbit", "powersgd"]["time_to_target_s"] is None and rows["10mbit", "powersgd"]["best"] == 0.59
    assert rows["10mbit", "ddp"]["ddp_efficiency"] == pytest.approx(0.5)  # compute-only 1.0 s over 2.0 s
    assert rows["none", "ddp"]["ddp_efficiency"] == pytest.approx(1.0) and rows["10mbit", "dgc"]["ddp_efficiency"] is None
