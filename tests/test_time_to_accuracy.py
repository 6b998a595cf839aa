"""``benchmarks.time_to_accuracy``: the rates it takes, and its report on recorded runs (no training here)."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import time_to_accuracy as tta


def test_rates_read_as_mbit_and_none_is_unshaped() -> None:
    assert [tta.parse_rate(r) for r in ("10mbit", "1gbit", "500kbit", "none", "100")] == [10, 1000, 0.5, None, 100]
    assert [tta.link_name(r) for r in (10.0, 1000.0, None)] == ["10mbit", "1gbit", "none"]
    assert tta.parse_delay("10ms") == 10.0
    with pytest.raises(argparse.ArgumentTypeError, match="10mbit"):
        tta.parse_rate("fast")


def test_a_schedule_reads_as_epochs_batches_and_evaluation_interval() -> None:
    assert tta.parse_schedule("1,315,63") == (1, 315, 63)
    args = argparse.Namespace(quick=False, schedule=None)
    assert tta.schedule_of(args, "ptb") == tta.SCHEDULES["ptb"]
    assert tta.schedule_of(argparse.Namespace(quick=False, schedule=(1, 315, 63)), "ptb") == (1, 315, 63)
    assert tta.schedule_of(argparse.Namespace(quick=True, schedule=(1, 315, 63)), "ptb") == tta.QUICK
    for bad in ("1,315", "0,315,63", "1,x,63", "1,-3,1"):
        with pytest.raises(argparse.ArgumentTypeError, match="EPOCHS,BATCHES,EVERY"):
            tta.parse_schedule(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="multiple of EVERY"):
        tta.parse_schedule("1,315,60")


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


def test_the_readme_table_gives_each_link_a_row_and_each_method_a_column() -> None:
    runs = [
        _run("ddp", "none", 42, [0.3, 0.5, 0.6], 1.0), _run("ddp", "10mbit", 42, [0.3, 0.5, 0.6], 2.0),
        _run("dgc", "10mbit", 42, [0.4, 0.596, 0.61], 1.2), _run("powersgd", "10mbit", 42, [0.3, 0.5, 0.59], 1.1),
    ]  # fmt: skip
    lines = tta.markdown_table({"runs": runs})
    assert lines[0] == "| method | 10 Mbit/s, DDP efficiency 50%: to 58.0% | to 59.50% (DDP's final - 0.5 points) |"
    assert lines[2] == "| `ddp` unshaped (compute only; 1 seed) | 285 s | 285 s |"
    assert lines[3] == "| `ddp` | 285 s | 285 s |"
    assert lines[4] == "| `algo/dgc_regimes` | 190 s (1.50x) | 190 s (1.50x) |"
    assert lines[5] == "| `powersgd` | 285 s (1.00x) | not reached (best 59.00%) |"


def test_a_cell_that_some_seeds_reached_says_how_many_and_how_far_the_others_got() -> None:
    """A mean over the seeds that reached the target alone would flatter the method; 'not reached' with the best of
    every seed would show a best above the target."""
    runs = [
        _run("ddp", "none", 42, [0.3, 0.5, 0.6], 1.0), _run("ddp", "10mbit", 42, [0.3, 0.5, 0.6], 2.0),
        _run("dgc", "10mbit", 42, [0.4, 0.596, 0.61], 1.2), _run("dgc", "10mbit", 43, [0.4, 0.57, 0.575], 1.2),
        _run("dgc", "10mbit", 44, [0.4, 0.59, 0.585], 1.2),
    ]  # fmt: skip
    lines = tta.markdown_table({"runs": runs})
    assert lines[4] == (
        "| `algo/dgc_regimes` | 2/3 seeds, in 190 s; the others' best 57.50%"
        " | 1/3 seeds, in 190 s; the others' best 59.00% |"
    )


def test_appending_replaces_a_run_measured_again_and_keeps_the_others(tmp_path) -> None:
    path = tmp_path / "tta.json"
    old = {"runs": [_run("ddp", "none", 42, [0.6], 1.0), _run("dgc", "10mbit", 42, [0.5], 1.0)],
           "links": [{"link": "none", "measured_goodput_mbit": None}], "errors": ["an old one"]}  # fmt: skip
    path.write_text(json.dumps(old))
    new = {"runs": [_run("dgc", "10mbit", 42, [0.7], 2.0)], "links": [{"link": "10mbit", "measured_goodput_mbit": 9.5}],
           "errors": []}  # fmt: skip
    merged = tta.merged(path, new)
    assert [(r["method"], r["final"]["val_acc"]) for r in merged["runs"]] == [("ddp", 0.6), ("dgc", 0.7)]
    assert [lk["link"] for lk in merged["links"]] == ["none", "10mbit"] and merged["errors"] == ["an old one"]
    assert tta.merged(tmp_path / "absent.json", new) is new


def test_a_steps_time_splits_into_compute_selection_and_the_rest_beside_the_models_step() -> None:
    ddp, dgc = _run("ddp", "none", 42, [0.6], 0.3), _run("dgc", "10mbit", 42, [0.6], 0.5)
    dgc["compression"] = {"selection_ms": 200.0, "steps": 10}  # the run's sum
    ddp10 = _run("ddp", "10mbit", 42, [0.6], 1.2)
    result = {"runs": [ddp, dgc, ddp10], "links": [{"link": "none", "measured_goodput_mbit": None},
                                                   {"link": "10mbit", "measured_goodput_mbit": 10.0}]}  # fmt: skip
    rows = {(w["link"], w["method"]): w for w in tta.where_time_goes(result)}
    w = rows["10mbit", "dgc"]
    assert (w["compute_s"], w["selection_s"]) == (0.3, pytest.approx(0.02)) and w["rest_s"] == pytest.approx(0.18)
    # the model: DDP's ring all-reduce of ResNet-20's 1.08 MB of fp32 gradients takes ~0.86 s at 10 Mbit/s
    assert 0.8 < rows["10mbit", "ddp"]["predicted_step_s"] < 1.3
    assert w["predicted_step_s"] < rows["10mbit", "ddp"]["predicted_step_s"]
    assert rows["none", "ddp"]["predicted_step_s"] is None  # no goodput measured on the unshaped link


def test_a_task_without_a_lower_level_names_the_link_on_its_target_column() -> None:
    """PTB has no lower level than its target: the link and DDP's efficiency head the target's column."""
    def ptb(method: str, link: str, ppls: list[float], step_s: float) -> dict:
        run = _run(method, link, 42, [0.0], step_s)
        run["history"] = [{"step": 10 * (i + 1), "wall_s": 100.0 * (i + 1), "val_s": 5.0 * (i + 1), "val_ppl": p}
                          for i, p in enumerate(ppls)]  # fmt: skip
        run.update(task="ptb", final=run["history"][-1])
        return run

    runs = [ptb("ddp", "none", [300, 200, 150], 1.0), ptb("ddp", "200mbit", [300, 200, 150], 4.0),
            ptb("auto", "200mbit", [250, 152, 149], 2.0)]  # fmt: skip
    lines = tta.markdown_table({"runs": runs}, "ptb")
    assert lines[0] == "| method | 200 Mbit/s, DDP efficiency 25%: to 153.00 (DDP's final + 2%) |"
    assert lines[3:] == ["| `ddp` | 285 s |", '| `density="auto"` | 190 s (1.50x) |']
