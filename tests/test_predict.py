"""``lightning-dgc-predict``: the performance model from the installed package, without the checkout's
benchmarks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_dgc.perfmodel import Profile
from lightning_dgc.perfmodel.cli import main, shipped_profiles

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "benchmarks" / "results" / "two_level" / "scaling_resnet50.json"
#: The docs' ResNet-50 example: the shipped GPU profile on nodes of 8 GPUs.
GPU = ["--model", "resnet50_h100", "--gpus-per-node", "8"]


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_command_prints_the_prediction_of_the_record_outside_the_checkout(tmp_path: Path) -> None:
    """Run from an empty folder, where ``benchmarks`` cannot be imported: the shipped profile gives the
    figures of the committed record (DGC on 1 Gbit/s at 64 nodes of 8 GPUs)."""
    script = Path(sys.executable).with_name("lightning-dgc-predict")
    assert script.exists(), "reinstall the package (pip install -e .) to get the lightning-dgc-predict command"
    result = _run(str(script), *GPU, "--workers", "512", "--bandwidths", "1",
                  "--methods", "dgc,dgc_node", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    highlights = json.loads(RECORD.read_text())["highlights"]
    lines = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line.startswith("dgc")}
    assert lines["dgc"][5] == f"{highlights['dgc_1g']:.1f}x" and lines["dgc_node"][5] == f"{highlights['dgc_node_1g']:.1f}x"
    profile = json.loads(RECORD.read_text())["profile"]  # the record's times are the shipped GPU profile's
    times = f"compute {profile['compute_s'] * 1e3:.1f} ms, selection {profile['selection_s'] * 1e3:.1f} ms per step"
    assert "predicted, not measured" in result.stdout and times in result.stdout
    probe = _run(sys.executable, "-c", "import benchmarks", cwd=tmp_path)
    assert probe.returncode != 0  # the checkout's benchmarks were not on the path


def test_json_rows_and_a_profile_given_by_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = Profile.load(shipped_profiles()["resnet110"]).save(tmp_path / "mine.json")
    assert main(["--profile", str(path), "--workers", "1,8", "--bandwidths", "0.1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["method"] for r in rows} == {"ddp", "dgc", "deft", "powersgd"} and len(rows) == 8
    one = [r for r in rows if r["workers"] == 1]
    assert all(r["speedup"] == 1.0 and r["link_bytes"] == 0 for r in one)
    ddp, dgc = (next(r for r in rows if r["method"] == m and r["workers"] == 8) for m in ("ddp", "dgc"))
    assert dgc["link_bytes"] < ddp["link_bytes"] / 10 and dgc["speedup"] > ddp["speedup"]


def test_the_shipped_profiles_are_listed(capsys: pytest.CaptureFixture[str]) -> None:
    assert {"resnet50", "resnet110", "lstm"} <= set(shipped_profiles())
    assert main(["--list"]) == 0
    assert "resnet50" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "resnet51"], "not a shipped profile; choose one of"),
        (["--profile", "missing.json"], "no such file"),
        (["--methods", "dgc,topk"], "unknown \\['topk'\\]"),
        (["--bandwidths", "1,fast"], "numbers separated by commas"),
        (["--compute-ms", "0"], "--compute-ms must be > 0"),
    ],
)
def test_bad_input_names_the_fix(args: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(args)


def test_a_profile_without_shapes_is_refused(tmp_path: Path) -> None:
    old = {"model": "old", "compute_s": 0.1, "buckets": [{"numel": 5000, "dense_bytes": 20000, "sparse_numels": [4000]}]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(SystemExit, match="ExchangeProfiler"):
        main(["--profile", str(tmp_path / "old.json")])
