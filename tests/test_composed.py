"""``benchmarks.composed``: the arithmetic of a composed time to accuracy, on made-up runs (no training here)."""

from __future__ import annotations

import json

import pytest

from benchmarks import common, composed

GOODPUT = 8.0  # Mbit/s: a byte costs 1 microsecond


def _history(start_s: float, step_s: float, bytes_per_step: list[float], accs: list[float], every: int = 100,
             val_s: float = 3.0) -> list[dict]:  # fmt: skip
    """A run evaluated every ``every`` steps: each stretch at its bytes per step, on a link of ``GOODPUT``."""
    out, steps, sent, wall = [], 0, 0.0, start_s
    for i, (b, acc) in enumerate(zip(bytes_per_step, accs, strict=True)):
        steps += every
        sent += every * b
        wall += every * step_s + every * b * 8 / (GOODPUT * 1e6) + val_s
        out.append({"step": steps, "wall_s": wall, "val_s": val_s * (i + 1), "link_bytes": sent, "val_acc": acc})
    return out


def test_a_price_recovers_start_up_and_step_and_the_composition_adds_the_bytes_at_the_link_s_rate() -> None:
    shaped = _history(7.0, 0.2, [50_000, 50_000, 10_000, 10_000], [0.1, 0.2, 0.3, 0.4])
    cost = composed.price(shaped, GOODPUT, window=400)
    assert cost.start_s == pytest.approx(7.0)
    assert cost.step_s == pytest.approx(0.2)
    assert cost.steps == 400
    # a longer run of other bytes: each evaluation's time is start + steps x step + its bytes at the goodput
    long = _history(0.0, 0.3, [40_000] * 3 + [10_000] * 7, [0.1 * i for i in range(1, 11)])
    t = composed.compose(long, cost, "val_acc", 0.65)
    assert t == pytest.approx(7.0 + 700 * 0.2 + (300 * 40_000 + 400 * 10_000) * 1e-6)
    assert composed.compose(long, cost, "val_acc", 1.5) is None
    # the measured time to the same evaluation excludes the evaluations
    assert composed.measured(long, "val_acc", 0.65) == pytest.approx(700 * 0.3 + (300 * 40_000 + 400 * 10_000) * 1e-6)


def test_a_price_uses_only_its_window_and_needs_two_evaluations() -> None:
    shaped = _history(5.0, 0.1, [0.0] * 6, [0.1] * 6)
    shaped[-1]["wall_s"] += 1000.0  # a stall after the window does not reach the price
    assert composed.price(shaped, GOODPUT, window=300).step_s == pytest.approx(0.1)
    assert composed.price(shaped, GOODPUT, window=600).step_s > 1.0
    with pytest.raises(ValueError, match="at least two evaluations"):
        composed.price(shaped[:1], GOODPUT)


def _record(runs: list[tuple[str, str, int, list[dict]]], task: str = "cifar10", auto: dict | None = None) -> dict:
    return {"links": [{"link": "8mbit", "measured_goodput_mbit": GOODPUT}, {"link": "none", "measured_goodput_mbit": None}],
            "runs": [{"task": task, "method": m, "link": lk, "seed": s, "history": h, "final": h[-1],
                      "auto": auto if m == "auto" else None} for m, lk, s, h in runs]}  # fmt: skip


def test_validation_prices_each_method_by_its_first_seed_and_gives_the_error_per_goal() -> None:
    accs = [0.3, 0.5, 0.6, 0.62]
    runs = [("ddp", "8mbit", 42, _history(5.0, 0.2, [100_000] * 4, accs)),
            ("ddp", "8mbit", 43, _history(5.0, 0.22, [100_000] * 4, accs)),  # 10% slower steps than seed 42
            ("ddp", "none", 42, _history(5.0, 0.2, [0.0] * 4, accs))]  # fmt: skip
    rows = composed.validate(_record(runs), window=400, levels=(0.5,))
    assert [(r["link"], r["method"], r["goal"]) for r in rows] == [("8mbit", "ddp", 0.5), ("8mbit", "ddp", pytest.approx(0.615))]
    level = rows[0]
    assert level["priced_by_seed"] == 42 and level["reached"] == 2
    # seed 42 is predicted exactly; seed 43's 200 steps take 0.02 s more each than the price says
    assert level["measured_s"] == pytest.approx(level["composed_s"] + 200 * 0.02 / 2)
    assert level["error"] == pytest.approx(level["composed_s"] / level["measured_s"] - 1)
    assert rows[1]["ddp_target"] and rows[1]["goal"] == pytest.approx(0.62 - composed.TOLERANCE)


def test_the_long_protocol_is_composed_per_link_with_auto_on_ddp_s_curve_only_where_it_chose_dense() -> None:
    long_runs = {"ddp": [{"seed": 42, "history": _history(0.0, 0.3, [1e6] * 10, [0.1 * i for i in range(1, 11)])}],
                 "dgc_1pct_int8": [{"seed": 42, "history": _history(0.0, 0.3, [1e4] * 10, [0.09 * i for i in range(1, 11)])}]}  # fmt: skip
    short = lambda b: _history(4.0, 0.2, [b] * 3, [0.1] * 3)  # noqa: E731
    dense = _record([("ddp", "8mbit", 42, short(1e6)), ("dgc_1pct_int8", "8mbit", 42, short(1e4)),
                     ("auto", "8mbit", 42, short(1e6))], task="cifar10_full", auto={"auto_density": 1.0})  # fmt: skip
    rows = {r["method"]: r for r in composed.compose_long(long_runs, dense)}
    goal = 0.95 - composed.TOLERANCE  # DDP's final: the mean of its last two evaluations
    assert rows["ddp"]["target"] == pytest.approx(goal)
    assert rows["ddp"]["composed_s"] == pytest.approx(4.0 + 1000 * 0.2 + 1000 * 1e6 * 1e-6)  # its last evaluation
    assert rows["dgc_1pct_int8"]["composed_s"] is None and rows["dgc_1pct_int8"]["reached"] == 0  # 0.9 < 0.945
    assert rows["auto"]["curve"] == "ddp" and rows["auto"]["speedup_vs_ddp"] == pytest.approx(1.0)
    sparse = _record([("ddp", "8mbit", 42, short(1e6)), ("auto", "8mbit", 42, short(1e4))], task="cifar10_full",
                     auto={"auto_density": 0.0625})  # fmt: skip
    ddp, auto = composed.compose_long(long_runs, sparse)  # no long run at the density it chose: said, not composed
    assert (auto["method"], auto["curve"], auto["density"], auto["composed_s"]) == ("auto", None, 0.0625, None)
    assert composed._minutes(auto) == "chose density 0.0625: no long run of it"
    with pytest.raises(ValueError, match="DDP's long runs"):
        composed.compose_long({}, dense)


def test_a_method_some_seeds_of_which_miss_the_target_is_not_composed_but_its_other_seeds_are_said() -> None:
    ddp = _history(0.0, 0.3, [1e6] * 10, [0.1 * i for i in range(1, 11)])
    long_runs = {"ddp": [{"seed": 42, "history": ddp}],
                 "dgc_1pct_int8": [{"seed": 42, "history": _history(0.0, 0.3, [1e4] * 10, [0.09 * i for i in range(1, 11)])},
                                   {"seed": 43, "history": _history(0.0, 0.3, [1e4] * 10, [0.1 * i for i in range(1, 11)])}]}  # fmt: skip
    short = lambda b: _history(4.0, 0.2, [b] * 3, [0.1] * 3)  # noqa: E731
    record = _record([("ddp", "8mbit", 42, short(1e6)), ("dgc_1pct_int8", "8mbit", 42, short(1e4))], task="cifar10_full")
    rows = {r["method"]: r for r in composed.compose_long(long_runs, record)}
    dgc = rows["dgc_1pct_int8"]
    assert dgc["composed_s"] is None and dgc["reached"] == 1
    assert dgc["composed_reached_s"] == pytest.approx(4.0 + 1000 * 0.2 + 1000 * 1e4 * 1e-6)  # seed 43's last evaluation
    assert dgc["speedup_reached_vs_ddp"] == pytest.approx(rows["ddp"]["composed_s"] / dgc["composed_reached_s"])
    assert composed._minutes(dgc).startswith("1 of 2 seeds reach it: 3.6 min (")


def test_a_long_run_is_priced_by_its_shaped_method_and_its_headline_row_quotes_that_time() -> None:
    """``algo/dgc`` is the long study's ``dgc`` and the shaped runs' ``dgc_warmup`` (the same YAML and warm-up)."""
    curve = lambda b: [{"seed": 42, "history": _history(0.0, 0.3, [b] * 10, [0.1 * i for i in range(1, 11)])}]  # noqa: E731
    short = lambda b: _history(4.0, 0.2, [b] * 3, [0.1] * 3)  # noqa: E731
    record = _record([("ddp", "8mbit", 42, short(1e6)), ("dgc_warmup", "8mbit", 42, short(1e3))], task="cifar10_full")
    rows = composed.compose_long({"ddp": curve(1e6), "dgc": curve(1e3)}, record)
    (dgc,) = [r for r in rows if r["curve"] == "dgc"]
    assert dgc["method"] == "dgc_warmup" and dgc["composed_s"] == pytest.approx(4.0 + 1000 * 0.2 + 1000 * 1e3 * 1e-6)
    study = {"summary": [{"algo": "ddp", "metric": 0.95, "metric_std": 0.0, "seeds": [42], "link_kb_per_step": 1e3},
                         {"algo": "dgc", "metric": 0.95, "metric_std": 0.0, "seeds": [42], "difference": 0.0,
                          "difference_std": None, "paired_seeds": 1, "link_kb_per_step": 1.0, "compression": 1e3}],
             "runs": [{"global_step": 1000}]}  # fmt: skip
    shown = [row | {"link": "20mbit"} for row in rows]  # the headline's first link
    (line,) = [line for line in composed.markdown_headline(study, {"long": shown}) if line.startswith("| DGC at 0.001")]
    assert line.endswith(f"| {dgc['composed_s'] / 60:.1f} min ({dgc['speedup_vs_ddp']:.2f}x DDP's speed) | not measured |")


def test_ddp_s_long_runs_carry_the_bytes_of_its_ring_all_reduce_which_its_record_leaves_at_zero(tmp_path) -> None:
    folder = tmp_path / "parity_runs" / "study"
    folder.mkdir(parents=True)
    history = [{"step": s, "link_bytes": 0.0, "val_acc": 0.5} for s in (100, 200)]
    for algo in ("ddp", "dgc_1pct_int8"):
        run = {"finished": True, "params": 1000, "world_size": 2, "history": [dict(e) for e in history]}
        (folder / f"cifar10_full_{algo}_s42.json").write_text(json.dumps(run))
    (folder / "cifar10_full_ddp_s43.json").write_text(json.dumps({"finished": False, "history": []}))
    runs = composed.load_long_runs("study", root=tmp_path)
    assert [r["seed"] for r in runs["ddp"]] == [42]  # the unfinished run is left out
    assert [e["link_bytes"] for e in runs["ddp"][0]["history"]] == [100 * 4000.0, 200 * 4000.0]  # 2 (N-1)/N x 4 kB
    assert [e["link_bytes"] for e in runs["dgc_1pct_int8"][0]["history"]] == [0.0, 0.0]  # its own count stands


def test_the_committed_record_validates_within_ten_percent_on_the_short_protocol() -> None:
    record = json.loads((common.RESULTS / composed.RECORD).read_text())
    again = composed.validate(json.loads((common.RESULTS / record["validated_on"]).read_text()))
    assert [r["error"] for r in again] == pytest.approx([r["error"] for r in record["validation"]])
    assert record["validation_max_error"] == pytest.approx(max(abs(r["error"]) for r in again))
    assert record["validation_max_error"] <= 0.10


def test_the_time_to_accuracy_page_quotes_the_validation_of_the_record() -> None:
    record = json.loads((common.RESULTS / composed.RECORD).read_text())
    page = (common.REPO / "docs" / "benchmarks" / "time-to-accuracy.md").read_text()
    assert "\n".join(composed.markdown_validation(record)) in page
    assert f"within {100 * record['validation_max_error']:.1f}%" in " ".join(page.split())


def test_the_verdict_says_each_target_met_or_missed_with_its_figure() -> None:
    study = {"summary": [{"algo": "dgc_1pct_int8", "difference": -0.0037, "difference_std": 0.0034, "paired_seeds": 3,
                          "compression": 59.3}]}  # fmt: skip
    long = [{"link": "20mbit", "method": "dgc_1pct_int8", "composed_s": None, "composed_reached_s": 600.0,
             "speedup_reached_vs_ddp": 4.8, "reached": 2, "seeds": [42, 43, 44]},
            {"link": "1gbit", "method": "auto", "composed_s": 500.0, "speedup_vs_ddp": 1 / 1.06, "density": 1.0}]  # fmt: skip
    text = composed.markdown_verdict(study, {"long": long})
    assert "0.37 points below DDP (standard error 0.20, 3 paired seeds) misses the target of at most 0.3" in text
    assert "59.3x fewer link bytes meets at least 50x" in text
    assert "2 of 3 seeds reach DDP's final less 0.5 points 4.80x sooner than DDP and 1 never reaches it" in text
    assert 'takes 1.06x DDP\'s time, which misses at most 5% slower' in text
    long[0].update(composed_s=600.0, speedup_vs_ddp=2.5)
    study["summary"][0]["difference"] = -0.002
    text = composed.markdown_verdict(study, {"long": long})
    assert "0.20 points below DDP (standard error 0.20, 3 paired seeds) meets" in text and "2.50x sooner than DDP, which meets" in text


def test_the_verdict_adds_the_eight_worker_targets_when_their_pair_finished() -> None:
    study = {"summary": [{"algo": "dgc_1pct_int8", "difference": -0.002, "difference_std": 0.002, "paired_seeds": 3,
                          "compression": 59.3}]}  # fmt: skip
    eight = {"summary": [{"algo": "ddp"}, {"algo": "dgc_1pct_int8", "difference": -0.006, "difference_std": None,
                                           "paired_seeds": 1, "compression": 25.0}]}  # fmt: skip
    text = composed.markdown_verdict(study, {"long": []}, study_8=eight)
    assert text.endswith("at 8 workers 0.60 points below DDP (1 seed) misses at most 0.5, on 25.0x fewer link bytes"
                         " (meets at least 20x).")  # fmt: skip
    assert "8 workers" not in composed.markdown_verdict(study, {"long": []}, study_8={"summary": [{"algo": "ddp"}]})
    eight["summary"][1]["difference"] = 0.0005
    assert "at 8 workers 0.05 points above DDP (1 seed) meets at most 0.5" in composed.markdown_verdict(
        study, {"long": []}, study_8=eight)


def test_the_verdict_adds_the_paper_s_density_when_its_run_finished() -> None:
    rows = [{"algo": "dgc_1pct_int8", "difference": -0.002, "difference_std": 0.002, "paired_seeds": 3, "compression": 59.3},
            {"algo": "dgc", "difference": -0.002, "difference_std": None, "paired_seeds": 1, "compression": 28.5}]  # fmt: skip
    text = composed.markdown_verdict({"summary": rows}, {"long": []})
    assert text.endswith("DGC at the paper's density 0.001 (`algo/dgc`, 1 seed) ends 0.20 points below DDP, which meets"
                         " at most 0.5, on 28.5x fewer link bytes (misses at least 200x).")  # fmt: skip
    rows[1].update(difference=-0.004, difference_std=0.003, paired_seeds=3)  # three seeds: the gap's standard error
    assert "(`algo/dgc`, 3 seeds) ends 0.40 points below DDP (standard error 0.17), which meets" in composed.markdown_verdict(
        {"summary": rows}, {"long": []})


def test_the_verdict_gives_the_closest_light_dgc_at_the_whole_run_byte_target() -> None:
    """Of the configurations light in bytes (``dgc_lean*``), those at 200x or more count; the closest to DDP is quoted."""
    rows = [{"algo": "dgc_1pct_int8", "difference": -0.002, "difference_std": 0.002, "paired_seeds": 3, "compression": 59.3},
            {"algo": "dgc_lean_vectors_dense", "difference": -0.0008, "paired_seeds": 1, "compression": 118.6},
            {"algo": "dgc_lean", "difference": -0.0096, "paired_seeds": 1, "compression": 250.9},
            {"algo": "dgc_lean_small", "difference": -0.006, "paired_seeds": 1, "compression": 211.6}]  # fmt: skip
    text = composed.markdown_verdict({"summary": rows}, {"long": []})
    assert text.endswith("at 200x fewer or more the closest DGC ends 0.60 points below DDP (1 seed), which misses at most 0.3.")
    rows[3].update(difference=-0.002, paired_seeds=3)
    assert "the closest DGC ends 0.20 points below DDP (3 seeds), which meets at most 0.3" in composed.markdown_verdict(
        {"summary": rows}, {"long": []})
    assert "closest DGC" not in composed.markdown_verdict({"summary": rows[:2]}, {"long": []})
