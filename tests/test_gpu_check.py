"""``python -m benchmarks.gpu_check``: without CUDA it exits at once and says what it would run; its argument
parsing, the JSON it assembles and the checks it applies; its parts run in their own processes, each one's
failure, overrun or lack of time recorded apart (on the CPU here, with ``--device cpu``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check
from benchmarks.gpu_check import (
    PARTS,
    assemble,
    fit_checks,
    is_cuda_test,
    parse_args,
    run_part,
    summarize_tests,
)

ROOT = Path(__file__).resolve().parents[1]


def _command(*args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", *args], cwd=ROOT, env=environment, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip


# -- without a GPU -------------------------------------------------------------------------------------------
def test_without_cuda_it_exits_at_once_saying_what_it_would_run(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    done = _command("--out", str(out), CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1, done.stderr
    message = done.stderr.strip()
    assert message.startswith("benchmarks.gpu_check needs a CUDA GPU and torch ") and "sees none" in message
    for part in PARTS.values():
        assert part.what in message
    assert str(out) in message and "at most 8 minutes" in message
    assert list(tmp_path.iterdir()) == []  # nothing ran, nothing written


# -- arguments -------------------------------------------------------------------------------------------------
def test_arguments() -> None:
    args = parse_args([])
    assert (args.out, args.parts, args.device, args.profile_out) == (gpu_check.RESULTS, list(PARTS), "cuda", None)
    assert gpu_check.RESULTS == ROOT / "benchmarks" / "results" / "gpu_check.json"
    args = parse_args(["--parts", "profile, tests", "--out", "x.json", "--device", "cpu", "--profile-out", "p.json"])
    assert (args.parts, args.out, args.device, args.profile_out) == (["profile", "tests"], Path("x.json"), "cpu",
                                                                     Path("p.json"))  # fmt: skip


@pytest.mark.parametrize("parts", ["tests,gpu", ","])
def test_an_unknown_part_is_refused_with_the_choices(parts: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--parts", parts])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--parts: unknown part(s)" in error and "pick from tests,fits,selection,checkpoint_memory,profile" in error


def test_the_budgets_fit_the_command_s_limit() -> None:
    assert gpu_check.TOTAL_BUDGET_S <= 8 * 60 - 10
    assert sum(p.budget_s for p in PARTS.values()) <= gpu_check.TOTAL_BUDGET_S


# -- pure logic ------------------------------------------------------------------------------------------------
def test_which_tests_are_cuda_tests() -> None:
    assert is_cuda_test("tests/test_comm.py::test_round_trip[cuda-dtype0]", [])
    assert is_cuda_test("tests/test_x.py::test_fast_path", ["needs a CUDA device"])
    assert is_cuda_test("tests/test_x.py::test_fast_path", ["", "no GPU here"])
    assert not is_cuda_test("tests/test_comm.py::test_round_trip[cpu-dtype0]", [""])
    assert not is_cuda_test("tests/test_x.py::test_linux", ["glibc's malloc_trim: Linux only"])


def test_the_tests_are_looked_for_in_the_files_that_mention_cuda() -> None:
    files = [str(p.relative_to(ROOT)) for p in gpu_check.cuda_test_files(ROOT / "tests")]
    assert {"tests/distributed/test_models.py", "tests/test_selection.py", "tests/test_comm.py"} <= set(files)
    assert "tests/test_gpu_check.py" not in files  # (it runs the command: it would run itself)
    assert "tests/test_perfmodel.py" not in files


def test_the_tests_part_passes_only_when_every_test_passed() -> None:
    tests = {"a": {"outcome": "passed"}, "b": {"outcome": "passed"}}
    assert summarize_tests(tests, 0)["ok"] and summarize_tests(tests, 0)["counts"]["passed"] == 2
    assert not summarize_tests(tests, 1)["ok"]  # pytest itself failed (an error outside the tests)
    assert not summarize_tests({}, 0)["ok"]  # a GPU machine that found no CUDA test
    for outcome, key in (("skipped", "skipped"), ("failed", "failed"), ("error", "error"), ("not run", "not_run")):
        summary = summarize_tests({**tests, "c": {"outcome": outcome}}, 0)
        assert not summary["ok"] and summary["counts"][key] == 1


def _rank(**changes: object) -> dict:
    rank = {"global_step": 8, "hook_calls": 8, "params_finite": True, "losses": [2.3, 2.2],
            "params_sha256": "ab", "compression_stats": {"compression_ratio": 9.5}}  # fmt: skip
    return {**rank, **changes}


def test_fit_checks() -> None:
    assert all(fit_checks([_rank(), _rank()], steps=8).values())
    for ranks, failed in [
        ([_rank(), _rank(global_step=7)], "ran"),
        ([_rank()], "ran"),
        ([_rank(), _rank(hook_calls=0)], "hook_called"),
        ([_rank(), _rank(losses=[2.3, float("nan")])], "finite"),
        ([_rank(), _rank(losses=[float("inf")])], "finite"),
        ([_rank(params_finite=False), _rank()], "finite"),
        ([_rank(), _rank(params_sha256="cd")], "ranks_agree"),
        ([_rank(), _rank(compression_stats={"compression_ratio": 1.0})], "compressed"),
        ([_rank(compression_stats={}), _rank()], "compressed"),
    ]:
        checks = fit_checks(ranks, steps=8)
        assert [k for k, v in checks.items() if not v] == [failed], (ranks, checks)
    # DDP has no hook nor compression; DGC at density 1 must take DDP's own step instead of compressing
    assert list(fit_checks([_rank(hook_calls=0), _rank(hook_calls=0)], 8, "ddp")) == ["ran", "finite", "ranks_agree"]
    dense = _rank(compression_stats={"compression_ratio": 1.0, "ddp_step": True})
    assert all(fit_checks([dense, dense], 8, "dgc_dense").values())
    left = _rank(compression_stats={"compression_ratio": 1.0, "ddp_step": False})
    checks = fit_checks([dense, left], 8, "dgc_dense")
    assert [k for k, v in checks.items() if not v] == ["ddp_step"] and "compressed" not in checks


def test_the_record_says_ok_only_when_every_part_finished_ok() -> None:
    device, versions = {"type": "cuda", "name": "NVIDIA H100"}, {"torch": "2.11.0", "cuda": "13.0"}
    ok = {"status": "ok", "wall_s": 10.0, "budget_s": 150, "what": "w", "result": {"ok": True}, "error": None}
    late = {**ok, "status": "timeout", "result": None, "error": "stopped after its budget of 75 s"}
    record = assemble({"tests": ok, "profile": late}, device, versions, "python -m benchmarks.gpu_check", 90.04, True)
    assert not record["ok"] and record["summary"] == {"tests": "ok", "profile": "timeout"}
    assert (record["device"], record["versions"], record["total_wall_s"]) == (device, versions, 90.0)
    assert record["parts"]["profile"]["error"] == "stopped after its budget of 75 s"
    assert assemble({"tests": ok}, device, versions, "c", 1.0, True)["ok"]
    assert not assemble({"tests": ok}, device, versions, "c", 1.0, False)["ok"]  # still running
    assert not assemble({}, device, versions, "c", 1.0, True)["ok"]
    assert json.loads(json.dumps(record)) == record
    (parts, columns, rows), *rest = gpu_check.tables(record)
    assert "NVIDIA H100" in parts and "2.11.0" in parts and rows == [
        ["tests", "ok", 10.0, 150, "w"], ["profile", "timeout", 10.0, 150, "w"]
    ] and rest == []  # fmt: skip


def test_a_fit_records_the_device_and_dtype_it_trained_with() -> None:
    """``param_device`` and ``param_dtype`` are what training saw, not where ``fit`` leaves the module (Lightning
    moves it back to the CPU at teardown; here a callback turns it to float64 once training has ended)."""
    import lightning as L
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 1)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class ToFloat64AfterTraining(L.Callback):
        def on_fit_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
            module.double()

    recorder, module = gpu_check.fit_recorder(), Net()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=3, callbacks=[recorder, ToFloat64AfterTraining()], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(12, 4), torch.randn(12, 1)), batch_size=4))
    assert next(module.parameters()).dtype == torch.float64  # where fit left it
    assert (recorder.param_device, recorder.param_dtype) == ("cpu", "torch.float32")
    assert len(recorder.losses) == 3 and recorder.stats == [{}, {}, {}]  # no compression strategy: no stats


# -- running the parts (on the CPU) -------------------------------------------------------------------------
@pytest.mark.slow
def test_the_command_finds_every_cuda_test_and_writes_its_record(tmp_path: Path) -> None:
    out = tmp_path / "record.json"
    done = _command("--device", "cpu", "--parts", "tests", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(out.read_text())
    assert record["ok"] and record["finished"] and record["device"] == {"type": "cpu", "name": "cpu"}
    assert record["versions"]["torch"] == torch.__version__ and record["environment"]["argv"]
    part = record["parts"]["tests"]
    assert part["status"] == "ok" and 0 < part["wall_s"] <= part["budget_s"] == 150
    tests = part["result"]["tests"]
    ranks = [t for t in tests if "test_models.py::test_cuda_ranks_stay_bit_identical[" in t]
    assert len(ranks) == 6 and "tests/test_selection.py::test_cuda_selection_with_a_cpu_generator" in tests
    assert all(is_cuda_test(t, []) for t in tests) and not any("[cpu" in t or "test_gpu_check" in t for t in tests)
    for nodeid in [*ranks, "tests/test_selection.py::test_cuda_selection_with_a_cpu_generator"]:
        expected = "passed" if torch.cuda.is_available() else "skipped"
        assert tests[nodeid]["outcome"] == expected, (nodeid, tests[nodeid])
        if expected == "skipped":
            assert "needs a CUDA device" in tests[nodeid]["reason"]
    assert (tmp_path / "logs" / "gpu_check" / "tests.log").exists()


@pytest.mark.slow
def test_a_part_s_error_overrun_or_lack_of_time_is_recorded_as_such(tmp_path: Path) -> None:
    error = run_part(PARTS["profile"], "cpu", tmp_path, 300, batch=3)
    assert error["status"] == "error" and error["result"] is None
    assert "TypeError: run_profile() got an unexpected keyword argument 'batch'" in error["error"]

    late = run_part(PARTS["selection"], "cpu", tmp_path, 10, models=["resnet50", "lstm"], reps=50)
    assert late["status"] == "timeout" and late["error"] == "stopped after its budget of 10 s"
    assert late["budget_s"] == 10 and 10 <= late["wall_s"] < 25 and late["log_tail"] is not None

    skipped = run_part(PARTS["profile"], "cpu", tmp_path, gpu_check.MIN_START_S - 1)
    assert skipped["status"] == "skipped" and skipped["wall_s"] == 0.0 and "s left" in skipped["error"]


@pytest.mark.slow
def test_a_fit_runs_on_two_ranks_and_checks_them(tmp_path: Path) -> None:
    """16-mixed on the CPU runs as bf16-mixed (Lightning's choice there), the same code path otherwise."""
    record = run_part(PARTS["fits"], "cpu", tmp_path, 240, algorithms=["deft"], precisions=["16-mixed"], steps=3)
    assert record["status"] == "ok", record
    fit = record["result"]["fits"]["deft/16-mixed"]
    assert fit["ok"] and all(fit["checks"].values())
    ranks = fit["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world_size"] == 2 for r in ranks)
    assert all(r["precision"] == "bf16-mixed" and r["param_dtype"] == "torch.float32" for r in ranks)
    assert all(r["param_device"] == "cpu" for r in ranks)  # as seen during training (on a GPU: cuda:0)
    assert all(len(r["losses"]) == 3 and r["compression_stats"]["algorithm"] == "deft" for r in ranks)
    dense = record["result"]["fits"]["dgc_dense/32-true"]
    assert dense["checks"]["equals_ddp"] and dense["checks"]["ddp_step"], dense["checks"]
