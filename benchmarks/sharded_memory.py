"""Memory per process of a sharded model (``dgc_hsdp``) against the replicated one (``dgc``), 2 nodes x 2 processes.

    python -m benchmarks.sharded_memory [--d-model 256 --layers 4 --steps 4]

Every strategy runs in 4 fresh processes on this machine (nodes of 2, ranks node by node, gloo): the PTB
transformer recipe's model (``benchmarks.sharded.transformer``: 50 M parameters at the defaults, 7.7 M of them
the embedding) trains a few AdamW steps on random tokens, 2 windows of 16 a step (the model's memory dominates). Per process:

* ``exchange state``: the bytes the exchange's memory holds at the end of the last step, its residuals and their
  scratch (``ResidualMemory.nbytes``);
* ``training peak``: the peak resident memory from the start of ``fit`` to the end of the last step above what the
  process held before it builds the model (Linux's ``VmHWM``, reset before ``fit``), in model sizes; glibc serves
  every allocation of 128 kB or more with a mapping of its own, so that the resident size follows the live tensors
  (the record's ``trace`` has the resident size and the peak after each phase of each step).

For ``diloco`` and ``diloco_hsdp`` (an outer step every 2 steps) the ``exchange state`` is the state DiLoCo keeps
across outer steps: the global weights, the outer momentum and the outer exchange's memory.

Strategies: ``dgc`` (the replicated model, one flat exchange over the 4 processes: ``hierarchical=False``),
``dgc_two_level`` (the replicated model, dense inside the node and DGC across it on each process's 1/2 of every
bucket: ``hierarchical="auto"``, the default on 2 x 2), ``dgc_hsdp`` (``algo/dgc_hsdp``'s exchange) and the two
baselines, ``ddp`` and native HSDP; DGC at ``algo/dgc_hsdp``'s settings (density 0.01, int8 values) throughout.

Targets at G = 2 processes per node: ``dgc_hsdp``'s exchange state at most 0.55x ``dgc``'s, its training peak at
most 0.65x; ``diloco_hsdp``'s outer state at most 0.55x ``diloco``'s. Writes ``benchmarks/results/sharded_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from benchmarks import common, sharded
from benchmarks.checkpoint_memory import PeakMemory, _resident_bytes

STRATEGIES = ("ddp", "native_hsdp", "dgc", "dgc_two_level", "dgc_hsdp", "diloco", "diloco_hsdp")
DGC = {"density": 0.01, "value_dtype": "int8"}
TARGETS = {"exchange_state": 0.55, "training_peak": 0.65}
#: ``diloco_hsdp``'s outer state (global weights, outer momentum, outer exchange memory) against ``diloco``'s
DILOCO_TARGET = 0.55
#: glibc's malloc serves every allocation of 128 kB or more with its own mapping, returned at once when freed (its
#: threshold otherwise rises as blocks are freed, and freed tensors stay in the heap): the resident size then follows
#: the live tensors, not the allocator's history
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def make_strategy(name: str) -> Any:
    import lightning_dgc

    if name == "native_hsdp":
        return sharded.native_hsdp_strategy()
    if name == "dgc_hsdp":
        return lightning_dgc.HSDPCompressionStrategy("dgc", dict(DGC))
    if name in ("dgc", "dgc_two_level"):
        return lightning_dgc.DGCStrategy(**DGC, hierarchical="auto" if name == "dgc_two_level" else False)
    if name == "diloco":  # an outer step every 2 steps (the shipped 10 would take none in a short run)
        return lightning_dgc.DiLoCoStrategy(sync_every=2)
    if name == "diloco_hsdp":
        return lightning_dgc.HSDPDiLoCoStrategy(sync_every=2)
    return name


def worker(name: str, out: Path, d_model: int, layers: int, steps: int) -> None:
    """One rank: build the model, train ``steps`` steps, write this rank's figures."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)  # every process initialises alike (native HSDP does not align its replicas)
    baseline = _resident_bytes()
    model = sharded.transformer(d_model, layers)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    class Peak(L.Callback):
        """The peak so far at the end of each step, and the resident size and peak at each phase (``trace``)."""

        peak = 0
        trace: list[tuple[str, float, float]] = []

        def _mark(self, phase: str) -> None:
            self.trace.append((phase, (_resident_bytes() - baseline) / model_bytes,
                               (self.monitor.so_far() - baseline) / model_bytes))  # fmt: skip

        def on_train_start(self, *args: Any) -> None:
            self._mark("set up")

        def on_before_backward(self, *args: Any) -> None:
            self._mark("forward")

        def on_after_backward(self, *args: Any) -> None:
            self._mark("backward")

        def on_train_batch_end(self, *args: Any) -> None:
            self.peak = self.monitor.so_far()
            self._mark("step")

    peak = Peak()
    trainer = L.Trainer(
        accelerator="cpu", devices=sharded.PER_NODE, num_nodes=sharded.NODES, strategy=make_strategy(name),
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[peak],
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 10_000, (8 * steps, 17), generator=g)
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)  # small: the model dominates
    with PeakMemory() as monitor:
        peak.monitor = monitor
        trainer.fit(model, data)
    state, outer = getattr(trainer.strategy, "_state", None), getattr(trainer.strategy, "_outer", None)
    if outer is not None:  # DiLoCo's: the state it keeps across outer steps
        from lightning_dgc.local_steps.sharded import outer_state_bytes

        exchange = outer_state_bytes(outer)
    else:
        exchange = state.memory.nbytes() if state is not None else 0
    result = {
        "strategy": name, "rank": trainer.global_rank, "model_bytes": model_bytes,
        "params": sum(p.numel() for p in model.parameters()),
        "exchange_state_bytes": exchange,
        "training_peak_bytes": peak.peak - baseline, "trace": peak.trace,
    }  # fmt: skip
    out.with_name(f"{out.name}.rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sharded_memory", description=__doc__.split("\n")[0])
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.out, args.d_model, args.layers, args.steps)
        return 0
    folder = common.RESULTS / "logs" / "sharded_memory"
    folder.mkdir(parents=True, exist_ok=True)
    ranks: dict[str, list[dict[str, Any]]] = {}
    for name in args.strategies.split(","):
        worker_args = ["benchmarks.sharded_memory", "--worker", name, "--out", str(folder / name),
                       "--d-model", str(args.d_model), "--layers", str(args.layers), "--steps", str(args.steps)]
        codes = sharded.launch(worker_args[0], worker_args[1:], folder, name, timeout_s=900, **MALLOC)
        if any(code != 0 for code in codes):
            raise RuntimeError(f"{name} failed ({codes}):\n{common.tail(folder / f'{name}.rank0.log', 40)}")
        ranks[name] = [json.loads((folder / f"{name}.rank{r}.json").read_text()) for r in range(4)]
    summary = summarize(ranks)
    con = common.console()
    for name, row in summary["strategies"].items():
        con.print(f"{name:14s} exchange state {row['exchange_state_model_sizes']:5.2f} model sizes, training peak"
                  f" {row['training_peak_model_sizes']:5.2f} (the largest process's)")  # fmt: skip
    if summary["diloco_state"]:
        v = summary["diloco_state"]
        con.print(f"diloco_hsdp / diloco, outer state: {v['ratio']:.3f} (target <= {v['target']}):"
                  f" {'met' if v['met'] else 'missed'}")  # fmt: skip
    for figure, verdict in summary["against_dgc"].items():
        con.print(f"dgc_hsdp / dgc, {figure}: {verdict['ratio']:.3f} (target <= {verdict['target']}):"
                  f" {'met' if verdict['met'] else 'missed'}")  # fmt: skip
    common.write_json("sharded_memory.json", {"d_model": args.d_model, "layers": args.layers, "steps": args.steps,
                                              "dgc": DGC, **summary, "ranks": ranks})  # fmt: skip
    return 0


def summarize(ranks: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per strategy, the largest process's figures in model sizes; ``dgc_hsdp``'s against ``dgc``'s, each target."""
    rows = {}
    for name, per_rank in ranks.items():
        model = per_rank[0]["model_bytes"]
        rows[name] = {
            "exchange_state_bytes": max(r["exchange_state_bytes"] for r in per_rank),
            "training_peak_bytes": max(r["training_peak_bytes"] for r in per_rank),
            "exchange_state_model_sizes": max(r["exchange_state_bytes"] for r in per_rank) / model,
            "training_peak_model_sizes": max(r["training_peak_bytes"] for r in per_rank) / model,
        }
    against = {}
    if "dgc" in rows and "dgc_hsdp" in rows:
        for figure, target in TARGETS.items():
            ratio = rows["dgc_hsdp"][f"{figure}_bytes"] / rows["dgc"][f"{figure}_bytes"]
            against[figure] = {"ratio": ratio, "target": target, "met": ratio <= target}
    diloco = {}
    if "diloco" in rows and "diloco_hsdp" in rows:
        ratio = rows["diloco_hsdp"]["exchange_state_bytes"] / rows["diloco"]["exchange_state_bytes"]
        diloco = {"ratio": ratio, "target": DILOCO_TARGET, "met": ratio <= DILOCO_TARGET}
    return {"strategies": rows, "against_dgc": against, "diloco_state": diloco}


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    raise SystemExit(main())


def sentence(record: dict[str, Any] | None = None) -> str:
    """The docs' sentence on memory per process, from ``results/sharded_memory.json``."""
    record = record or json.loads((common.RESULTS / "sharded_memory.json").read_text())
    rows, against = record["strategies"], record["against_dgc"]

    def verdict(figure: str) -> str:
        v = against[figure]
        return f"{v['ratio']:.2f}x; target at most {v['target']}x: {'met' if v['met'] else 'missed'}"

    diloco = ""
    if record.get("diloco_state"):
        v = record["diloco_state"]
        diloco = (f"; the state DiLoCo keeps across outer steps (global weights, outer momentum, outer exchange memory)"
                  f" is {rows['diloco_hsdp']['exchange_state_model_sizes']:.2f} model sizes under `diloco_hsdp` against"
                  f" {rows['diloco']['exchange_state_model_sizes']:.2f} under `diloco` ({v['ratio']:.2f}x; target at most"
                  f" {v['target']}x: {'met' if v['met'] else 'missed'})")  # fmt: skip
    return (
        f"each process's exchange state is {rows['dgc_hsdp']['exchange_state_model_sizes']:.2f} model sizes under"
        f" `dgc_hsdp` against {rows['dgc']['exchange_state_model_sizes']:.2f} under `dgc` ({verdict('exchange_state')}),"
        f" and its training peak {rows['dgc_hsdp']['training_peak_model_sizes']:.2f} model sizes against"
        f" {rows['dgc']['training_peak_model_sizes']:.2f} ({verdict('training_peak')}); native HSDP's peak is"
        f" {rows['native_hsdp']['training_peak_model_sizes']:.2f} and DDP's {rows['ddp']['training_peak_model_sizes']:.2f}"
        + diloco
    )  # fmt: skip
