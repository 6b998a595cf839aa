"""Helpers shared by the benchmark scripts (slow links, overhead, parity, report).

* Output: a rich console, tables, JSON files under ``benchmarks/results/`` stamped with the
  environment they were measured in, and optional matplotlib figures.
* Strategies by name (``ddp``, ``powersgd``, ``dgc``, ``deft``, ``dgc_dense``); PowerSGD is
  lightning_dgc's (stock Lightning registers torch's hooks on CUDA only, and torch's PowerSGD hook
  hangs on gloo with more than one bucket).
* Synthetic workloads (ResNet-20/110 on CIFAR-shaped images, the CPU-sized PTB LSTM) and
  :func:`train_steps`, which runs real Lightning training steps under one strategy and times them
  with :class:`StepTimer` (batch start to batch end, i.e. forward, backward, exchange, optimizer).
* Process helpers: :func:`run_command` (bounded, kills its own process group on timeout or
  Ctrl-C), :func:`free_port`.
* :class:`RunRecorder`, a callback the parity benchmark adds to recipe runs through the CLI: it
  writes the final validation metrics and the compression counters of the run to a JSON file.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
#: The launcher's ``time.time()`` when it started a run (read by :class:`RunRecorder`: wall-clock since launch).
LAUNCH_ENV = "LIGHTNING_DGC_BENCH_LAUNCH"
#: ``compression_stats()`` keys of ``density="auto"`` that :class:`RunRecorder` keeps (the last step's).
AUTO_STATS = ("auto_density", "auto_measuring", "predicted_exchange_ms", "measured_exchange_ms",
              "compute_window_ms", "link_mbit_s", "link_latency_ms", "dense_step_ms", "checked_step_ms")  # fmt: skip

#: Strategy names of the speed benchmarks, in the order they are reported.
SPEED_STRATEGIES = ("ddp", "powersgd", "dgc", "deft")
#: Density of ``dgc`` / ``deft`` in the speed benchmarks (the paper's 99.9% sparsity).
DENSITY = 0.001
#: PowerSGD settings: rank 2 (Vogels et al. 2019 use rank 1-4), compression from the 3rd step on.
POWERSGD_RANK = 2
POWERSGD_START_ITER = 2
#: DiLoCo's round in the speed benchmarks (``configs/algo/diloco.yaml``): its step time is the mean over whole rounds.
DILOCO_SYNC_EVERY = 10


# -- output ----------------------------------------------------------------------------------------
def console() -> Any:
    from rich.console import Console

    return Console(width=max(160, int(os.environ.get("COLUMNS", "0") or 0)))


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], caption: str = "") -> None:
    """Print a rich table (every cell formatted with :func:`fmt`)."""
    from rich.table import Table

    table = Table(title=title, caption=caption or None, caption_justify="left")
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(fmt(cell) for cell in row))
    console().print(table)


def fmt(value: Any) -> str:
    """Short text for a table cell: floats to 3-4 significant digits, ``None`` as a dash."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf"
        if value == 0:
            return "0"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 100:
            return f"{value:.1f}"
        if abs(value) >= 1:
            return f"{value:.3g}" if abs(value) < 10 else f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)


def environment() -> dict[str, Any]:
    """Where and with what a figure was measured (stored with every result file)."""
    import lightning
    import torch

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "git_commit": commit,
        "argv": sys.argv,
    }


#: An absolute path of the measuring machine inside a string of a record (a data root, the interpreter,
#: a scratch folder): never committed. ``(?<![\w.<>~])`` leaves relative paths and ratios such as ``1/N``.
MACHINE_PATH = re.compile(r"(?<![\w.<>~/])/(?:work|root|home|tmp|mnt|scratch|opt|usr|data|var|srv)(?:/[^\s'\"|,;\]\)]*)?")


def scrub(value: Any, checkout: Path | str = REPO) -> Any:
    """``value`` (a record, or any part of one) with the paths of the machine it was measured on taken
    out: a path in the ``checkout`` becomes relative to it (``benchmarks/parity.py``), the interpreter
    ``python``, a data root ``<data>`` (``/x/shared/data/ptb`` -> ``<data>/ptb``), the temporary folder
    ``<tmp>``, any other absolute path ``<path>``. Applied by :func:`write_json` to every record."""
    if isinstance(value, dict):
        return {key: scrub(item, checkout) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub(item, checkout) for item in value]
    if isinstance(value, Path):
        value = str(value)
    if not isinstance(value, str) or "/" not in value:
        return value
    root = str(checkout).rstrip("/")
    text = value.replace(sys.executable, "python")
    text = re.sub(rf"{re.escape(root)}(?=/|\b)/?", lambda m: "" if m.group(0).endswith("/") else ".", text)
    temporary = tempfile.gettempdir().rstrip("/")

    def placeholder(match: re.Match[str]) -> str:
        path = match.group(0)
        data = re.search(r"/data(?=/|$)", path)
        if data:
            return "<data>" + path[data.end() :]
        if path == temporary or path.startswith(temporary + "/"):
            return "<tmp>" + path[len(temporary) :]
        return "<path>"

    return MACHINE_PATH.sub(placeholder, text)


def _said_written(path: Path) -> None:
    console().print(f"[green]wrote[/green] {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")


def write_json(name: str, payload: dict[str, Any]) -> Path:
    """Write ``benchmarks/results/<name>`` with an ``environment`` entry added, the measuring machine's
    paths taken out (:func:`scrub`); returns the path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    payload = scrub(json.loads(json.dumps({**payload, "environment": environment()}, default=_json_default)))
    path.write_text(json.dumps(payload, indent=2) + "\n")
    _said_written(path)
    return path


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def pyplot() -> Any | None:
    """matplotlib.pyplot with the Agg backend, or ``None`` when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig: Any, name: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    _said_written(path)
    return path


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


# -- processes ---------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def python() -> str:
    """The interpreter running the benchmarks (the project's venv when started from it)."""
    return sys.executable


def worker_env(threads: int = 1, **extra: str) -> dict[str, str]:
    """Environment of a benchmark worker: one compute thread, no inherited launcher variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "MASTER_ADDR",
            "MASTER_PORT",
            "NODE_RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "GROUP_RANK",
            "RANK",
            "LOCAL_WORLD_SIZE",
            "GLOO_SOCKET_IFNAME",
        )
    }
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")])),
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def distributed_env(
    node_rank: int, world_size: int, master_addr: str, master_port: int, **extra: str
) -> dict[str, str]:
    """Lightning's multi-node variables for one process per node (``Trainer(num_nodes=W, devices=1)``)."""
    return worker_env(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        NODE_RANK=str(node_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK="0",
        **extra,
    )


def start(cmd: Sequence[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in its own process group, stdout and stderr to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    handle = open(log, "wb")  # noqa: SIM115  (closed by the child's exit; the parent keeps no reference)
    try:
        return subprocess.Popen(
            list(cmd), env=env, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )
    finally:
        handle.close()


def stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """End ``proc`` and its process group (only processes this script started)."""
    if proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def wait_all(
    procs: Sequence[subprocess.Popen[bytes]], timeout_s: float, grace_s: float = 10.0
) -> list[int | None]:
    """Wait for every process up to ``timeout_s`` in total; stop the ones still running (and on Ctrl-C).

    If one process fails, the others are given a short grace period and then stopped (a distributed
    peer would otherwise wait for it until the collective timeout). Returns the exit codes (``None``
    for a process that was stopped).
    """
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                return codes
            if any(c not in (None, 0) for c in codes):
                deadline = min(deadline, time.monotonic() + 10)
            time.sleep(0.2)
    finally:
        for p in procs:
            stop(p, grace_s)
    return [p.returncode if p.returncode is not None and p.returncode >= 0 else None for p in procs]


def run_command(
    cmd: Sequence[str], env: dict[str, str], log: Path, timeout_s: float, grace_s: float = 10.0
) -> tuple[int | None, float]:
    """Run one command (bounded by ``timeout_s``); returns (exit code or ``None`` if stopped, seconds).

    On timeout or Ctrl-C the command gets SIGTERM and ``grace_s`` seconds to clean up, then SIGKILL.
    """
    t0 = time.perf_counter()
    (code,) = wait_all([start(cmd, env, log)], timeout_s, grace_s)
    return code, time.perf_counter() - t0


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# -- strategies --------------------------------------------------------------------------------------
def make_strategy(name: str, density: float = DENSITY, timeout_s: float = 180.0) -> Any:
    """A Lightning strategy for 2+ processes on the CPU (gloo), by benchmark name.

    ``ddp``: stock DDP. ``powersgd``: lightning_dgc's PowerSGD (rank :data:`POWERSGD_RANK`, error
    feedback, warm start, compression from step :data:`POWERSGD_START_ITER`; the same updates as
    torch's ``powerSGD_hook``, which hangs on gloo with more than one bucket). ``dgc`` / ``deft``:
    lightning_dgc at ``density`` (``deft`` as ``configs/algo/deft.yaml``; ``deft_all`` with every rank
    selecting, ``selectors="all"``). ``dgc_dense``: ``dgc`` at density 1 (the exchange's overhead alone); ``dgc_auto``: ``density="auto"``;
    ``dgc_int8``, ``dgc_0.01``, ``dgc_0.01_int8``: ``dgc`` with int8 values, at density 0.01, both.
    """
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_dgc import CompressionStrategy, DEFTStrategy, DGCStrategy

    timeout = timedelta(seconds=timeout_s)
    common = {"process_group_backend": "gloo", "timeout": timeout}
    if name == "ddp":
        return DDPStrategy(**common)
    if name == "powersgd":
        options = {"matrix_approximation_rank": POWERSGD_RANK, "start_iter": POWERSGD_START_ITER}
        return CompressionStrategy("powersgd", options, **common)
    if name == "dgc":
        return DGCStrategy(density=density, **common)
    if name == "dgc_dense":
        return DGCStrategy(density=1.0, **common)
    if name in ("dgc_0.01", "dgc_0.01_int8", "dgc_int8"):  # the density and the values of configs/algo/dgc_adamw.yaml
        return DGCStrategy(density=0.01 if "0.01" in name else density,
                           value_dtype="int8" if name.endswith("int8") else "fp32", **common)  # fmt: skip
    if name == "dgc_auto":
        return DGCStrategy(density="auto", **common)
    if name == "diloco":  # configs/algo/diloco.yaml: H = 10, the dense outer exchange
        from lightning_dgc import DiLoCoStrategy

        return DiLoCoStrategy(sync_every=DILOCO_SYNC_EVERY, **common)
    if name == "deft":  # k by size, as configs/algo/deft.yaml
        return DEFTStrategy(density=density, k_allocation="size", budget="dgc_link", **common)
    if name == "deft_all":  # every rank selecting its share of every fragment (DEFTConfig.selectors="all")
        return DEFTStrategy(
            density=density, k_allocation="size", budget="dgc_link", selectors="all", **common
        )
    raise ValueError(
        f"unknown strategy {name!r}; expected one of ddp, powersgd, dgc, dgc_dense, deft, deft_all, diloco"
    )


# -- workloads -----------------------------------------------------------------------------------------
#: What each synthetic workload is, for the tables: model, input, per-process batch.
WORKLOADS: dict[str, dict[str, Any]] = {
    "resnet110": {"what": "ResNet-110 (CIFAR, option A), 32x32x3 images", "batch_size": 16},
    "resnet20": {"what": "ResNet-20 (CIFAR, option A), 32x32x3 images", "batch_size": 32},
    "lstm": {
        "what": "PTB LSTM, 2x200 units, tied 10k vocabulary (configs/ptb_lstm_cpu.yaml), BPTT 35",
        "batch_size": 20,
    },
}


def _repeated_batch_loader(batch: tuple[Any, ...], batches: int) -> Any:
    """A DataLoader whose every item is ``batch`` (already batched), ``batches`` items long.

    The same tensors every step: no data loading or augmentation in the timed region, and under a
    ``DistributedSampler`` each process simply gets ``batches / world_size`` of them.
    """
    from torch.utils.data import DataLoader, Dataset

    class Repeated(Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return batches

        def __getitem__(self, index: int) -> tuple[Any, ...]:
            return batch

    return DataLoader(Repeated(), batch_size=None, shuffle=False)


def build_workload(
    model: str, batch_size: int, batches: int, seed: int = 0
) -> tuple[Any, Any, dict[str, Any]]:
    """(LightningModule, train DataLoader, extra Trainer arguments) for a synthetic workload."""
    import torch

    g = torch.Generator().manual_seed(seed)
    if model in ("resnet20", "resnet110"):
        from lightning_dgc_recipes.vision import ImageClassifier

        module = ImageClassifier(arch=model, num_classes=10)
        images = torch.randn(batch_size, 3, 32, 32, generator=g)
        labels = torch.randint(0, 10, (batch_size,), generator=g)
        return module, _repeated_batch_loader((images, labels), batches), {}
    if model == "lstm":
        from lightning_dgc_recipes.language import WordLanguageModel

        class SpeedLanguageModel(WordLanguageModel):
            """The recipe's LSTM with plain SGD (its plateau scheduler needs a validation loop)."""

            def configure_optimizers(self) -> Any:
                return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

        module = SpeedLanguageModel(
            vocab_size=10_000, embedding_dim=200, hidden_size=200, num_layers=2, dropout=0.2, lr=20.0
        )
        tokens = torch.randint(0, 10_000, (batch_size, 36), generator=g)
        loader = _repeated_batch_loader((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()), batches)
        return module, loader, {"gradient_clip_val": 0.25}
    raise ValueError(f"unknown workload {model!r}; expected one of {sorted(WORKLOADS)}")


class StepTimer(L.Callback):
    """Wall time of every training batch, from ``on_train_batch_start`` to ``on_train_batch_end``.

    That span holds forward, backward (with DDP's overlapped exchange), the end of the exchange
    and the optimizer step: what a step costs, without data loading.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t0 = 0.0
        self.stats: list[dict[str, Any]] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.times.append(time.perf_counter() - self._t0)
        stats = getattr(trainer.strategy, "compression_stats", None)
        if callable(stats):
            self.stats.append(dict(stats()))


def train_steps(
    model: str,
    strategy: str,
    batch_size: int,
    warmup: int,
    steps: int,
    num_nodes: int = 1,
    seed: int = 0,
    density: float = DENSITY,
    count: bool = False,
) -> dict[str, Any]:
    """Run ``warmup + steps`` real training steps; returns the timed steps and what was exchanged.

    ``strategy="single"`` is one process without any exchange (``num_nodes`` must be 1); ``"compute"``, DDP whose
    buckets are handed back untouched (:func:`benchmarks.step_terms.no_exchange_strategy`); anything
    else is :func:`make_strategy` over ``num_nodes`` processes of one device each, connected through
    Lightning's environment variables (see :func:`distributed_env`). The step time is the median of the
    timed steps; DiLoCo's, whose steps differ within a round, the mean (``steps`` a multiple of its round).
    ``count``: after the timed steps, the collectives of one more step (DiLoCo: of a round) are counted
    (:class:`benchmarks.step_terms.CollectiveCount`, ``collectives_per_step``).
    """
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    L.seed_everything(seed, verbose=False)
    if strategy == "single":
        num_nodes = 1
    counter = None
    if count and strategy != "single":
        from benchmarks.step_terms import CollectiveCount

        counter = CollectiveCount(warmup + steps, DILOCO_SYNC_EVERY if strategy == "diloco" else 1)
    extra_steps = counter.span if counter else 0
    module, loader, extra = build_workload(model, batch_size, (warmup + steps + extra_steps) * num_nodes, seed)
    timer = StepTimer()
    callbacks: list[Any] = []
    if strategy == "single":
        # This process trains alone (in a 2-process launch, each process does, at the same time).
        strategy_obj: Any = "auto"
    elif strategy == "compute":  # DDP's step with its buckets handed back: everything but the exchange
        from benchmarks.step_terms import no_exchange_strategy

        strategy_obj, callback = no_exchange_strategy(process_group_backend="gloo", timeout=timedelta(seconds=180))
        callbacks.append(callback)
    else:
        strategy_obj = make_strategy(strategy, density=density)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=num_nodes,
        strategy=strategy_obj,
        max_steps=warmup + steps + extra_steps,
        max_epochs=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer, *callbacks, *([counter] if counter else [])],
        **extra,
    )
    t0 = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader)
    wall = time.perf_counter() - t0
    timed = timer.times[warmup : warmup + steps]
    numel = sum(p.numel() for p in module.parameters())
    result: dict[str, Any] = {
        "model": model,
        "strategy": strategy,
        "world_size": trainer.world_size,
        "batch_size": batch_size,
        "warmup_steps": warmup,
        "steps": len(timed),
        "step_times_s": timed,
        "step_time_s": statistics.fmean(timed) if strategy == "diloco" else median(timed),
        "fit_wall_s": wall,
        "parameters": numel,
        "dense_bytes": numel * 4,
        "hook_registered": getattr(trainer.strategy, "hook_calls", 0) > 0,
    }
    if counter is not None:
        result["collectives_per_step"] = counter.per_step
    if timer.stats and timer.stats[-1]:
        last = timer.stats[-1]
        result["bytes_sent"] = last.get("bytes_sent")
        result["compression_ratio"] = last.get("compression_ratio")
        result["selection_ms"] = median(
            [s["selection_ms"] for s in timer.stats[warmup:] if "selection_ms" in s]
        )
        result["compression_stats"] = {k: v for k, v in last.items() if isinstance(v, (int, float, bool))}
    elif strategy in ("ddp", "single"):
        result["bytes_sent"] = numel * 4 if strategy == "ddp" else 0
    return result


# -- parity ------------------------------------------------------------------------------------------------
class RunRecorder(L.Callback):
    """Write a recipe run's validation metrics and exchange counters to ``path`` (global rank 0).

    Added by :mod:`benchmarks.parity` to ``python -m lightning_dgc_recipes fit`` through a generated config, so the
    recipes need no hook of their own. After every validation (not the sanity check) the floats in
    ``trainer.callback_metrics`` are appended to ``history``; every optimizer step's
    ``compression_stats()`` (when the strategy has them) is summed, so the reported compression
    ratio is the run's total dense bytes / total bytes sent, warm-up included (DiLoCo's steps inside a round
    report 0 bytes, those that end one the outer exchange's, and the last outer step at the end of ``fit`` is
    counted at ``on_fit_end``).

    The training loss is averaged over every batch of an epoch and over the ranks (one all-reduce of a
    scalar at the end of each training epoch, on every rank): ``train_loss_epochs`` holds one value per
    epoch, far less noisy than a small test set's accuracy.

    When :data:`benchmarks.bf16_cpu.ENV` is set (by :mod:`benchmarks.parity`, for a bf16 task on a CPU
    without bf16 instructions), every process computes its bf16 matrix products as fp32 GEMMs of the bf16
    operands from ``setup`` to ``teardown`` (:class:`benchmarks.bf16_cpu.Fp32Bf16Matmul`), and the record
    says how many (``bf16_matmuls_as_fp32``, rank 0's count).

    Each ``history`` entry also holds the wall-clock seconds since the run's launch (``wall_s``: from
    :data:`LAUNCH_ENV`, the launcher's ``time.time()``, when set; else since ``fit`` started), the seconds spent
    validating so far (``val_s``) and the run's bytes so far (``bytes_sent``, ``link_bytes``: this rank's, from
    ``compression_stats()``); ``median_step_s`` is the median time of a training batch from the sixth on;
    ``compression["rank_selection_ms"]``, every rank's selection time over the epochs ended (one all-gather of 8 bytes
    a rank at each epoch's end).

    Args:
        path: JSON file to write (rewritten after every validation, so a stopped run keeps its last state).
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.history: list[dict[str, float]] = []
        self.train_loss_epochs: list[dict[str, float]] = []
        self._loss_sum: Any = 0.0  # a tensor on the loss's device once a batch ran (no host sync per step)
        self._loss_batches = 0
        self._params = 0
        self.totals = {"steps": 0, "bytes_sent": 0, "dense_bytes": 0, "link_bytes": 0.0, "selection_ms": 0.0}
        self.densities: list[float] = []
        self._last_step: Any = None
        self._t0 = time.perf_counter()
        self._bf16_matmul: Any = None
        self._launch = time.time()
        self._val_s = 0.0
        self._val_start = 0.0
        self._batch_start = 0.0
        self._step_times: list[float] = []
        self.auto: dict[str, Any] = {}
        #: every rank's selection time in each epoch (ms; gathered at the epoch's end): the slowest rank's is the
        #: one the others wait for (``compression_stats()`` gives this rank's only)
        self.rank_selection_ms: list[list[float]] = []
        self._selection_at_epoch_start = 0.0
        self._resumed_wall = (0.0, 0.0)  # seconds (since launch, training) before the checkpoint resumed from

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        from benchmarks import bf16_cpu

        self._bf16_matmul = bf16_cpu.from_environment()
        if self._bf16_matmul is not None:
            self._bf16_matmul.__enter__()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._bf16_matmul is not None:
            self._bf16_matmul.__exit__(None, None, None)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # a resumed run (load_state_dict ran before this hook) goes on counting from its seconds so far
        wall, train_wall = self._resumed_wall
        self._t0 = time.perf_counter() - train_wall
        self._launch = float(os.environ.get(LAUNCH_ENV, time.time())) - wall
        self._params = sum(p.numel() for p in pl_module.parameters())

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._loss_sum, self._loss_batches = 0.0, 0
        self._selection_at_epoch_start = self.totals["selection_ms"]

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        import torch

        local = float(self._loss_sum) / self._loss_batches if self._loss_batches else float("nan")
        mean = trainer.strategy.reduce(
            torch.tensor(local, dtype=torch.float64, device=trainer.strategy.root_device), reduce_op="mean"
        )
        self.train_loss_epochs.append({"epoch": trainer.current_epoch, "train_loss": float(mean)})
        if callable(getattr(trainer.strategy, "compression_stats", None)):  # alike on every rank: a collective
            mine = torch.tensor([self.totals["selection_ms"] - self._selection_at_epoch_start], dtype=torch.float64,
                                device=trainer.strategy.root_device)  # fmt: skip
            self.rank_selection_ms.append([float(v) for v in trainer.strategy.all_gather(mine).reshape(-1)])
        self._write(trainer)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._batch_start = time.perf_counter()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._val_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._step_times.append(time.perf_counter() - self._batch_start)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None:
            self._loss_sum = self._loss_sum + loss.detach().double()
            self._loss_batches += 1
        self._count(trainer)

    def _count(self, trainer: Any) -> None:
        """Add the strategy's ``compression_stats()`` of an optimizer step not counted yet; or, when the step was
        counted and an exchange ran since with no optimizer step (DiLoCo's last outer step at the end of ``fit``,
        a new ``outer_steps``), that exchange's bytes only."""
        stats_fn = getattr(trainer.strategy, "compression_stats", None)
        if not callable(stats_fn):
            return
        stats = stats_fn()
        key = (stats.get("step"), stats.get("outer_steps"))
        if not stats or key == self._last_step:
            return
        new_step = self._last_step is None or key[0] != self._last_step[0]
        self._last_step = key
        if new_step:
            self.totals["steps"] += 1
            self.totals["dense_bytes"] += int(stats["dense_bytes"])
        self.totals["bytes_sent"] += int(stats["bytes_sent"])
        self.totals["link_bytes"] += float(stats.get("link_bytes", 0.0))
        self.totals["selection_ms"] += float(stats.get("selection_ms", 0.0))
        if "auto_density" in stats:  # density="auto": what the link asked for, predicted and measured
            self.auto = {k: stats[k] for k in AUTO_STATS if k in stats}
        if not self.densities or self.densities[-1] != stats.get("density"):
            self.densities.append(float(stats.get("density", 1.0)))

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.sanity_checking:
            return
        self._val_s += time.perf_counter() - self._val_start
        metrics = {}
        for key, value in trainer.callback_metrics.items():
            try:
                metrics[key] = float(value)
            except (TypeError, ValueError):
                continue
        self.history.append({
            "epoch": trainer.current_epoch, "step": trainer.global_step, "wall_s": time.time() - self._launch,
            "val_s": self._val_s, "bytes_sent": self.totals["bytes_sent"], "link_bytes": self.totals["link_bytes"],
            **metrics,
        })  # fmt: skip
        self._write(trainer)

    def state_dict(self) -> dict[str, Any]:
        """What a run resumed from a checkpoint needs to write the same record as an uninterrupted one: the
        history, the byte totals and densities so far, the step times, and the seconds spent before this save
        (so ``wall_s``, ``val_s`` and ``train_wall_s`` count every start of the run)."""
        return {
            "history": self.history, "train_loss_epochs": self.train_loss_epochs, "totals": dict(self.totals),
            "densities": self.densities, "last_step": self._last_step, "val_s": self._val_s,
            "step_times": self._step_times, "auto": self.auto, "rank_selection_ms": self.rank_selection_ms,
            "wall_s": time.time() - self._launch, "train_wall_s": time.perf_counter() - self._t0,
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history, self.train_loss_epochs = list(state["history"]), list(state["train_loss_epochs"])
        self.totals, self.densities = dict(state["totals"]), list(state["densities"])
        last = state["last_step"]
        self._last_step = tuple(last) if last is not None else None
        self._val_s, self._step_times, self.auto = state["val_s"], list(state["step_times"]), dict(state["auto"])
        self.rank_selection_ms = [list(epoch) for epoch in state.get("rank_selection_ms", [])]  # none before
        self._resumed_wall = (float(state["wall_s"]), float(state["train_wall_s"]))

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._count(trainer)  # an exchange at the end of fit, after the last batch (DiLoCo's short last round)
        self._write(trainer, finished=True)

    def _write(self, trainer: Any, finished: bool = False) -> None:
        if not trainer.is_global_zero:
            return
        totals = dict(self.totals)
        if totals["bytes_sent"]:
            totals["compression_ratio"] = totals["dense_bytes"] / totals["bytes_sent"]
        if self.rank_selection_ms:  # every rank's over the epochs ended so far
            totals["rank_selection_ms"] = [sum(epoch) for epoch in zip(*self.rank_selection_ms, strict=True)]
        payload = {
            "finished": finished,
            "global_step": trainer.global_step,
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "train_wall_s": time.perf_counter() - self._t0,
            "final": self.history[-1] if self.history else {},
            "history": self.history,
            "train_loss_epochs": self.train_loss_epochs,
            "params": self._params,
            "compression": totals if totals["steps"] else None,
            "densities": self.densities,
            **({"auto": self.auto} if self.auto else {}),
            "median_step_s": median(self._step_times[5:]) if len(self._step_times) > 5 else None,
        }
        if self._bf16_matmul is not None:
            payload["bf16_matmuls_as_fp32"] = self._bf16_matmul.calls
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(self.path).with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, indent=2) + "\n")
        tmp.replace(self.path)


# -- worker entry ------------------------------------------------------------------------------------------
def worker_main(argv: Sequence[str] | None = None) -> int:
    """One benchmark process: run each strategy in turn (``--rounds`` times, interleaved), save JSON.

    ``python -m benchmarks.common --model resnet110 --strategies ddp,dgc --num-nodes 2 --out run.json``
    with Lightning's environment variables set (:func:`distributed_env`); every process writes
    ``<out stem>.rank<R>.json``. The process group is created by the first ``Trainer`` and reused by
    the following ones, so every strategy runs over the same connection.
    """
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.common", description=worker_main.__doc__)
    parser.add_argument("--model", required=True, choices=sorted(WORKLOADS))
    parser.add_argument(
        "--strategies", required=True, help="comma-separated: single, ddp, powersgd, dgc, deft, dgc_dense"
    )
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--once", default="", help="comma-separated strategies run once, after the rounds")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--density", type=float, default=DENSITY)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--count", action="store_true", help="count each strategy's collectives per step (round 0)")
    parser.add_argument("--latency", action="store_true",
                        help="after the runs, time a small all-reduce and all-gather on the process group")  # fmt: skip
    args = parser.parse_args(argv)

    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)

    rank = int(os.environ.get("NODE_RANK", "0"))
    runs: list[dict[str, Any]] = []
    schedule = [(r, s) for r in range(args.rounds) for s in args.strategies.split(",")]
    schedule += [(args.rounds, s) for s in args.once.split(",") if s]
    import torch.distributed as dist

    for round_index, strategy in schedule:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # start every run together (a "single" run too: both processes train at once)
        run = train_steps(
            args.model,
            strategy,
            args.batch_size,
            args.warmup,
            args.steps,
            args.num_nodes,
            density=args.density,
            count=args.count and round_index == 0,
        )
        run["round"] = round_index
        runs.append(run)
        print(
            f"rank {rank} round {round_index} {strategy}: median step {run['step_time_s']:.4f} s", flush=True
        )
    report: dict[str, Any] = {"rank": rank, "runs": runs}
    if args.latency and dist.is_available() and dist.is_initialized():
        from benchmarks.step_terms import collective_s

        report["latency_s"] = collective_s()
    out = args.out.with_name(f"{args.out.stem}.rank{rank}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=_json_default) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
