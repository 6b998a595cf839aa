"""The README's two tables, each figure from its committed record: the headline (the long protocol, with the composed
times of ``benchmarks.composed``) and "Which algorithm?" (one figure per cell, the recommended configurations')."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from benchmarks import composed

ROOT = Path(__file__).resolve().parents[1]


def _record(name: str) -> dict:
    return json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())


def _summary(name: str) -> dict[str, dict]:
    return {row["algo"]: row for row in _record(name)["summary"]}


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def _init_args(config: str) -> dict:
    """The strategy's arguments in ``configs/algo/<config>.yaml``."""
    return yaml.safe_load((ROOT / "configs" / "algo" / f"{config}.yaml").read_text())["trainer"]["strategy"]["init_args"]


def _gap(row: dict, percent: bool, digits: int) -> str:
    """A paired difference to DDP, ± its std over seeds: points for accuracy, relative (%) for perplexity."""
    scale = 100
    return f"{scale * row['difference']:+.{digits}f} ± {scale * row['difference_std']:.{digits}f}" + (" pp" if percent else "%")


def _signed(value: float) -> str:
    text = f"{value:+.1f}"
    return "0" if float(text) == 0 else text


def which_cells() -> dict[str, str]:
    """Each cell of the README's "Which algorithm?" table that quotes a record, by its row and column."""
    traffic = {}
    for row in _record("traffic")["rows"]:
        if row["model"] == "resnet50":
            traffic[(row["algorithm"], row["density"], row["value_dtype"], row.get("rank"))] = row
    ratio = lambda r: f"{r['dense_bytes'] / r['bytes_sent']:.0f}x fewer"  # noqa: E731
    memory = {s: r[0]["over"]["peak - ddp"] for s, r in _record("checkpoint_memory")["runs"].items()}
    diloco = _record("diloco_memory")["runs"]["diloco"][0]["over"]["peak - ddp"]
    long = _summary("parity_full_cifar2")["dgc_1pct_int8"]
    c8, p2, x2 = _summary("parity_seeds_cifar8"), _summary("parity_seeds_ptb2"), _summary("parity_seeds_xfmr2")
    dgc, deft = _init_args("dgc_1pct_int8"), _init_args("deft")
    rank = _init_args("powersgd")["options"]["matrix_approximation_rank"]
    recommended = {"dgc": "dgc_density_0.01_int8_light_warmup", "deft": "deft", "powersgd": "powersgd",
                   "diloco": "diloco_streaming"}  # fmt: skip
    cells = {
        # each config's own setting, said in the cell: the configs' densities differ (the record's DEFT is as published)
        "gradient bytes|DGC": ratio(traffic[("dgc", dgc["density"], dgc["value_dtype"], None)])
        + f" at {dgc['density']:g}, {dgc['value_dtype']}",
        "gradient bytes|DEFT": ratio(traffic[("deft", deft["density"], "fp32", None)]) + f" at {deft['density']:g}, as published",
        "gradient bytes|PowerSGD": ratio(traffic[("powersgd", None, "fp32", rank)]) + f" at rank {rank}",
        "buffers": f"{traffic[('dgc', 0.01, 'int8', None)]['ratio_with_buffers']:.0f}x",
        "memory|DiLoCo": f"{_signed(diloco)} model sizes",
        "all of CIFAR-10|DGC": _gap(long, True, 2),  # ± the std over seeds, as every row of the table
    }
    for algo, column in (("deft", "DEFT"), ("powersgd", "PowerSGD")):  # one seed each, where run
        row = _summary("parity_full_cifar2").get(algo)
        if row is not None and "difference" in row:
            cells[f"all of CIFAR-10|{column}"] = f"{100 * row['difference']:+.2f} pp (1 seed)"
    for algo, column in (("dgc", "DGC"), ("deft", "DEFT"), ("powersgd", "PowerSGD")):
        cells[f"memory|{column}"] = f"{_signed(memory[algo])} model sizes"
    for algo, column in (("dgc", "DGC"), ("deft", "DEFT"), ("powersgd", "PowerSGD"), ("diloco", "DiLoCo")):
        cells[f"CIFAR-10 subset|{column}"] = _gap(c8[recommended[algo]], True, 2)
        cells[f"the same: link bytes|{column}"] = f"{c8[recommended[algo]]['compression']:.1f}x"
    for algo, column in (("dgc", "DGC"), ("deft", "DEFT"), ("powersgd", "PowerSGD")):
        cells[f"PTB LSTM|{column}"] = _gap(p2[algo], False, 1)  # DGC: algo/dgc_warmup, the one measured there
    cells["PTB transformer|DGC"] = _gap(x2[recommended["dgc"]], False, 1)
    cells["PTB transformer|PowerSGD"] = _gap(x2["powersgd"], False, 1)
    return cells


COLUMNS = ["DGC", "DEFT", "PowerSGD", "DiLoCo"]


def _which_rows() -> dict[str, list[str]]:
    text = _readme().split("## Which algorithm?")[1].split("\n## ")[0]
    rows = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def test_which_algorithm_quotes_one_figure_per_cell_from_the_records() -> None:
    rows = _which_rows()
    wrong = []
    for key, expected in which_cells().items():
        if key == "buffers":
            continue
        start, column = key.split("|")
        (label,) = [label for label in rows if start in label]
        cell = rows[label][COLUMNS.index(column)]
        if cell != expected:
            wrong.append((label, column, cell, expected))
    assert not wrong, wrong
    # one figure per cell: no cell quotes two measurements
    for label, cells in rows.items():
        for cell in cells:
            assert len(re.findall(r"[-+]?\d[\d,.]*(?:x| pp|%| model sizes)", cell)) <= 1, (label, cell)
    assert f"DGC's is {which_cells()['buffers']}" in " ".join(_readme().split())


def test_the_headline_is_the_long_protocol_s_table_and_leads_the_readme() -> None:
    readme = _readme()
    table = composed.markdown_headline(_record("parity_full_cifar2"), _record(composed.RECORD.removesuffix(".json")))
    assert "\n".join(table) in readme
    assert readme.index(table[0]) < readme.index("## Install"), "the table leads the README"
    worst = _record(composed.RECORD.removesuffix(".json"))["validation_max_error"]
    assert f"off by at most {100 * worst:.1f}%" in " ".join(readme.split())
    assert "benchmarks/results/parity_full_length.png" in readme


def test_the_headline_says_against_each_target_whether_it_is_met_and_where_the_gap_goes() -> None:
    from benchmarks import long_study

    readme = " ".join(_readme().split())
    verdict = composed.markdown_verdict(_record("parity_full_cifar2"), _record(composed.RECORD.removesuffix(".json")),
                                       study_8=_record("parity_full_cifar8"))
    assert verdict in readme
    assert long_study.length_sentence(_record(long_study.LENGTH_RECORD)["rows"]) in readme
    precision = long_study.precision_sentence()
    assert precision is None or f"It trains under bf16 autocast, which DDP's accuracy survives: {precision}." in readme


@pytest.mark.parametrize("cell", ["not measured", "not reached"])
def test_the_headline_says_what_is_missing_rather_than_leaving_it_blank(cell: str) -> None:
    """A link without a shaped run, or a method that never reached the target, is said in words."""
    study = _record("parity_full_cifar2")
    record = {"long": []} if cell == "not measured" else {"long": [
        {"link": link, "method": m, "composed_s": None if m != "ddp" else 600.0, "reached": 0, "seeds": [42],
         "target": 0.84, "speedup_vs_ddp": None} for link in composed.LINKS for m in ("ddp", "dgc_1pct_int8")]}  # fmt: skip
    (row,) = [line for line in composed.markdown_headline(study, record) if line.startswith("| `algo/dgc_1pct_int8`")]
    assert row.count(cell) == 2
