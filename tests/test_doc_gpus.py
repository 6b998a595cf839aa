"""docs/gpus.md, "On GPUs": every figure of the page is its record's (``gpu_check.json``, ``selection_cuda.json``,
``profile_resnet50_h100.json``), and what the page says never ran is what the records show."""

from __future__ import annotations

import re

import pytest

from tests.test_docs import ROOT, _cells, _cuda_peaks, _record, _signed, _text

PAGE = "docs/gpus.md"


def _rows(start: str) -> list[list[str]]:
    """The page's table rows whose first cell starts with ``start``."""
    lines = (ROOT / PAGE).read_text().splitlines()
    return [_cells(line) for line in lines if line.startswith(f"| {start}")]


def _row(start: str) -> list[str]:
    (row,) = _rows(start)
    return row


def _selection(record: dict) -> dict:
    return record["models"]["resnet50"]


def test_the_page_is_in_the_site_and_the_readme_points_at_it() -> None:
    assert "On GPUs: gpus.md" in (ROOT / "mkdocs.yml").read_text()
    readme = _text("README.md")
    assert "[On GPUs](docs/gpus.md)" in readme and "never over NCCL" in readme
    assert "GPUs (NCCL)" not in readme


def test_the_machine_is_the_record_s() -> None:
    record = _record("gpu_check")
    text = _text(PAGE)
    device, versions = record["device"], record["versions"]
    assert device["count"] == 1 and device["type"] == "cuda"
    assert f"**one** GPU, an {device['name']} (torch {versions['torch']}, CUDA {versions['cuda']}, Lightning" \
        f" {versions['lightning']})" in text
    profile = _record("profile_resnet50_h100")
    assert profile["device"] == device["name"]


def test_the_tests_and_fits_rows_quote_the_record() -> None:
    parts = _record("gpu_check")["parts"]
    counts = parts["tests"]["result"]["counts"]
    assert _row("every CUDA test")[2] == f"{counts['passed']} passed, {counts['failed']} failed"
    fits = parts["fits"]["result"]
    what, record, result = _row("a Lightning `fit`")
    assert record == "`gpu_check.json`, part `fits`" and f"{fits['steps']} steps" in what
    assert {name.split("/")[1] for name in fits["fits"]} == {"16-mixed", "bf16-true", "32-true"}
    assert all(f"`{name}`" in what for name in ("dgc", "deft", "powersgd", "16-mixed", "bf16-true"))
    assert result.startswith(f"all {len(fits['fits'])} fits ran every step") and fits["ok"]
    assert all(fit["ok"] and all(fit["checks"].values()) for fit in fits["fits"].values())
    dense = fits["fits"]["dgc_dense/32-true"]
    assert dense["checks"]["equals_ddp"] and dense["max_abs_diff_from_ddp"] == 0.0
    assert all(r["world_size"] == 2 for fit in fits["fits"].values() for r in fit["ranks"])


def test_the_param_device_note_matches_the_record() -> None:
    """The page explains ``param_device: cpu`` exactly while the committed record reads it."""
    devices = {r["param_device"] for fit in _record("gpu_check")["parts"]["fits"]["result"]["fits"].values()
               for r in fit["ranks"]}  # fmt: skip
    said = "The fits' `param_device` in the committed `gpu_check.json` reads `cpu`" in _text(PAGE)
    assert said == (devices == {"cpu"}), devices


@pytest.mark.parametrize("name", ["gpu_check", "selection_cuda"])
def test_the_selection_rows_quote_the_records(name: str) -> None:
    record = _record(name)
    if name == "gpu_check":
        record = record["parts"]["selection"]["result"]
    m = _selection(record)
    ms = m["median_ms"]
    (row,) = [r for r in _rows("selection, ResNet-50") + _rows("the same, ") if r[1].startswith(f"`{name}.json`")]
    what, result = " ".join([row[0], *_rows("selection, ResNet-50")[0][:1]]), row[2]
    assert f"{m['compressed_tensors']} compressed tensors in {m['buckets']} buckets, density" \
        f" {record['config']['density']:g}" in what
    assert f"{record['config']['reps']} rounds" in row[0]
    assert f"DGC {ms['dgc_batched']:.2f} ms" in result and f"{ms['dgc']:.2f} ms tensor by tensor" in result
    assert f"exact `torch.topk` {ms['exact']:.2f} ms" in result
    assert f"one pass over the gradient {ms['floor']:.2f} ms" in result or f"one pass {ms['floor']:.2f} ms" in result
    if name == "gpu_check":
        deft = m["deft"]["8"]
        assert f"DEFT at 8 simulated workers, slowest rank: {deft['batched_max_ms']:.2f} ms batched," \
            f" {deft['max_ms']:.2f} ms tensor by tensor" in result
    assert record["config"]["device"] == "cuda"


def test_the_selection_record_without_a_gpu_name_is_the_same_build_and_day() -> None:
    selection, check = _record("selection_cuda")["config"], _record("gpu_check")
    assert "name" not in selection and "gpu" not in selection
    assert selection["torch"] == check["versions"]["torch"]
    assert selection["time"][:10] == check["environment"]["date"][:10]
    assert "`selection_cuda.json` names no GPU model" in _text(PAGE)


def test_the_memory_row_quotes_the_record() -> None:
    part = _record("gpu_check")["parts"]["checkpoint_memory"]["result"]
    peaks, ddp = _cuda_peaks(), part["cuda_columns"][0]
    assert ddp["strategy"] == "ddp"
    what, record, result = _row("CUDA peak memory during `fit`")
    assert f"an MLP of {part['params'] / 1e6:.1f}M parameters" in what
    expected = (f"over DDP's {ddp['cuda peak']:.2f} model sizes: DGC {_signed(peaks['dgc', 0], 2)}, DEFT"
                f" {_signed(peaks['deft', 0], 2)}, PowerSGD {_signed(peaks['powersgd', 0], 2)}, DiLoCo"
                f" {_signed(peaks['diloco', 0], 2)} ({_signed(peaks['diloco_offload', 0], 2)} with `offload=True`)")  # fmt: skip
    assert result.startswith(expected), (result, expected)


def test_the_profile_row_quotes_the_record() -> None:
    profile = _record("profile_resnet50_h100")
    what, record, result = _row("ResNet-50 profile")
    assert f"batch {profile['batch_size']}, {profile['value_dtype']}" in what and profile["world_size"] == 1
    assert result.startswith(f"{profile['compute_s'] * 1e3:.1f} ms of compute and {profile['selection_s'] * 1e3:.1f}"
                             " ms of DGC's selection per step")  # fmt: skip


def test_the_targets_table_is_every_target_of_the_record_and_says_whether_each_is_met() -> None:
    """Every target the GPU record's selection part holds (``benchmarks.selection.GPU_TARGETS``, its limit as
    recorded) and the two memory targets, from :func:`benchmarks.doc_claims.gpu_targets_table`."""
    from benchmarks import doc_claims
    from benchmarks.selection import GPU_TARGETS

    check = _record("gpu_check")["parts"]
    targets = check["selection"]["result"]["targets"]
    assert sorted(t["limit"] for t in targets) == sorted(GPU_TARGETS.values())  # all four, the record's limits
    table = doc_claims.gpu_targets_table()
    assert "\n".join(table) in (ROOT / PAGE).read_text()
    assert len(table) == 2 + len(targets) + len(doc_claims.MEMORY_TARGETS)
    met = [row.endswith("| yes |") for row in table[2:]]
    assert ("None is met" in _text(PAGE)) == (not any(met))
    m = _selection(check["selection"]["result"])
    ms = m["median_ms"]
    # "the batched selection is no faster than exact top-k"
    assert ms["exact"] <= ms["dgc_batched"] and "no faster than exact top-k" in _text(PAGE)


def test_the_page_says_the_recommended_configuration_never_ran_on_a_gpu() -> None:
    """The GPU record holds no run of int8 values or of ``compile_selection`` (it predates both), so the page says
    that the recommended configuration has never run on a GPU, and names the record's commit."""
    import json

    from benchmarks.doc_claims import RECOMMENDED_DGC

    record = _record("gpu_check")
    text = json.dumps(record)
    assert "int8" not in text and "compile_selection" not in text
    assert (f"the GPU record (`gpu_check.json`, commit {record['environment']['git_commit']}) predates int8 values"
            f" (`value_dtype=\"int8\"`) and `compile_selection`, so `{RECOMMENDED_DGC}` has never run on a GPU") in _text(PAGE)


def test_the_memory_account_table_says_it_has_no_record() -> None:
    """No committed record holds the account's figures: the page says so, and a test recomputes them (below)."""
    held = [p.name for p in (ROOT / "benchmarks" / "results").rglob("*.json") if '"run_model_sizes"' in p.read_text()]
    said = "No committed record holds these figures and no GPU has measured them" in _text(PAGE)
    assert said == (not held), held


def test_what_never_ran_is_what_the_records_show() -> None:
    """Every record of a GPU run holds one device; the page lists NCCL, multi-GPU speed and accuracy as never run."""
    check = _record("gpu_check")
    assert check["device"]["count"] == 1
    tests = check["parts"]["tests"]["result"]["tests"]
    assert not [t for t in tests if "nccl" in t.lower()]
    text = _text(PAGE)
    section = text[text.index("## What has never run") : text.index("## Targets on a GPU")]
    for said in ("**NCCL**", "**Speed on several GPUs**", "**Accuracy on a GPU**"):
        assert said in section
    assert re.search(r"NCCL refuses two ranks on one\s+device", text)


def test_the_rebuild_commands_name_the_records() -> None:
    text = (ROOT / PAGE).read_text()
    block = text[text.rindex("```bash") :]
    assert "python -m benchmarks.gpu_check\n" in block
    assert _record("selection_cuda")["config"]["reps"] == 7 and "--reps 7 --out benchmarks/results/selection_cuda.json" in block
    assert "--profile-out benchmarks/results/profile_resnet50_h100.json" in block
    assert _record("profile_resnet50_h100")["command"].endswith("--profile-out benchmarks/results/profile_resnet50_h100.json")


def test_the_static_selection_table_quotes_its_record() -> None:
    record = _record("static_selection")
    ms = record["median_ms"]
    assert record["compiled_equals_eager"] and record["static_equals_batched"] and not record["compile_failures"]
    assert record["config"]["reps"] == 7 and record["compressed_tensors"] == 54 and record["buckets"] == 5
    rows = {r[0]: r[1:] for r in _rows("the batched selection (") + _rows("the shape-static form") + _rows("tensor by tensor on numpy")}
    for label, form, ratio in (
        ("the batched selection (`compile_selection=False`)", "batched", "1"),
        ("the shape-static form, eager", "static_eager", f"{ms['static_eager'] / ms['batched']:.1f}"),
        ("the shape-static form, compiled (inductor, CPU)", "static_compiled", f"{ms['static_compiled'] / ms['batched']:.1f}"),
        ("tensor by tensor on numpy views (the CPU's default)", "per_tensor", f"{ms['per_tensor'] / ms['batched']:.2f}"),
    ):  # fmt: skip
        assert rows[label] == [f"{ms[form]:.1f}", ratio], (label, rows[label])
    compile_s = record["compile_s_per_bucket"]
    assert f"Compiling took {min(compile_s):.0f} to {max(compile_s):.0f} s per bucket" in _text(PAGE)


def test_the_memory_account_rows_are_the_function_s() -> None:
    from benchmarks.checkpoint_memory import memory_accounts

    params = _record("gpu_check")["parts"]["checkpoint_memory"]["result"]["params"]
    accounts = memory_accounts(params)
    for name, label in (("dgc", "account, DGC"), ("deft", "account, DEFT")):
        account = accounts[name]
        assert _row(label)[1:] == [f"{account['run_model_sizes']:.2f}", f"{account['step_model_sizes']:.2f}",
                                   _signed(account["over_ddp_model_sizes"], 2)], name  # fmt: skip
    from tests.test_memory_account import TOLERANCE_MODEL_SIZES

    assert f"within {TOLERANCE_MODEL_SIZES} model sizes" in _text(PAGE)


def test_the_static_selection_ratio_in_the_text_is_the_record_s() -> None:
    ms = _record("static_selection")["median_ms"]
    assert f"the compiled form is {ms['static_compiled'] / ms['batched']:.1f} times slower" in _text(PAGE)
