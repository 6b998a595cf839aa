"""Two nodes of two processes joined by a slow link: flat against two-level exchanges, bytes and step time.

    sudo .venv/bin/python -m benchmarks.two_level_links                 # 100 Mbit/s
    sudo .venv/bin/python -m benchmarks.two_level_links --bandwidths 100,1000

Setup as :mod:`benchmarks.slow_links` (root, ``ip`` and ``tc``): two network namespaces joined by a veth
pair shaped with ``tc tbf``. Each namespace is a node: one ``torchrun`` agent starts 2 processes there
(``--nnodes 2 --nproc-per-node 2 --node-rank i``), which talk to each other on the node's own addresses
(the kernel keeps that traffic inside the namespace) and to the other node through the veth (gloo bound
to it with ``GLOO_SOCKET_IFNAME``). Every process runs, in turn, every strategy on an MLP of about 2 M
parameters with ``Trainer(num_nodes=2, devices=2)``: ``ddp``, ``dgc`` (flat, ``hierarchical=False``),
``dgc_node`` (two-level), ``deft`` / ``deft_node`` and ``powersgd`` / ``powersgd_node``. Per strategy, local
rank 0 of each node reads the bytes its end of the veth sent (``/sys/class/net/<veth>/statistics/tx_bytes``)
around the timed steps: the bytes that left the node per step, next to what ``compression_stats()``
says the node's ranks sent across nodes (``inter_node_bytes``, summed over the node's ranks). The step time
is the median of the timed steps (this machine's cores are shared by all four processes: compare the
strategies with each other, not with a real cluster). Beside each, the performance model's step for the
setup (:func:`predict_steps`), from the compute measured with the four processes at once and the local
bus measured with an all-reduce inside a node.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.netns import ADDRESSES, INTERFACES, SlowLink, missing_requirements

STRATEGIES = ("ddp", "dgc", "dgc_node", "deft", "deft_node", "powersgd", "powersgd_node")
MASTER_PORT = 29527


# -- one process -------------------------------------------------------------------------------------------
def _mlp_module() -> Any:
    import lightning as L
    import torch
    from torch import nn

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(),
                                     nn.Linear(1024, 256))  # fmt: skip

        def training_step(self, batch: Any, _: int) -> Any:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    return MLP


def _shared_compute_and_local_bus(steps: int) -> dict[str, float]:
    """All four processes at once: the median step without any exchange (forward, backward, SGD), and the
    seconds of a dense all-reduce of the gradient between the two processes of a node (the local bus)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    model = _mlp_module()().net
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(32, 256), torch.randn(32, 256)
    times = []
    dist.barrier()
    for _ in range(steps + 2):
        start = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    groups = [dist.new_group([2 * n, 2 * n + 1]) for n in range(2)]
    mine = groups[dist.get_rank() // 2]
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    bus = []
    dist.barrier()
    for _ in range(steps):
        start = time.perf_counter()
        dist.all_reduce(flat, group=mine)
        bus.append(time.perf_counter() - start)
    return {"compute_s": statistics.median(times[2:]), "local_allreduce_s": statistics.median(bus),
            "gradient_bytes": flat.numel() * 4}  # fmt: skip

def _strategy(name: str, density: float) -> Any:
    import lightning_dgc

    if name == "ddp":
        return "ddp"
    algorithm, _, level = name.partition("_")
    options: dict[str, Any] = {"density": density} if algorithm != "powersgd" else {
        "matrix_approximation_rank": 4, "start_iter": 2}  # fmt: skip
    return lightning_dgc.CompressionStrategy(algorithm, options, hierarchical=level == "node")


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    interface = INTERFACES[int(os.environ["GROUP_RANK"])]  # torchrun's node rank
    counter = Path(f"/sys/class/net/{interface}/statistics/tx_bytes")

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.tx: list[int] = []

        def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
            if trainer.global_step == args.warmup:
                torch.distributed.barrier()
                self.tx.append(int(counter.read_text()))
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            if trainer.global_step > args.warmup:
                self.times.append(time.perf_counter() - self.start)
            if trainer.global_step == args.warmup + args.steps:
                torch.distributed.barrier()
                self.tx.append(int(counter.read_text()))

    MLP = _mlp_module()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 256, generator=g), torch.randn(4096, 256, generator=g))
    report: dict[str, Any] = {}
    for name in args.strategies.split(","):
        L.seed_everything(0, verbose=False)
        timer = Timer()
        trainer = L.Trainer(
            accelerator="cpu", devices=2, num_nodes=2, strategy=_strategy(name, args.density),
            max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
        )  # fmt: skip
        trainer.fit(MLP(), DataLoader(data, batch_size=32))
        stats = trainer.strategy.compression_stats() if name != "ddp" else {}
        report[name] = {
            "step_s": statistics.median(timer.times),
            "tx_bytes_per_step": (timer.tx[1] - timer.tx[0]) / args.steps if len(timer.tx) == 2 else None,
            "inter_node_bytes": stats.get("inter_node_bytes"),
            "link_bytes": stats.get("link_bytes"),
            "hierarchical": getattr(trainer.strategy, "exchange_state", None) is not None
            and trainer.strategy.exchange_state.topology is not None,
        }
    rank = trainer.global_rank
    report["shared"] = _shared_compute_and_local_bus(args.steps)
    Path(args.out).joinpath(f"rank{rank}.json").write_text(json.dumps(report))
    import lightning_dgc

    lightning_dgc.destroy_process_group()


# -- the driver ----------------------------------------------------------------------------------------------
def measure(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    con = common.console()
    results: dict[str, Any] = {"bandwidths": {}, "strategies": args.strategies}
    with SlowLink() as link:
        for mbit in [float(b) for b in args.bandwidths.split(",")]:
            link.set_rate(mbit)
            goodput = link.measure_mbit()
            out = Path(tempfile.mkdtemp(prefix="dgc_two_level_"))
            procs = []
            for side in (0, 1):
                cmd = [*link.exec_prefix(side), common.python(), "-m", "torch.distributed.run", "--nnodes", "2",
                       "--nproc-per-node", "2", "--node-rank", str(side), "--master-addr", ADDRESSES[0],
                       "--master-port", str(MASTER_PORT), "-m", "benchmarks.two_level_links", "--worker",
                       "--out", str(out), "--strategies", args.strategies, "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--density", str(args.density)]  # fmt: skip
                env = common.worker_env(GLOO_SOCKET_IFNAME=INTERFACES[side])
                procs.append(common.start(cmd, env, out / f"node{side}.log"))
            codes = common.wait_all(procs, args.timeout)
            if codes != [0, 0]:
                raise RuntimeError(f"runs failed {codes}:\n{common.tail(out / 'node0.log', 30)}")
            ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
            rows = {}
            for name in args.strategies.split(","):
                local0 = [ranks[0][name], ranks[2][name]]  # local rank 0 of each node read its veth
                node_inter = [sum(ranks[r][name]["inter_node_bytes"] or 0 for r in rs) for rs in ((0, 1), (2, 3))]
                rows[name] = {
                    "step_ms": 1e3 * statistics.median([r[name]["step_s"] for r in ranks]),
                    "veth_tx_bytes_per_step": [n["tx_bytes_per_step"] for n in local0],
                    "stats_inter_node_bytes_per_node": node_inter,
                    "hierarchical": ranks[0][name]["hierarchical"],
                }
                con.print(f"{mbit:g} Mbit/s {name}: {rows[name]}")
            shared = {k: statistics.median([r["shared"][k] for r in ranks]) for k in ranks[0]["shared"]}
            predicted = predict_steps(args, goodput * 1e6, shared)
            for name, row in rows.items():
                row["predicted_ms"] = predicted[name] * 1e3
                row["error"] = row["step_ms"] / row["predicted_ms"] - 1
                con.print(f"  {name}: measured {row['step_ms']:.0f} ms, predicted {row['predicted_ms']:.0f} ms"
                          f" ({row['error']:+.0%})")  # fmt: skip
            results["bandwidths"][f"{mbit:g}"] = {"goodput_mbit": goodput, "shared": shared, "rows": rows}
    return results


def predict_steps(args: argparse.Namespace, bandwidth: float, shared: dict[str, float]) -> dict[str, float]:
    """The performance model's step time of every strategy at 4 workers, 2 per node, on ``bandwidth`` bits/s:
    the compute measured with all four processes at once, the local bus from the measured all-reduce inside a
    node (ring: ``2 (g-1)/g S`` bytes in that time), DGC's selection timed here, one network card per node."""
    import torch

    from lightning_dgc.algorithms.dgc import DGCConfig
    from lightning_dgc.front.profiler import bucket_layout, bucket_profiles, time_selection
    from lightning_dgc.perfmodel import Network, Profile, step_time

    torch.set_num_threads(1)
    net = _mlp_module()().net
    buckets = bucket_profiles(bucket_layout(net))
    numels = [p.numel() for p in net.parameters() if p.dim() > 1]
    selection = time_selection(numels, DGCConfig(density=args.density), torch.device("cpu"))
    local = 8 * shared["gradient_bytes"] / shared["local_allreduce_s"]  # 2 (g-1)/g = 1 at g = 2
    profile = Profile("mlp", buckets, compute_s=shared["compute_s"], selection_s=selection, density=args.density,
                      configs={"powersgd": {"matrix_approximation_rank": 4, "start_iter": 2}},
                      batch_size=32)  # fmt: skip
    network = Network(bandwidth=bandwidth, gpus_per_node=2, local_bandwidth=local, local_latency=50e-6)
    out = {}
    flat = Network(bandwidth=bandwidth, latency=network.latency)  # gloo's collectives are not node-aware
    for name in args.strategies.split(","):
        two_level = name.endswith("_node")
        out[name] = step_time(profile, name, 4, network if two_level else flat).total_s
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--bandwidths", default="100", help="Mbit/s, comma-separated")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    problem = missing_requirements()
    if problem:
        print(f"two_level_links: skipped ({problem})")
        return 0
    result = measure(args)
    path = common.write_json("two_level_links.json", result)
    print(f"Wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
