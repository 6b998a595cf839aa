"""A sharded transformer across a slow link: ``dgc_hsdp`` against native HSDP, step time and bytes.

    sudo .venv/bin/python -m benchmarks.sharded_links                    # 20 Mbit/s and 1 Gbit/s
    sudo .venv/bin/python -m benchmarks.sharded_links --rates 20 --steps 30

Two network namespaces joined by a veth shaped with ``tc`` (:class:`~benchmarks.netns.SlowLink`); each is a node of
2 processes (``Trainer(num_nodes=2, devices=2)``, ranks node by node), which talk to each other inside the
namespace and to the other node through the link. The model is the PTB transformer recipe's CPU size (2 blocks of
width 128, 1.7 M parameters, 1.3 M of them the embedding), AdamW as the recipe, windows of 35 random tokens, 20 a
process (the recipe's batch; the step time does not depend on the tokens). Per link rate, in turn:

* ``native_hsdp``: FSDP2 inside the node, FSDP2's own dense all-reduce across the nodes
  (:func:`benchmarks.sharded.native_hsdp_strategy`);
* ``dgc_hsdp``: ``algo/dgc_hsdp``'s exchange at its final density (0.01, int8 values; its warm-up's denser first
  tenth of a run is not timed here);
* ``auto_hsdp``: DGC with ``density="auto"`` (it measures the link in its first steps, then checks its choice).

The step time is the median of the steps after the first :data:`SKIP` (the auto density has decided and checked by
then), on this machine's shared cores (compare the strategies with each other). Besides, the bytes that left each
node through its end of the link per step (``tx_bytes`` of the veth), and ``compression_stats()``'s
``inter_node_bytes`` summed over the node's processes.

Targets: at 20 Mbit/s ``dgc_hsdp`` at least 3x faster than native HSDP; at 1 Gbit/s ``density="auto"`` at most 5%
slower. Writes ``benchmarks/results/sharded_links.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks import common, sharded
from benchmarks.netns import INTERFACES, SlowLink, missing_requirements

STRATEGIES = ("native_hsdp", "dgc_hsdp", "auto_hsdp")
SKIP = 12
TARGETS = {"20": ("dgc_hsdp", 3.0), "1000": ("auto_hsdp", 1.05)}


def make_strategy(name: str) -> Any:
    import lightning_dgc

    if name == "native_hsdp":
        return sharded.native_hsdp_strategy()
    if name == "auto_hsdp":
        return lightning_dgc.HSDPCompressionStrategy("dgc", density="auto", value_dtype="int8")
    return lightning_dgc.HSDPCompressionStrategy("dgc", density=0.01, value_dtype="int8")


def _tx_bytes(node: int) -> int:
    return int(Path(f"/sys/class/net/{INTERFACES[node]}/statistics/tx_bytes").read_text())


def worker(name: str, steps: int, out: Path) -> None:
    """One rank: ``steps`` steps of the transformer, each timed; local rank 0 of each node reads its link's bytes."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.tx: list[int] = []

        def on_train_batch_start(self, trainer: L.Trainer, *_: Any) -> None:
            self.start = time.perf_counter()
            if trainer.local_rank == 0:
                self.tx.append(_tx_bytes(trainer.node_rank))

        def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
            self.times.append(time.perf_counter() - self.start)

    timer = Timer()
    trainer = L.Trainer(
        accelerator="cpu", devices=sharded.PER_NODE, num_nodes=sharded.NODES, strategy=make_strategy(name),
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[timer],
    )  # fmt: skip
    model = sharded.transformer(128, 2)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 10_000, (20 * sharded.NODES * sharded.PER_NODE * steps, 36), generator=g)
    trainer.fit(model, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=20))
    if trainer.local_rank == 0:
        timer.tx.append(_tx_bytes(trainer.node_rank))
    stats = trainer.strategy.compression_stats() if hasattr(trainer.strategy, "compression_stats") else {}
    result = {"rank": trainer.global_rank, "node": trainer.node_rank, "times": timer.times, "tx": timer.tx,
              "inter_node_bytes": stats.get("inter_node_bytes"), "density": stats.get("density")}  # fmt: skip
    out.with_name(f"{out.name}.rank{trainer.global_rank}.json").write_text(json.dumps(result))


def summarize(rank_results: list[dict[str, Any]]) -> dict[str, Any]:
    """The median step after :data:`SKIP` (of the slowest rank's medians) and the bytes per node per step."""
    medians = [statistics.median(r["times"][SKIP:]) for r in rank_results]
    out: dict[str, Any] = {"step_s": max(medians), "rank_step_s": medians}
    tx = [r["tx"] for r in rank_results if r["tx"]]
    if tx:
        out["link_bytes_per_step"] = [(t[-1] - t[SKIP]) / (len(t) - 1 - SKIP) for t in tx]
    inter = [r["inter_node_bytes"] for r in rank_results if r["inter_node_bytes"] is not None]
    if inter:
        out["inter_node_bytes"] = sum(inter) / sharded.NODES  # per node, the last step
        out["density"] = rank_results[0]["density"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sharded_links", description=__doc__.split("\n")[0])
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rates", default="20,1000", help="Mbit/s, comma-separated")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.steps, args.out)
        return 0
    missing = missing_requirements()
    if missing is not None:
        raise SystemExit(f"benchmarks.sharded_links needs a shaped link: {missing}")
    folder = common.RESULTS / "logs" / "sharded_links"
    folder.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict[str, Any]] = {}
    con = common.console()
    with SlowLink() as link:
        for rate in args.rates.split(","):
            link.set_rate(float(rate))
            rows[rate] = {}
            for name in args.strategies.split(","):
                tag = f"{name}_{rate}"
                codes = sharded.launch("benchmarks.sharded_links", ["--worker", name, "--steps", str(args.steps),
                                       "--out", str(folder / tag)], folder, tag, timeout_s=1800, link=link)  # fmt: skip
                if any(code != 0 for code in codes):
                    raise RuntimeError(f"{tag} failed ({codes}):\n{common.tail(folder / f'{tag}.rank0.log', 40)}")
                results = [json.loads((folder / f"{tag}.rank{r}.json").read_text()) for r in range(4)]
                rows[rate][name] = summarize(results)
                con.print(f"{rate:>5} Mbit/s {name:12s} step {rows[rate][name]['step_s'] * 1e3:8.1f} ms")
    verdicts = {}
    for rate, (name, target) in TARGETS.items():
        if rate in rows and name in rows[rate] and "native_hsdp" in rows[rate]:
            native, ours = rows[rate]["native_hsdp"]["step_s"], rows[rate][name]["step_s"]
            ratio = native / ours if rate == "20" else ours / native
            met = ratio >= target if rate == "20" else ratio <= target
            verdicts[rate] = {"strategy": name, "ratio": ratio, "target": target, "met": met,
                              "reads": "native / ours (times faster)" if rate == "20" else "ours / native"}  # fmt: skip
            con.print(f"{rate} Mbit/s: {name} {verdicts[rate]['reads']} = {ratio:.2f} (target {target}):"
                      f" {'met' if met else 'missed'}")  # fmt: skip
    common.write_json("sharded_links.json", {"steps": args.steps, "skip": SKIP, "rows": rows, "targets": verdicts})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def sentence(record: dict[str, Any] | None = None) -> str:
    """The docs' sentence on step time across the shaped link, from ``results/sharded_links.json``."""
    record = record or json.loads((common.RESULTS / "sharded_links.json").read_text())
    rows, targets = record["rows"], record["targets"]
    slow, fast = rows["20"], rows["1000"]
    t20, t1000 = targets["20"], targets["1000"]

    def kb(row: dict[str, Any]) -> str:
        return f"{max(row['link_bytes_per_step']) / 1e3:,.0f} kB"

    return (
        f"at 20 Mbit/s a step takes {slow['native_hsdp']['step_s'] * 1e3:,.0f} ms under native HSDP and"
        f" {slow['dgc_hsdp']['step_s'] * 1e3:,.0f} ms under `dgc_hsdp`, {t20['ratio']:.1f}x faster (target at least"
        f" {t20['target']:g}x: {'met' if t20['met'] else 'missed'}), sending {kb(slow['dgc_hsdp'])} a step through a"
        f" node's end of the link against {kb(slow['native_hsdp'])}; at 1 Gbit/s `density=\"auto\"` chose"
        f" {fast['auto_hsdp']['density']:g} and took {t1000['ratio']:.2f}x native HSDP's time (target at most"
        f" {t1000['target']:g}x: {'met' if t1000['met'] else 'missed'})"
    )  # fmt: skip
