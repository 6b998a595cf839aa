"""The predicted speedups quoted in the docs and the README: each comes from a committed record, and
the command printed next to it rebuilds that record."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PERF_PAGE = ROOT / "docs" / "performance-model.md"
README = ROOT / "README.md"
MULTI_NODE = ROOT / "docs" / "multi-node.md"
RECORD = ROOT / "benchmarks" / "results" / "two_level" / "scaling_resnet50.json"
RECORD_NIC_GPU = ROOT / "benchmarks" / "results" / "two_level_nic_gpu" / "scaling_resnet50.json"

#: Row label of the performance-model page's ResNet-50 table -> the record's highlight keys (1, 10 Gbit/s).
PAGE_ROWS = {
    "plain DDP": ("ddp_1g", "ddp_10g"),
    "DGC, flat": ("dgc_1g", "dgc_10g"),
    "**DGC, two-level (`dgc_node`)**": ("dgc_node_1g", "dgc_node_10g"),
    "DEFT, flat": ("deft_1g", "deft_10g"),
    "DEFT, two-level (`deft_node`)": ("deft_node_1g", "deft_node_10g"),
    "PowerSGD, flat": ("powersgd_1g", "powersgd_10g"),
    "PowerSGD, two-level (`powersgd_node`)": ("powersgd_node_1g", "powersgd_node_10g"),
}
#: The Across-nodes table of the README and of docs/multi-node.md: every method of the record, "flat / two-level".
ACROSS_NODES_ROWS = {
    "DDP": (("ddp_1g",), ("ddp_10g",)),
    "DGC, flat / two-level": (("dgc_1g", "dgc_node_1g"), ("dgc_10g", "dgc_node_10g")),
    "DEFT, flat / two-level": (("deft_1g", "deft_node_1g"), ("deft_10g", "deft_node_10g")),
    "PowerSGD, flat / two-level": (("powersgd_1g", "powersgd_node_1g"), ("powersgd_10g", "powersgd_node_10g")),
}


def _record(path: Path = RECORD) -> dict[str, Any]:
    return json.loads(path.read_text())


def _x(value: float) -> str:
    return f"{value:.1f}x"


def _table(text: str, header: str) -> dict[str, list[str]]:
    """The rows (first cell -> other cells) of the markdown table whose header line starts ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def _section(text: str, heading: str) -> str:
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def _command(section: str) -> list[str]:
    """The ``python -m benchmarks.scaling_model`` command of the section's first bash block."""
    block = re.search(r"```bash\n(python -m benchmarks\.scaling_model [^\n]+)\n```", section)
    assert block, "the section shows no `python -m benchmarks.scaling_model` command"
    return shlex.split(block.group(1))[3:]


def test_the_page_table_quotes_the_record() -> None:
    h = _record()["highlights"]
    rows = _table(_section(PERF_PAGE.read_text(), "ResNet-50 on 64 nodes of 8 GPUs"), "| method |")
    assert set(rows) == set(PAGE_ROWS), sorted(rows)
    for label, keys in PAGE_ROWS.items():
        expected = [f"**{_x(h[k])}**" if label.startswith("**") else _x(h[k]) for k in keys]
        assert rows[label] == expected, f"{PERF_PAGE.name}, row {label!r}: {rows[label]} against the record's {expected}"


@pytest.mark.parametrize("path", [README, MULTI_NODE], ids=lambda p: p.name)
def test_the_across_nodes_tables_quote_the_record(path: Path) -> None:
    h = _record()["highlights"]
    assert (h["nodes"], h["gpus_per_node"]) == (64, 8)
    text = path.read_text()
    assert "64 nodes of 8 GPUs" in " ".join(text.split())
    rows = _table(text, "| method | 1 Gbit/s | 10 Gbit/s |")
    assert set(rows) == set(ACROSS_NODES_ROWS), sorted(rows)
    for label, cells in ACROSS_NODES_ROWS.items():
        expected = [" / ".join(_x(h[k]) for k in keys) for keys in cells]
        assert rows[label] == expected, f"{path.name}, row {label!r}: {rows[label]} against the record's {expected}"


@pytest.mark.parametrize("path", [README, PERF_PAGE, MULTI_NODE], ids=lambda p: p.name)
def test_the_labels_state_the_times_the_record_was_made_with(path: Path) -> None:
    """The compute and selection times are the GPU profile's, as measured: the label says where they come from."""
    from benchmarks.model_figures import inputs_label

    p = _record()["profile"]
    text = " ".join(path.read_text().split())
    assert inputs_label() in text, f"{path.name}: no label naming the GPU's times"
    assert f"{p['compute_s'] * 1e3:.1f} and {p['selection_s'] * 1e3:.1f} ms a step at batch {p['batch_size']}" in text
    assert not any("set to" in n for n in p["notes"])


def test_the_selection_sweep_quotes_the_record() -> None:
    sweep = {f"{r['selection_ms']:g}": r for r in _record()["highlights"]["selection_sweep"]}
    rows = _table(PERF_PAGE.read_text(), "| selection ms per step")
    assert len(rows) == 3
    for label, cells in rows.items():
        r = sweep[label.split()[0]]
        expected = [f"{r[k + '_ms']:.0f} ms, {r[k]:.1f}x" for k in ("dgc", "dgc_node", "ddp_10g")]
        assert cells == expected, f"selection {label}: {cells} against the record's {expected}"


def test_the_one_card_per_gpu_figure_quotes_its_record() -> None:
    text = PERF_PAGE.read_text()
    said = re.search(r"With one card per GPU, `dgc_node` reaches ([\d.]+x) on 1 Gbit/s", text)
    assert said and said.group(1) == _x(_record(RECORD_NIC_GPU)["highlights"]["dgc_node_1g"])
    assert _record(RECORD_NIC_GPU)["network"]["nic"] == "gpu"


def test_the_multi_node_page_quotes_the_record() -> None:
    h = _record()["highlights"]
    said = re.search(r"([\d.]+x) against ([\d.]+x) flat on 1 Gbit/s, above dense DDP on 10 Gbit/s \(([\d.]+x)\)",
                     " ".join(MULTI_NODE.read_text().split()))  # fmt: skip
    assert said, "docs/multi-node.md: the sentence quoting the performance model is not found"
    assert list(said.groups()) == [_x(h["dgc_node_1g"]), _x(h["dgc_1g"]), _x(h["ddp_10g"])]
    assert h["dgc_node_1g"] > h["ddp_10g"]
    text = " ".join(MULTI_NODE.read_text().split())
    # "DEFT and PowerSGD gain little from it"
    for name in ("deft", "powersgd"):
        assert 1 <= h[f"{name}_node_1g"] / h[f"{name}_1g"] < 1.1 and h[f"{name}_node_1g"] < h["dgc_node_1g"] * 1.1, name
    # "Two-level PowerSGD is predicted a little faster than two-level DGC on 1 Gbit/s (22.6x)"
    assert h["dgc_node_1g"] < h["powersgd_node_1g"] < 1.1 * h["dgc_node_1g"]
    assert f"faster than two-level DGC on 1 Gbit/s ({_x(h['powersgd_node_1g'])})" in text
    # "... and both lost more accuracy than DGC on the CIFAR-10 subset"
    from tests.test_docs import _study

    summary, _ = _study("parity_seeds_cifar8")
    assert max(summary["powersgd"]["difference"], summary["deft"]["difference"]) < summary["dgc"]["difference"]


def test_where_the_inputs_come_from() -> None:
    """The bytes, shapes and times come from the committed GPU profile, named with its machine and figures; the network
    is listed as assumed."""
    from benchmarks.model_figures import assumptions

    profile = _record()["profile"]
    h100 = _record(ROOT / "benchmarks" / "results" / "profile_resnet50_h100.json")
    assert profile["buckets"] == h100["buckets"] and profile["compute_s"] == h100["compute_s"]
    section = _section(PERF_PAGE.read_text(), "ResNet-50 on 64 nodes of 8 GPUs")
    inputs = " ".join(section[section.index("### Where the inputs come from") :].split())
    assert "`benchmarks/results/profile_resnet50_h100.json`" in inputs
    assert f"on an {h100['device']}: ResNet-50's DDP buckets and the shapes of their tensors, and measured" \
        f" {h100['compute_s'] * 1e3:.1f} ms of compute and {h100['selection_s'] * 1e3:.1f} ms of DGC's selection per" \
        f" step at batch {h100['batch_size']} in {h100['value_dtype']}, one process" in inputs
    assert f"**Assumed, not measured**: the network of the cluster: {assumptions()}" in inputs
    assert h100["world_size"] == 1


# -- the algorithm guide's answer for 2 nodes x 8 GPUs: the record's rows at 16 workers
GUIDE = ROOT / "docs" / "algorithms" / "index.md"
#: The guide's columns -> the record's methods in each cell ("flat / two-level").
GUIDE_COLUMNS = [("ddp",), ("dgc", "dgc_node"), ("deft", "deft_node"), ("powersgd", "powersgd_node")]


def _at_16(method: str, bandwidth: float) -> dict[str, Any]:
    (row,) = [r for r in _record()["rows"] if (r["method"], r["workers"], r["bandwidth_bps"], r["overlap"])
              == (method, 16, bandwidth, True)]  # fmt: skip
    return row


def _speed(method: str, bandwidth: float) -> str:
    row = _at_16(method, bandwidth)
    return f"{_x(row['speedup'])}, {row['step_s'] * 1e3:.0f} ms"


def test_the_guide_s_two_by_eight_rows_quote_the_record() -> None:
    assert _record()["network"]["gpus_per_node"] == 8 and _record()["network"]["nic"] == "node"
    rows = _table(_section(GUIDE.read_text(), "2 nodes x 8 GPUs"), "| 2 nodes x 8 GPUs |")
    for label, bandwidth in (("**1 Gbit/s**, predicted", 1e9), ("**10 Gbit/s**, predicted", 10e9)):
        expected = [" / ".join(_speed(m, bandwidth) for m in methods) for methods in GUIDE_COLUMNS]
        assert rows[label] == expected, f"{label}: {rows[label]} against the record's {expected}"


def test_the_guide_s_two_by_eight_accuracy_rows_quote_the_records() -> None:
    from tests.test_docs import _difference_text, _metric_text, _study

    rows = _table(_section(GUIDE.read_text(), "2 nodes x 8 GPUs"), "| 2 nodes x 8 GPUs |")
    for start, name in (("CIFAR-10 subset top-1, ResNet-20, 8 workers", "parity_seeds_cifar8"),
                        ("PTB LSTM perplexity, 8 workers", "parity_seeds_ptb8")):  # fmt: skip
        (label,) = [label for label in rows if label.startswith(start)]
        assert f"(../benchmarks/results/{name}.png)" in label
        summary, percent = _study(name)
        cells = rows[label]
        assert cells[0] == _metric_text(summary["ddp"], percent)
        dgc, config = GUIDE_DGC[name]
        for cell, algo in zip(cells[1:], (dgc, "deft", "powersgd"), strict=True):
            assert cell.startswith(_difference_text(summary[algo], percent)), (name, algo, cell)
        assert f"(`{config}`" in cells[1], "the DGC cell names the configuration it quotes"
        assert all(len(summary[a]["seeds"]) == 3 for a in ("ddp", dgc, "deft", "powersgd"))


#: the DGC of the guide's 2 x 8 accuracy rows: the recommended configuration where its study ran it, else the one
#: measured there (named in the cell)
GUIDE_DGC = {"parity_seeds_cifar8": ("dgc_density_0.01_int8_light_warmup", "algo/dgc_1pct_int8"),
             "parity_seeds_cifar2": ("dgc_density_0.01_int8_light_warmup", "algo/dgc_1pct_int8"),
             "parity_seeds_ptb8": ("dgc", "algo/dgc_warmup"), "parity_seeds_ptb2": ("dgc", "algo/dgc_warmup")}


def _best(name: str) -> str:
    """The compressed method (DGC, DEFT, PowerSGD) closest to DDP's accuracy, or below its perplexity."""
    from tests.test_docs import _study

    summary, percent = _study(name)
    names = {GUIDE_DGC[name][0]: "dgc", "deft": "deft", "powersgd": "powersgd"}
    score = {names[a]: summary[a]["difference"] * (1 if percent else -1) for a in names}
    return max(score, key=score.__getitem__)


def test_the_guide_s_answer_quotes_the_record() -> None:
    """The answer's figures are the record's, and its choice is the best measured accuracy on each task, at 8
    workers as at 2."""
    text = " ".join(_section(GUIDE.read_text(), "2 nodes x 8 GPUs").split())
    said = re.search(r"the performance model predicts ([\d.]+x) and ([\d.]+x) one GPU's throughput on 1 Gbit/s links"
                     r" \(DDP ([\d.]+x)\), both flat", text)  # fmt: skip
    assert said, "the guide's answer for 2 x 8 GPUs is not found"
    speed = {m: _x(_at_16(m, 1e9)["speedup"]) for m in ("dgc", "deft", "ddp")}
    assert list(said.groups()) == [speed["dgc"], speed["deft"], speed["ddp"]]
    # "On 2 nodes the model puts every two-level exchange behind the flat one ... on the 100 Gbit/s bus the model assumes"
    bus = _record()["network"]["local_bandwidth"]
    assert f"on the {bus / 1e9:g} Gbit/s bus the model assumes" in text
    assert text.index("**DGC**") < text.index("for a convolutional network") < text.index("**DEFT**")
    from benchmarks.doc_claims import RECOMMENDED_DGC

    assert f"**DGC** (`{RECOMMENDED_DGC}`" in text, "the answer names the recommended DGC"
    assert _best("parity_seeds_cifar8") == _best("parity_seeds_cifar2") == "dgc"
    assert _best("parity_seeds_ptb8") == _best("parity_seeds_ptb2") == "deft"
    # DEFT flat, as the answer says (hierarchical=False): faster than its two-level exchange on both links
    assert all(_at_16("deft", b)["speedup"] > _at_16("deft_node", b)["speedup"] for b in (1e9, 10e9))
    assert all(_at_16(m, b)["speedup"] > _at_16(f"{m}_node", b)["speedup"] for m in ("dgc", "deft", "powersgd")
               for b in (1e9, 10e9))  # fmt: skip


def test_the_printed_commands_rebuild_the_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The page's command, run again, writes the committed record's figures (with ``--nic gpu``, those of
    the one-card-per-GPU record)."""
    from benchmarks.scaling_model import main

    monkeypatch.chdir(ROOT)
    args = _command(_section(PERF_PAGE.read_text(), "ResNet-50 on 64 nodes of 8 GPUs"))
    out = args.index("--out")
    assert Path(args[out + 1]) == RECORD.parent.relative_to(ROOT)
    said = re.search(r"the same command with `(--nic gpu --no-plot\s+--out ([\w/]+))`", PERF_PAGE.read_text())
    assert said and Path(said.group(2)) == RECORD_NIC_GPU.parent.relative_to(ROOT)
    for record, extra in ((RECORD, []), (RECORD_NIC_GPU, ["--nic", "gpu"])):
        rebuilt = main([*args[:out], *args[out + 2 :], *extra, "--out", str(tmp_path), "--no-plot",
                        "--measured", str(tmp_path / "none.json")])  # fmt: skip
        committed = _record(record)
        for key, value in committed["highlights"].items():
            if isinstance(value, float):
                assert rebuilt["highlights"][key] == pytest.approx(value, rel=1e-9), key
        assert rebuilt["profile"]["notes"] == committed["profile"]["notes"]
