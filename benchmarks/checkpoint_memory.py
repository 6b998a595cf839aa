"""Host memory of ``trainer.save_checkpoint`` and of training, per rank, under ddp, dgc, deft, powersgd and diloco.

    python -m benchmarks.checkpoint_memory                      # the 33.7M-parameter MLP, 2 processes
    python -m benchmarks.checkpoint_memory --params 4e6 --strategies ddp,ddp_bucket_view,dgc
    python -m benchmarks.checkpoint_memory --strategies ddp,ddp_bucket_view,diloco,diloco_offload --record diloco_memory.json
    python -m benchmarks.checkpoint_memory --files 2,4,8 --params 4e6    # the files at 2, 4 and 8 processes

Each strategy runs in 2 fresh processes (gloo, one per "node", as torchrun starts them; on the CPU,
or with ``--accelerator cuda`` one GPU each): an MLP of about ``--params`` parameters trains a few
SGD(momentum) steps, then every rank calls ``trainer.save_checkpoint``. Reported, in *model sizes*
(the parameters' bytes):

* ``save peak``: the peak resident memory of the rank during ``save_checkpoint``, above what it held
  just before (Linux's ``VmHWM``, reset through ``/proc/self/clear_refs`` before the call; where that
  is not allowed, a thread samples the resident size every millisecond);
* ``training peak``: the peak resident memory from the start of ``fit`` to the end of the last
  training step above what the process held before it (model, gradients, DDP's buckets, optimizer
  state, the exchange's memory and its temporaries), and its excess over ddp's (``peak - ddp``): what
  the exchange costs; ``fit peak``: the same to the end of ``fit`` (DGC then hands its momentum back to
  SGD's buffers while it still holds its own);
* ``step peak``: the peak of the last training step alone (after DDP's one-off rebuild of its buckets at
  the start of the second step, which with ``gradient_as_bucket_view=True`` holds the first iteration's
  whole-model bucket and the new buckets at once: +1 model size in that forward, DDP's own; the
  compression strategies have DDP rebuild right after the first backward pass instead, before the
  optimizer's state exists);
* ``training``: the resident memory at the end of the last training step, likewise;
* two baselines: ``ddp`` is DDP as users run it (``strategy="ddp"``: ``.grad`` and DDP's buckets are two
  model-sized copies), ``ddp_bucket_view`` is DDP with ``gradient_as_bucket_view=True`` (one), as the
  compression strategies run DDP by default: ``- ddp`` is what a user switching from ``strategy="ddp"``
  sees, ``- ddp view`` what the exchange itself costs (like for like);
* on a GPU, ``cuda peak``: ``torch.cuda.max_memory_allocated()`` during ``fit`` (and its excess over
  ddp's) and during ``save_checkpoint``;
* the checkpoint file's size.

``diloco`` and ``diloco_offload`` are ``DiLoCoStrategy(sync_every=2)`` (an outer step in the default 3
steps) with ``offload`` off and on: on the CPU both keep the global weights and the outer momentum in
host memory, so only ``--accelerator cuda`` tells them apart (``cuda peak``). ``dgc_batched`` is DGC with the
selection a GPU runs (``selection_backend="torch"``, batched per bucket) on whatever device runs it: on the
CPU it shows that path's host memory without a GPU.

Targets: dgc's training peak at most 1.5 model sizes above ddp's (with SGD momentum), deft's and
powersgd's at most 1.0 (met against either baseline: against ``ddp_bucket_view`` is the strict reading); a save peak of at most ``2 x world_size`` model sizes on rank 0 and 0.1 on
every other rank.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import common

STRATEGIES = ("ddp", "ddp_bucket_view", "dgc", "dgc_batched", "deft", "powersgd", "diloco", "diloco_offload")
#: DiLoCo's outer step every this many optimizer steps here, so that the default 3 steps hold one.
DILOCO_SYNC_EVERY = 2
#: The baselines: DDP as ``strategy="ddp"`` runs it, and with ``gradient_as_bucket_view=True``.
BASELINES = {"ddp": "ddp", "ddp view": "ddp_bucket_view"}
WORLD = 2


def _make_strategy(name: str) -> Any:
    """The benchmark's strategies: :func:`benchmarks.common.make_strategy`'s, plus ``ddp_bucket_view``,
    ``dgc_batched`` (DGC with the device's batched selection, ``selection_backend="torch"``, wherever it runs)
    and DiLoCo's two (the global weights and the outer momentum on the model's device, or in host memory)."""
    from datetime import timedelta

    timeout = timedelta(seconds=180)
    if name == "ddp_bucket_view":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy(process_group_backend="gloo", timeout=timeout, gradient_as_bucket_view=True)
    if name == "dgc_batched":
        from lightning_dgc import DGCStrategy

        return DGCStrategy(density=0.01, selection_backend="torch", process_group_backend="gloo", timeout=timeout)
    if name in ("diloco", "diloco_offload"):
        from lightning_dgc import DiLoCoStrategy

        return DiLoCoStrategy(
            sync_every=DILOCO_SYNC_EVERY, offload=name == "diloco_offload", process_group_backend="gloo",
            timeout=timeout,
        )  # fmt: skip
    return common.make_strategy(name, density=0.01)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_resident_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


class PeakMemory:
    """The peak resident size while the ``with`` block runs (``peak``, bytes); :meth:`restart` opens a
    window inside it (:meth:`since_restart`) without losing the block's peak."""

    def __enter__(self) -> PeakMemory:
        self.peak = 0
        self._window = 0  # the sampler's peak since the last (re)start
        self._earlier = 0  # the peak before the last restart
        self._stop = threading.Event()
        try:
            self._clear()
            self._sampler = None
        except OSError:
            self._sampler = threading.Thread(target=self._sample, daemon=True)
            self._sampler.start()
        return self

    @staticmethod
    def _clear() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._window = max(self._window, _resident_bytes())
            time.sleep(0.001)

    def since_restart(self) -> int:
        """The peak resident size since the block started or was last restarted (bytes)."""
        if self._sampler is None:
            return _peak_resident_bytes()
        return max(self._window, _resident_bytes())

    def so_far(self) -> int:
        """The peak resident size since the block started (bytes)."""
        return max(self._earlier, self.since_restart())

    def restart(self) -> None:
        """Start a new window for :meth:`since_restart`; :meth:`so_far` and ``peak`` still cover the block."""
        self._earlier = self.so_far()
        if self._sampler is None:
            self._clear()
        else:
            self._window = 0

    def __exit__(self, *exc: object) -> None:
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
        self.peak = self.so_far()


def _mlp(params: float) -> Any:
    """Three square layers (with biases) of about ``params`` parameters in all."""
    from torch import nn

    width = max(8, int(math.sqrt(params / 3)))
    return nn.Sequential(
        nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width)
    )


def memory_accounts(params: float, world: int = WORLD, density: float = 0.01) -> dict[str, Any]:
    """:func:`~lightning_dgc.exchange.memory_account.memory_account` of DGC and DEFT for this benchmark's MLP (SGD
    with momentum; DDP's buckets after its first step; the batched path, a GPU's), rows and totals in model sizes."""
    import torch

    from benchmarks.selection import ddp_buckets
    from benchmarks.shapes import ParamShape
    from lightning_dgc.algorithms.deft_config import DEFTConfig
    from lightning_dgc.algorithms.dgc import DGCConfig
    from lightning_dgc.exchange.memory_account import memory_account

    with torch.device("meta"):
        net = _mlp(params)
    names = [name for name, _ in net.named_parameters()]
    shapes = [ParamShape(n, tuple(p.shape)) for n, p in zip(names, net.parameters(), strict=True)]
    tensors = [(p.numel(), p.dim()) for p in net.parameters()]
    buckets = ddp_buckets(shapes, 25)
    dgc = memory_account(DGCConfig(density=density), tensors, buckets, world).as_dict()
    # DGC takes SGD's momentum over (DDP holds it too); DEFT's default leaves the optimizer's momentum alone
    dgc["over_ddp_model_sizes"] = dgc["total_model_sizes"] - next(
        r["model_sizes"] for r in dgc["rows"] if r["name"] == "momentum"
    )  # fmt: skip
    deft = memory_account(DEFTConfig(density=density), tensors, buckets, world, momentum=False).as_dict()
    deft["over_ddp_model_sizes"] = deft["total_model_sizes"]
    return {"dgc": dgc, "deft": deft}


def worker(strategy_name: str, params: float, steps: int, out: Path, accelerator: str = "cpu") -> None:
    """One rank: train, then save a checkpoint; write this rank's figures as JSON."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    rank = int(os.environ.get("NODE_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", str(WORLD)))
    cuda = accelerator == "cuda"
    baseline = _resident_bytes()
    net = _mlp(params)
    width = net[0].in_features

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)

    class LastStep(L.Callback):
        resident = 0
        peak = 0
        step_peak = 0  # the last step's own peak (DDP rebuilds its buckets in the second step's forward)
        monitor: PeakMemory | None = None

        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            if self.monitor is not None and trainer.global_step == steps - 1:
                self.monitor.restart()

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            self.resident = _resident_bytes()
            if self.monitor is not None:
                self.peak = self.monitor.so_far()
                self.step_peak = self.monitor.since_restart()

    last = LastStep()
    model_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    trainer = L.Trainer(
        strategy=_make_strategy(strategy_name), accelerator=accelerator, devices=1,
        num_nodes=world, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[last],
    )  # fmt: skip
    data = DataLoader(TensorDataset(torch.randn(8 * steps, width)), batch_size=4)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with PeakMemory() as training:
        last.monitor = training
        trainer.fit(Module(), data)
    cuda_training = torch.cuda.max_memory_allocated() if cuda else None
    path = out.with_name(f"{out.stem}.ckpt")
    before = _resident_bytes()
    if cuda:
        cuda_before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    trainer.strategy.barrier()
    with PeakMemory() as peak:
        started = time.perf_counter()
        trainer.save_checkpoint(path)  # ends with a barrier: every rank's file is written
        save_seconds = time.perf_counter() - started
    rank_files = sorted(Path(f"{path}.exchange").glob(f"rank-{rank:05d}.*.pt"))
    result = {
        "strategy": strategy_name,
        "rank": rank,
        "params": sum(p.numel() for p in net.parameters()),
        "model_bytes": model_bytes,
        "save_peak_model_sizes": (peak.peak - before) / model_bytes,
        "training_model_sizes": (last.resident - baseline) / model_bytes,
        "training_peak_model_sizes": (last.peak - baseline) / model_bytes,
        "last_step_peak_model_sizes": (last.step_peak - baseline) / model_bytes,
        "fit_peak_model_sizes": (training.peak - baseline) / model_bytes,
        "cuda_training_peak_model_sizes": cuda_training / model_bytes if cuda_training is not None else None,
        "cuda_save_peak_model_sizes": (
            (torch.cuda.max_memory_allocated() - cuda_before) / model_bytes if cuda else None
        ),
        "checkpoint_bytes": path.stat().st_size if rank == 0 else None,
        "rank_file_bytes": rank_files[0].stat().st_size if rank_files else None,
        "save_seconds": save_seconds,
        "world_size": world,
    }
    out.with_name(f"{out.stem}.rank{rank}.json").write_text(json.dumps(result))
    trainer.strategy.barrier()
    if rank == 0:
        trainer.strategy.remove_checkpoint(path)


def measure(
    strategy: str, params: float, steps: int, folder: Path, timeout_s: float = 900, accelerator: str = "cpu",
    world: int = WORLD,
) -> list[dict[str, Any]]:
    """Run ``strategy`` on ``world`` fresh processes; every rank's figures."""
    port = common.free_port()
    out = folder / f"{strategy}.n{world}"
    procs = [
        common.start(
            [
                common.python(),
                "-m",
                "benchmarks.checkpoint_memory",
                "--worker",
                strategy,
                "--params",
                str(params),
                "--steps",
                str(steps),
                "--out",
                str(out),
                "--accelerator",
                accelerator,
            ],
            common.distributed_env(
                rank, world, "127.0.0.1", port, **({"CUDA_VISIBLE_DEVICES": str(rank)} if accelerator == "cuda" else {})
            ),
            folder / f"{strategy}.n{world}.rank{rank}.log",
        )  # fmt: skip
        for rank in range(world)
    ]
    codes = common.wait_all(procs, timeout_s)
    if any(code != 0 for code in codes):
        raise RuntimeError(
            f"{strategy} failed ({codes}):\n{common.tail(folder / f'{strategy}.n{world}.rank0.log', 40)}"
        )
    return [json.loads(out.with_name(f"{out.stem}.rank{r}.json").read_text()) for r in range(world)]


FILES_STRATEGIES = ("ddp", "dgc", "deft", "powersgd")


def measure_files(params: float, steps: int, worlds: list[int], strategies: list[str], record: str) -> int:
    """The checkpoint's files at every world size: rank 0's file, each rank's file, the save's time and rank 0's
    peak memory during the save; written to ``record``."""
    folder = common.RESULTS / "logs" / "checkpoint_files"
    folder.mkdir(parents=True, exist_ok=True)
    rows, table = [], []
    for world in worlds:
        for name in strategies:
            ranks = measure(name, params, steps, folder, world=world)
            rank0 = ranks[0]
            files = [r["rank_file_bytes"] for r in ranks]
            row = {
                "world_size": world, "strategy": name, "model_bytes": rank0["model_bytes"], "params": rank0["params"],
                "checkpoint_bytes": rank0["checkpoint_bytes"], "rank_file_bytes": files,
                "save_seconds": rank0["save_seconds"], "save_peak_model_sizes": rank0["save_peak_model_sizes"],
                "other_ranks_save_peak_model_sizes": max((r["save_peak_model_sizes"] for r in ranks[1:]), default=0),
            }  # fmt: skip
            rows.append(row)
            table.append([world, name, row["checkpoint_bytes"] / 1e6, (max(files) / 1e6) if files[0] else None,
                          row["save_seconds"], row["save_peak_model_sizes"]])  # fmt: skip
    common.print_table(
        f"Checkpoint files, MLP of {rows[0]['params'] / 1e6:.1f}M parameters",
        ["N", "strategy", "rank 0's file MB", "rank file MB", "save s", "save peak, rank 0"], table,
        caption="rank file: the largest of the ranks' exchange-state files; save s: trainer.save_checkpoint on rank"
        " 0 (to the barrier at its end); save peak: rank 0's resident memory during the save, in model sizes",
    )  # fmt: skip
    common.write_json(record, {"params": rows[0]["params"], "steps": steps, "rows": rows})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.checkpoint_memory", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--params", type=float, default=33.7e6, help="parameters of the MLP")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--accelerator", choices=("auto", "cpu", "cuda"), default="cpu",
        help="cpu (default), cuda (one GPU per rank: reports CUDA peak memory too), auto: cuda when there"
        " is a GPU per rank",
    )  # fmt: skip
    parser.add_argument(
        "--files", default=None, metavar="N,N,...",
        help="measure the checkpoint's files at these world sizes (e.g. 2,4,8) instead, into checkpoint_files.json",
    )  # fmt: skip
    parser.add_argument(
        "--record", default=None,
        help="result file under benchmarks/results (default checkpoint_memory.json; with --files checkpoint_files.json)",
    )  # fmt: skip
    parser.add_argument("--worker", choices=STRATEGIES, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    accelerator = args.accelerator
    if accelerator == "auto":
        import torch

        accelerator = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= WORLD else "cpu"
    if args.worker:
        worker(args.worker, args.params, args.steps, args.out, accelerator)
        return 0
    if args.files:
        strategies = args.strategies.split(",") if args.strategies != ",".join(STRATEGIES) else list(FILES_STRATEGIES)
        record = args.record or "checkpoint_files.json"
        return measure_files(args.params, args.steps, [int(n) for n in args.files.split(",")], strategies, record)

    folder = common.RESULTS / "logs" / "checkpoint_memory"
    folder.mkdir(parents=True, exist_ok=True)
    runs = {
        name: measure(name, args.params, args.steps, folder, accelerator=accelerator)
        for name in args.strategies.split(",")
    }

    def over(r: dict[str, Any], key: str, baseline: str) -> float | None:
        base = runs.get(baseline)
        if base is None or r.get(key) is None or base[r["rank"]].get(key) is None:
            return None
        return r[key] - base[r["rank"]][key]

    figures = {"training_peak_model_sizes": "peak", "last_step_peak_model_sizes": "step peak",
               "training_model_sizes": "training"}  # fmt: skip
    if accelerator == "cuda":
        figures["cuda_training_peak_model_sizes"] = "cuda peak"
    for ranks in runs.values():  # the excess over each baseline, in the JSON too
        for r in ranks:
            r["over"] = {
                f"{label} - {short}": over(r, key, baseline)
                for key, label in figures.items()
                for short, baseline in BASELINES.items()
            }
    columns = ["strategy", "rank", "save peak", "training peak", "peak - ddp", "peak - ddp view", "step peak",
               "step peak - ddp view", "fit peak", "training", "training - ddp", "training - ddp view"]  # fmt: skip
    if accelerator == "cuda":
        columns += ["cuda peak", "cuda peak - ddp", "cuda peak - ddp view", "cuda save peak"]
    rows = []
    for name, ranks in runs.items():
        for r in ranks:
            excess = r["over"]
            row = [name, r["rank"], r["save_peak_model_sizes"], r["training_peak_model_sizes"],
                   excess["peak - ddp"], excess["peak - ddp view"], r["last_step_peak_model_sizes"],
                   excess["step peak - ddp view"], r.get("fit_peak_model_sizes"),
                   r["training_model_sizes"], excess["training - ddp"], excess["training - ddp view"]]  # fmt: skip
            if accelerator == "cuda":
                row += [r["cuda_training_peak_model_sizes"], excess["cuda peak - ddp"],
                        excess["cuda peak - ddp view"], r["cuda_save_peak_model_sizes"]]  # fmt: skip
            rows.append(row + [r["checkpoint_bytes"] / 1e6 if r["checkpoint_bytes"] else None])
    params_m = runs[next(iter(runs))][0]["params"] / 1e6
    where = "GPU" if accelerator == "cuda" else "host"
    common.print_table(
        f"Memory per rank ({where}), {WORLD} processes, MLP of {params_m:.1f}M parameters (in model sizes)",
        columns + ["checkpoint MB"],
        rows,
        caption="save peak: resident memory during trainer.save_checkpoint above what the rank held before it;"
        " training peak: during fit, above what the process held before it (with bucket views it holds DDP's"
        " one-off bucket rebuild in the second step's forward: +1; the compression strategies rebuild after"
        " the first backward, before SGD's momentum exists); step peak: during the last step only;"
        " - ddp: above strategy='ddp'"
        " (Lightning's default, .grad apart from DDP's buckets); - ddp view: above DDP with"
        " gradient_as_bucket_view=True (like for like: the compression strategies' default)",
    )
    common.write_json(
        args.record or "checkpoint_memory.json",
        {"world_size": WORLD, "params": params_m * 1e6, "accelerator": accelerator, "baselines": BASELINES,
         "runs": runs},  # fmt: skip
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
