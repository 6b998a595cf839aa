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
#: The README's rows: "flat / two-level" cells.
README_ROWS = {
    "DDP": (("ddp_1g",), ("ddp_10g",)),
    "DGC, flat / two-level": (("dgc_1g", "dgc_node_1g"), ("dgc_10g", "dgc_node_10g")),
    "DEFT, flat / two-level": (("deft_1g", "deft_node_1g"), ("deft_10g", "deft_node_10g")),
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


def test_the_readme_table_quotes_the_record() -> None:
    h = _record()["highlights"]
    text = README.read_text()
    rows = _table(text[text.index("Predicted speedup over one node") :], "| method |")
    assert set(rows) == set(README_ROWS), sorted(rows)
    for label, cells in README_ROWS.items():
        expected = [" / ".join(_x(h[k]) for k in keys) for keys in cells]
        assert rows[label] == expected, f"README, row {label!r}: {rows[label]} against the record's {expected}"


@pytest.mark.parametrize("path", [README, PERF_PAGE], ids=lambda p: p.name)
def test_the_labels_state_the_times_the_record_was_made_with(path: Path) -> None:
    """The compute and selection times were set on the command line: the label says so and gives them."""
    p = _record()["profile"]
    compute, selection = f"{p['compute_s'] * 1e3:g}", f"{p['selection_s'] * 1e3:g}"
    text = path.read_text()
    label = re.search(r"compute and selection(?: times)? set to ([\d.]+)(?: ms)? and ([\d.]+) ms[\s\S]{0,40}?batch (\d+)"
                      r"|batch (\d+), compute and selection set to ([\d.]+) and ([\d.]+) ms", text)  # fmt: skip
    assert label, f"{path.name}: no label naming the compute and selection times"
    found = [g for g in label.groups() if g is not None]
    if label.group(1) is None:  # "batch B, compute and selection set to C and S ms"
        found = [found[1], found[2], found[0]]
    assert found == [compute, selection, str(p["batch_size"])], found
    assert any(n.startswith(f"compute_s set to {compute} ms") for n in p["notes"])
    assert any(n.startswith(f"selection_s set to {selection} ms") for n in p["notes"])
    assert "H100 compute" not in text


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
    said = re.search(r"([\d.]+x) the speed of one node for two-level DGC on 1 Gbit/s,\s+against ([\d.]+x) for flat"
                     r" DGC and ([\d.]+x) for dense DDP on 10 Gbit/s", MULTI_NODE.read_text())  # fmt: skip
    assert said, "docs/multi-node.md: the sentence quoting the performance model is not found"
    assert list(said.groups()) == [_x(h["dgc_node_1g"]), _x(h["dgc_1g"]), _x(h["ddp_10g"])]


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
