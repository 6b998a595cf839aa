"""One command for a machine with a CUDA GPU: every GPU check of lightning-dgc, one JSON.

    python -m benchmarks.gpu_check [--out benchmarks/results/gpu_check.json] [--parts tests,fits,...]

Five parts, each in its own process with its own time budget (the sum stays under 8 minutes); a
part that fails, raises or runs out of time is recorded as such and the next one runs:

* ``tests``: every CUDA test of the suite, run by pytest: the tests whose id names ``cuda`` (the
  ``device=cuda`` cases) or that skip without a CUDA device, among the test files that mention CUDA.
  Among them the rank-agreement cases (fp32, fp16 values, bf16 parameters), two processes sharing the
  GPU over gloo (NCCL refuses two ranks on one device). Outcome and duration per test id.
* ``fits``: a real Lightning ``fit`` of a small convolutional network, 2 processes sharing the GPU over
  gloo, under ``16-mixed`` and ``bf16-true`` for ``dgc``, ``deft`` and ``powersgd`` (all six at once):
  that it ran every step, the losses and parameters stayed finite, both ranks ended with the same
  parameters, the exchange's ``compression_stats()``, and the parameters' device and dtype on the first
  training batch. Beside them (all eight at once) ``ddp`` and
  ``dgc_dense`` (DGC at density 1) in fp32: DGC must take DDP's own step and end with its parameters, bit
  for bit.
* ``selection``: :mod:`benchmarks.selection` with ``--device cuda`` on ResNet-50 (5 rounds, DEFT at 8
  simulated workers): per-tensor and batched selection times and the GPU targets.
* ``checkpoint_memory``: :mod:`benchmarks.checkpoint_memory`'s workers with ``--accelerator cuda``, both
  ranks on this GPU: ``torch.cuda.max_memory_allocated()`` during ``fit`` and ``save_checkpoint`` per
  strategy and rank, in model sizes, and its excess over the two DDP baselines; beside them, printed and
  recorded, DGC's and DEFT's memory account for the same model (:mod:`lightning_dgc.exchange.memory_account`).
* ``profile``: the ResNet-50 profile of :mod:`benchmarks.scaling_model` (``ExchangeProfiler`` under
  ``DGCStrategy``, one process, batch 32, 3 warm-up and 5 measured steps), bucket tensor shapes included;
  ``--profile-out`` also writes it as a file for ``python -m benchmarks.scaling_model --profile``.

The JSON holds the device, the torch, CUDA, cuDNN and Lightning versions, and per part its status
(``ok``, ``failed``: it ran and a check failed, ``error``, ``timeout``, ``skipped``: no time left), wall
time, budget, result and, unless ``ok``, the end of its log. It is rewritten after every part. Exit
code 0 when every part is ``ok``, 1 otherwise, 2 without a CUDA device (nothing runs). ``--device cpu``
runs the same parts on the CPU to try the command itself (``16-mixed`` then runs as ``bf16-mixed``, as
Lightning does on a CPU; no GPU figure comes out of it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "gpu_check.json"
#: The whole command's limit; every part's budget is cut to what is left of it.
TOTAL_BUDGET_S = 470.0
#: A part is not started with less time than this left.
MIN_START_S = 10.0
#: A part may write what it has done so far to this file beside its result (kept if it is stopped).
PARTIAL = "partial.json"
ALGORITHMS = ("dgc", "deft", "powersgd")
PRECISIONS = ("16-mixed", "bf16-true")
#: DGC at density 1 takes DDP's own step: a fit of each, whose parameters must agree bit for bit.
DENSE_PAIR = (("ddp", "32-true"), ("dgc_dense", "32-true"))
STATUSES = ("ok", "failed", "error", "timeout", "skipped")
#: Every process a part started as the leader of a new process group (`start_new_session`: the ranks of a fit), stopped with the part.
_STARTED: list[Any] = []


def run_ranks(command: Callable[[int], list[str]], logs: Path, timeout_s: float, world: int = 2) -> list[int | None]:
    """Start ``command(rank)`` for every rank with Lightning's environment variables (one process per "node",
    all on this machine's first device, joined over gloo); their exit codes (``None``: stopped at the timeout)."""
    from benchmarks import common

    port = common.free_port()
    procs = [
        common.start(command(rank), common.distributed_env(rank, world, "127.0.0.1", port),
                     logs.with_name(f"{logs.name}.rank{rank}.log"))  # fmt: skip
        for rank in range(world)
    ]
    _STARTED.extend(procs)
    return common.wait_all(procs, timeout_s)


# -- part: tests -----------------------------------------------------------------------------------------
def is_cuda_test(nodeid: str, skip_reasons: Sequence[str]) -> bool:
    """A test of the GPU paths: its id names CUDA (a ``device=cuda`` case), or it skips without CUDA."""
    return "cuda" in nodeid.lower() or any("cuda" in r.lower() or "gpu" in r.lower() for r in skip_reasons)


def cuda_test_files(root: Path) -> list[Path]:
    """The test files under ``root`` that mention CUDA (collecting the whole suite costs its imports), but
    ``test_gpu_check.py``: its tests run this command."""
    return sorted(
        p for p in root.rglob("test_*.py") if p.name != "test_gpu_check.py" and "cuda" in p.read_text().lower()
    )


class CudaTestRecorder:
    """A pytest plugin: keeps only :func:`is_cuda_test` items and records each one's outcome and duration,
    writing the summary to ``path`` after every test (a run stopped by its budget keeps what it did)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tests: dict[str, dict[str, Any]] = {}

    def pytest_collection_modifyitems(self, session: Any, config: Any, items: list[Any]) -> None:
        reasons = {
            item.nodeid: [str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")] for item in items
        }
        keep = [item for item in items if is_cuda_test(item.nodeid, reasons[item.nodeid])]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
        self.tests = {item.nodeid: {"outcome": "not run", "duration_s": 0.0} for item in keep}
        self._write()

    def pytest_runtest_logreport(self, report: Any) -> None:
        test = self.tests.setdefault(report.nodeid, {"outcome": "not run", "duration_s": 0.0})
        test["duration_s"] = round(test["duration_s"] + report.duration, 3)
        if report.when == "call" or report.outcome != "passed":
            outcome = "error" if report.failed and report.when != "call" else report.outcome
            if test["outcome"] in ("not run", "passed"):
                test["outcome"] = outcome
            if report.skipped and isinstance(report.longrepr, tuple):
                test["reason"] = str(report.longrepr[2])
            elif report.failed:
                test["message"] = str(report.longrepr)[-3000:]
        self._write()

    def _write(self) -> None:
        self.path.write_text(json.dumps(summarize_tests(self.tests)))


def summarize_tests(tests: dict[str, dict[str, Any]], exit_code: int | None = None) -> dict[str, Any]:
    counts = {o: sum(t["outcome"] == o for t in tests.values()) for o in ("passed", "failed", "error", "skipped")}
    counts["not_run"] = sum(t["outcome"] == "not run" for t in tests.values())
    ok = bool(tests) and counts["passed"] == len(tests) and exit_code in (0, None)
    return {"ok": ok, "counts": counts, "pytest_exit_code": exit_code, "tests": tests}


def run_tests(out: Path, budget_s: float, device: str = "cuda", per_test_timeout_s: int = 120) -> dict[str, Any]:
    import pytest

    recorder = CudaTestRecorder(out.with_name(PARTIAL))
    files = [str(p.relative_to(REPO)) for p in cuda_test_files(REPO / "tests")]
    timeout = max(1, int(min(per_test_timeout_s, budget_s - 5)))
    # in this process, where the recorder sees each test (the suite's own runs spread over workers: -n auto)
    in_process = ["-n", "0"] if importlib.util.find_spec("xdist") is not None else []
    code = pytest.main(
        ["-q", "-p", "no:cacheprovider", *in_process, "-o", f"timeout={timeout}", *files], plugins=[recorder]
    )
    summary = summarize_tests(recorder.tests, int(code))
    summary["files"] = files
    if device == "cpu":  # on the CPU the CUDA tests skip: the run checks only that they are found
        summary["ok"] = summary["counts"]["failed"] + summary["counts"]["error"] == 0
    return summary


# -- part: fits ------------------------------------------------------------------------------------------
def fit_recorder() -> Any:
    """A Lightning callback that records, for :func:`fit_rank`, each step's loss and ``compression_stats()``, and
    the parameters' device and dtype as training sees them on the first batch (``param_device``,
    ``param_dtype``): after ``fit`` Lightning has moved the module back to the CPU."""
    import lightning as L

    class FitRecorder(L.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.stats: list[dict[str, Any]] = []
            self.param_device: str | None = None
            self.param_dtype: str | None = None

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if self.param_device is None:
                param = next(module.parameters())
                self.param_device, self.param_dtype = str(param.device), str(param.dtype)

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.losses.append(float(outputs["loss"]))
            self.stats.append(dict(getattr(trainer.strategy, "compression_stats", dict)()))  # DDP: none

    return FitRecorder()


def fit_rank(out: Path, algorithm: str, precision: str, device: str = "cuda", steps: int = 8) -> dict[str, Any]:
    """One rank of a 2-process fit (Lightning's environment variables set by :func:`run_fits`)."""
    import hashlib

    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks import common

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    images = torch.randn(2 * 8 * steps, 3, 16, 16, generator=g)
    labels = torch.randint(0, 10, (len(images),), generator=g)

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10),
            )  # fmt: skip

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    recorder, module = fit_recorder(), Net()
    trainer = L.Trainer(
        accelerator=device, devices=1, num_nodes=2, strategy=common.make_strategy(algorithm, density=0.01),
        precision=precision, max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[recorder],
        deterministic=(algorithm, precision) in DENSE_PAIR,  # cuDNN's own backward differs from run to run
    )  # fmt: skip
    trainer.fit(module, DataLoader(TensorDataset(images, labels), batch_size=8))
    params = [p.detach() for p in module.parameters()]
    if (algorithm, precision) in DENSE_PAIR:  # compared with each other by run_fits
        torch.save(torch.cat([p.reshape(-1).float().cpu() for p in params]), out.with_suffix(".pt"))
    digest = hashlib.sha256()
    for p in params:
        digest.update(p.reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "precision": str(trainer.precision),
        "precision_plugin": type(trainer.precision_plugin).__name__,
        "param_dtype": recorder.param_dtype,
        "param_device": recorder.param_device,
        "hook_calls": getattr(trainer.strategy, "hook_calls", 0),
        "losses": recorder.losses,
        "params_finite": all(bool(torch.isfinite(p).all()) for p in params),
        "params_sha256": digest.hexdigest(),
        "grad_scale": float(scaler.get_scale()) if scaler is not None else None,
        "compression_stats": recorder.stats[-1] if recorder.stats else {},
        "compression_ratio_per_step": [s.get("compression_ratio") for s in recorder.stats],
    }


def fit_checks(ranks: Sequence[dict[str, Any]], steps: int, algorithm: str = "dgc") -> dict[str, bool]:
    """What a fit must show: every step ran, finite, both ranks hold the same parameters, and (but under
    ``ddp``) the hook ran and compressed; ``dgc_dense`` instead took DDP's own step."""
    finite = all(
        r["params_finite"] and all(x == x and abs(x) != float("inf") for x in r["losses"]) for r in ranks
    )
    checks = {
        "ran": len(ranks) == 2 and all(r["global_step"] == steps for r in ranks),
        "finite": finite,
        "ranks_agree": len({r["params_sha256"] for r in ranks}) == 1,
    }
    if algorithm == "ddp":
        return checks
    checks["hook_called"] = all(r["hook_calls"] > 0 for r in ranks)
    if algorithm == "dgc_dense":
        checks["ddp_step"] = all(r["compression_stats"].get("ddp_step") is True for r in ranks)
    else:
        checks["compressed"] = all((r["compression_stats"].get("compression_ratio") or 0) > 1 for r in ranks)
    return checks


def run_fits(
    out: Path, budget_s: float, device: str = "cuda", algorithms: Sequence[str] = ALGORITHMS,
    precisions: Sequence[str] = PRECISIONS, steps: int = 8, dense: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """Every (algorithm, precision) fit at once, each on its own 2 processes; with ``dense``, also
    :data:`DENSE_PAIR`, and whether DGC at density 1 ended with DDP's parameters (``equals_ddp``)."""
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks import common

    folder = out.parent / "fits"
    folder.mkdir(parents=True, exist_ok=True)
    runs = [(a, p) for a in algorithms for p in precisions] + (list(DENSE_PAIR) if dense else [])

    def one(algorithm: str, precision: str) -> dict[str, Any]:
        name = f"{algorithm}_{precision}"
        args = json.dumps({"algorithm": algorithm, "precision": precision, "device": device, "steps": steps})

        def command(rank: int) -> list[str]:
            return [common.python(), "-m", "benchmarks.gpu_check", "--child", "fit_rank", "--child-args", args,
                    "--child-out", str(folder / f"{name}.rank{rank}.json")]  # fmt: skip

        codes = run_ranks(command, folder / name, budget_s - 5)
        if any(code != 0 for code in codes):
            return {"ok": False, "exit_codes": codes, "log_tail": common.tail(folder / f"{name}.rank0.log", 30)}
        ranks = [json.loads((folder / f"{name}.rank{r}.json").read_text())["result"] for r in range(2)]
        checks = fit_checks(ranks, steps, algorithm)
        return {"ok": all(checks.values()), "checks": checks, "ranks": ranks}

    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        futures = {f"{a}/{p}": pool.submit(one, a, p) for a, p in runs}
        fits = {name: future.result() for name, future in futures.items()}
    ddp, dense_fit = (fits.get("/".join(pair)) for pair in DENSE_PAIR)
    if ddp and dense_fit and "ranks" in ddp and "checks" in dense_fit:
        import torch

        same = ddp["ranks"][0]["params_sha256"] == dense_fit["ranks"][0]["params_sha256"]
        a, b = (torch.load(folder / f"{'_'.join(pair)}.rank0.pt") for pair in DENSE_PAIR)
        dense_fit["max_abs_diff_from_ddp"] = float((a - b).abs().max())
        dense_fit["checks"]["equals_ddp"] = same
        dense_fit["ok"] = dense_fit["ok"] and same
    return {"ok": all(f["ok"] for f in fits.values()), "steps": steps, "fits": fits}


# -- part: selection ---------------------------------------------------------------------------------------
def run_selection(
    out: Path, budget_s: float, device: str = "cuda", models: Sequence[str] = ("resnet50",), workers: Sequence[int] = (8,),
    reps: int = 5,
) -> dict[str, Any]:  # fmt: skip
    from benchmarks import selection

    argv = ["--device", device, "--models", *models, "--workers", *map(str, workers), "--reps", str(reps)]
    report = selection.main([*argv, "--out", str(out.with_name("selection.json"))])
    report["command"] = "python -m benchmarks.selection " + " ".join(argv)
    report["targets_met"] = f"{sum(t['met'] for t in report['targets'])}/{len(report['targets'])}"
    return {"ok": True, **report}  # a missed target is a finding, not a failed check


# -- part: checkpoint memory ---------------------------------------------------------------------------------
def run_checkpoint_memory(
    out: Path, budget_s: float, device: str = "cuda", params: float = 33.7e6, steps: int = 3
) -> dict[str, Any]:
    """:mod:`benchmarks.checkpoint_memory`'s workers, every strategy at once, both ranks on this one GPU."""
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks import checkpoint_memory as memory
    from benchmarks import common

    folder = out.parent / "checkpoint_memory"
    folder.mkdir(parents=True, exist_ok=True)

    def one(strategy: str) -> list[dict[str, Any]] | str:
        stem = folder / strategy
        command = [common.python(), "-m", "benchmarks.checkpoint_memory", "--worker", strategy, "--params",
                   str(params), "--steps", str(steps), "--out", str(stem), "--accelerator", device]  # fmt: skip
        if any(code != 0 for code in run_ranks(lambda rank: command, stem, budget_s - 5, memory.WORLD)):
            return common.tail(folder / f"{strategy}.rank0.log", 30)
        return [json.loads(stem.with_name(f"{strategy}.rank{r}.json").read_text()) for r in range(memory.WORLD)]

    strategies = [s for s in memory.STRATEGIES if s != "dgc_batched"]  # on a GPU, ``dgc`` selects batched already
    with ThreadPoolExecutor(max_workers=len(strategies)) as pool:
        done = dict(zip(strategies, pool.map(one, strategies), strict=True))
    runs = {name: r for name, r in done.items() if isinstance(r, list)}
    errors = {name: r for name, r in done.items() if isinstance(r, str)}
    columns = []
    for name, ranks in runs.items():
        for r in ranks:
            row = {"strategy": name, "rank": r["rank"], "cuda peak": r.get("cuda_training_peak_model_sizes"),
                   "cuda save peak": r.get("cuda_save_peak_model_sizes")}  # fmt: skip
            for short, baseline in memory.BASELINES.items():
                base = runs.get(baseline, [{}] * memory.WORLD)[r["rank"]].get("cuda_training_peak_model_sizes")
                row[f"cuda peak - {short}"] = None if base is None or row["cuda peak"] is None else row["cuda peak"] - base
            columns.append(row)
    measured = device != "cuda" or all(row["cuda peak"] is not None for row in columns)
    accounts = memory.memory_accounts(params)  # what the exchange should hold, beside what it held
    for name, account in accounts.items():
        print_account(name, account)
    return {"ok": not errors and measured, "params": params, "steps": steps, "cuda_columns": columns,
            "errors": errors, "runs": runs, "accounts": accounts}  # fmt: skip


def print_account(name: str, account: dict[str, Any]) -> None:
    """One algorithm's memory account (:func:`benchmarks.checkpoint_memory.memory_accounts`) as a table."""
    from benchmarks import common

    common.print_table(
        f"{name}: the exchange's memory at its peak (account, model sizes)", ["tensor", "kind", "model sizes", "what"],
        [[r["name"], r["lifetime"], round(r["model_sizes"], 3), r["what"]] for r in account["rows"]],
        caption=f"total {account['total_model_sizes']:.2f}, over DDP {account['over_ddp_model_sizes']:.2f}",
    )  # fmt: skip


# -- part: profile -------------------------------------------------------------------------------------------
def run_profile(
    out: Path, budget_s: float, device: str = "cuda", model: str = "resnet50", batch_size: int = 32, warmup: int = 3,
    steps: int = 5, path: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    from benchmarks.scaling_model import profile_model

    profile = profile_model(model, batch_size, steps, warmup, accelerator=device, path=Path(path) if path else None)
    data = profile.to_dict()
    shapes = all(b["shapes"] and len(b["shapes"]) == len(b.get("names") or b["shapes"]) for b in data["buckets"])
    checks = {"shapes_kept": shapes, "stats_match": bool(data["stats_match"]), "timed": data["compute_s"] > 0}
    return {"ok": all(checks.values()), "checks": checks, "profile": data}


# -- the parts, and running them ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Part:
    name: str
    what: str  # for the message without CUDA and the report
    budget_s: float
    run: Callable[..., dict[str, Any]]  # (out, budget_s, device, **overrides) in the part's own process


PARTS: dict[str, Part] = {
    p.name: p
    for p in (
        Part("tests", "every CUDA test of the suite (pytest)", 150, run_tests),
        Part("fits", "a Lightning fit under 16-mixed and bf16-true for dgc, deft and powersgd; DGC at density 1 against DDP", 90, run_fits),
        Part("selection", "the selection benchmark on CUDA", 75, run_selection),
        Part("checkpoint_memory", "the CUDA memory columns of benchmarks.checkpoint_memory", 75, run_checkpoint_memory),
        Part("profile", "the ResNet-50 profile for the scaling model", 75, run_profile),
    )
}
CHILDREN: dict[str, Callable[..., dict[str, Any]]] = {**{p.name: p.run for p in PARTS.values()}, "fit_rank": fit_rank}


def _stop_started(signum: int, frame: Any) -> None:
    from benchmarks import common

    for proc in _STARTED:
        common.stop(proc, grace_s=2)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # ended by the signal, as the parent expects of a stopped part


def run_child(name: str, args: dict[str, Any], out: Path) -> int:
    """The body of a part's (or a fit rank's) process: ``{"result": ...}`` or ``{"error": ...}`` to ``out``.
    Stopped (at its budget), it stops the processes it started as leaders of new process groups (`start_new_session`)."""
    signal.signal(signal.SIGTERM, _stop_started)
    try:
        result = CHILDREN[name](out=out, **args)
    except BaseException as error:  # noqa: BLE001  (recorded, and the process fails)
        out.write_text(json.dumps({"error": "".join(traceback.format_exception(error))[-6000:]}))
        return 1
    out.write_text(json.dumps({"result": result}, default=str))
    return 0


def run_part(part: Part, device: str, folder: Path, time_left_s: float, **overrides: Any) -> dict[str, Any]:
    """Run ``part`` in its own process within ``min(budget, time_left_s)``; its record (never raises)."""
    from benchmarks import common

    budget = min(part.budget_s, time_left_s)
    record: dict[str, Any] = {"what": part.what, "budget_s": round(budget, 1), "wall_s": 0.0}
    if budget < MIN_START_S:
        return {**record, "status": "skipped", "error": f"{budget:.0f} s left of the command's budget"}
    work = folder / part.name
    work.mkdir(parents=True, exist_ok=True)
    out, log = work / "result.json", folder / f"{part.name}.log"
    for stale in (out, work / PARTIAL):
        stale.unlink(missing_ok=True)
    args = json.dumps({"budget_s": budget, "device": device, **overrides})
    command = [common.python(), "-m", "benchmarks.gpu_check", "--child", part.name, "--child-args", args,
               "--child-out", str(out)]  # fmt: skip
    code, wall = common.run_command(command, common.worker_env(threads=4), log, budget)
    record["wall_s"] = round(wall, 1)
    data = json.loads(out.read_text()) if out.exists() else {}
    result = data.get("result")
    if result is None and (work / PARTIAL).exists():  # what a stopped part had done
        result = {**json.loads((work / PARTIAL).read_text()), "partial": True}
    if code is None:
        status, error = "timeout", f"stopped after its budget of {budget:.0f} s"
    elif "error" in data or code != 0:
        status, error = "error", data.get("error") or f"exit code {code}"
    else:
        status, error = ("ok" if result and result.get("ok") else "failed"), None
    record.update(status=status, result=result, error=error)
    if status != "ok":
        record["log_tail"] = common.tail(log, 40)
    return record


def assemble(
    parts: dict[str, dict[str, Any]], device: dict[str, Any], versions: dict[str, Any], command: str,
    wall_s: float, finished: bool,
) -> dict[str, Any]:  # fmt: skip
    """The JSON record: the machine, every part's record, and whether all of them are ``ok``."""
    return {
        "command": command,
        "ok": finished and bool(parts) and all(p["status"] == "ok" for p in parts.values()),
        "finished": finished,
        "device": device,
        "versions": versions,
        "total_wall_s": round(wall_s, 1),
        "budget_s": TOTAL_BUDGET_S,
        "summary": {name: p["status"] for name, p in parts.items()},
        "parts": parts,
    }


def describe_machine(device: str) -> tuple[dict[str, Any], dict[str, Any]]:
    import lightning
    import torch

    versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                "lightning": lightning.__version__, "python": sys.version.split()[0]}  # fmt: skip
    if device != "cuda":
        return {"type": device, "name": "cpu"}, versions
    props = torch.cuda.get_device_properties(0)
    info = {"type": "cuda", "name": props.name, "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1), "count": torch.cuda.device_count()}  # fmt: skip
    return info, versions


def tables(data: dict[str, Any]) -> list[tuple[str, list[str], list[list[Any]]]]:
    """The report's tables (:mod:`benchmarks.report`): one row per part, and one per CUDA test."""
    parts = [[name, p["status"], p["wall_s"], p["budget_s"], p["what"]] for name, p in data["parts"].items()]
    out = [(f"GPU checks on {data['device'].get('name')} (torch {data['versions'].get('torch')}, CUDA "
            f"{data['versions'].get('cuda')})", ["part", "status", "wall s", "budget s", "what"], parts)]  # fmt: skip
    tests = ((data["parts"].get("tests") or {}).get("result") or {}).get("tests") or {}
    if tests:
        rows = [[nodeid, t["outcome"], t["duration_s"]] for nodeid, t in tests.items()]
        out.append(("CUDA tests", ["test", "outcome", "s"], rows))
    return out


def no_cuda_message(out: Path) -> str:
    import torch

    out = Path(os.path.relpath(out)) if out.is_absolute() and out.resolve().is_relative_to(Path.cwd()) else out
    what = "; ".join(p.what for p in PARTS.values())
    return (
        f"benchmarks.gpu_check needs a CUDA GPU and torch {torch.__version__} sees none; on one it runs, in at most"
        f" {TOTAL_BUDGET_S / 60:.0f} minutes: {what}, and writes {out} (--device cpu tries the command on the CPU)"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON to write (default benchmarks/results/gpu_check.json)")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of %(default)s")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: run the parts on the CPU to try the command (no GPU figures)")  # fmt: skip
    parser.add_argument("--profile-out", type=Path, default=None,
                        help="also write the profile there (for benchmarks.scaling_model --profile)")  # fmt: skip
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--child-args", type=json.loads, default={}, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        parser.error(f"--parts: unknown part(s) {unknown or parts}; pick from {','.join(PARTS)}")
    args.parts = parts
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return run_child(args.child, args.child_args, args.child_out)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(no_cuda_message(args.out), file=sys.stderr)
        return 2
    from benchmarks import common

    start = time.monotonic()
    out = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    device, versions = describe_machine(args.device)
    command = "python -m benchmarks.gpu_check " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"GPU checks on {device['name']}: {', '.join(args.parts)} (at most {TOTAL_BUDGET_S:.0f} s)", flush=True)
    records: dict[str, dict[str, Any]] = {}
    logs = out.parent / "logs" / "gpu_check"

    def write(finished: bool) -> None:
        payload = assemble(records, device, versions, command, time.monotonic() - start, finished)
        payload["environment"] = common.environment()
        text = json.dumps(common.scrub(json.loads(json.dumps(payload, default=str))), indent=1)
        out.write_text(text + "\n")

    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        for name in args.parts:
            overrides = {"path": str(args.profile_out.resolve())} if name == "profile" and args.profile_out else {}
            left = TOTAL_BUDGET_S - (time.monotonic() - start)
            records[name] = run_part(PARTS[name], args.device, Path(work), left, **overrides)
            logs.mkdir(parents=True, exist_ok=True)
            if (Path(work) / f"{name}.log").exists():
                os.replace(Path(work) / f"{name}.log", logs / f"{name}.log")
            print(f"  {name}: {records[name]['status']} in {records[name]['wall_s']:.0f} s", flush=True)
            for algorithm, account in ((records[name].get("result") or {}).get("accounts") or {}).items():
                print_account(algorithm, account)
            write(finished=False)
    write(finished=True)
    print(f"wrote {out}")
    return 0 if all(r["status"] == "ok" for r in records.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
