"""Two nodes of two processes joined by a slow link: flat against two-level exchanges, bytes and step time.

    sudo .venv/bin/python -m benchmarks.two_level_links                 # unshaped, 100 Mbit/s, 1 Gbit/s
    sudo .venv/bin/python -m benchmarks.two_level_links --links none/0,100/0,100/20,100/80 --name two_level_links_latency

Setup as :mod:`benchmarks.slow_links` (root, ``ip`` and ``tc``): two network namespaces joined by a veth
pair shaped with ``tc tbf``. Each namespace is a node: one ``torchrun`` agent starts 2 processes there
(``--nnodes 2 --nproc-per-node 2 --node-rank i``), which talk to each other on the node's own addresses
(the kernel keeps that traffic inside the namespace) and to the other node through the veth (gloo bound
to it with ``GLOO_SOCKET_IFNAME``). Every process runs, in turn, every strategy on an MLP of 1.58 M
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
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.netns import ADDRESSES, INTERFACES, SlowLink, missing_requirements

#: ``compute``: the step without any exchange (:func:`benchmarks.step_terms.no_exchange_strategy`), the model's
#: compute; ``diloco``: DiLoCo (DDP inside each node, an outer step every :data:`DILOCO_SYNC_EVERY` steps).
STRATEGIES = ("compute", "ddp", "dgc", "dgc_node", "deft", "deft_node", "powersgd", "powersgd_node", "diloco")
DILOCO_SYNC_EVERY = 10  # configs/algo/diloco.yaml's
#: Steps whose collectives are counted (after the timed ones), per step on average; DiLoCo: a round.
COUNTED_STEPS = 3
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


def _local_bus(steps: int) -> dict[str, float]:
    """All four processes at once: the seconds of a dense all-reduce of the gradient between the two processes of a
    node (the local bus), and the gradient's bytes."""
    import torch
    import torch.distributed as dist

    numel = sum(p.numel() for p in _mlp_module()().net.parameters())
    groups = [dist.new_group([2 * n, 2 * n + 1]) for n in range(2)]
    mine = groups[dist.get_rank() // 2]
    flat = torch.zeros(numel)
    bus = []
    dist.barrier()
    for _ in range(steps):
        start = time.perf_counter()
        dist.all_reduce(flat, group=mine)
        bus.append(time.perf_counter() - start)
    return {"local_allreduce_s": statistics.median(bus), "gradient_bytes": numel * 4}


def _latencies() -> dict[str, dict[str, float]]:
    """A collective's own time (4 bytes) on every group the strategies use: all four ranks, the two ranks of a node,
    the two ranks that share a local rank across the nodes (:func:`benchmarks.step_terms.collective_s`)."""
    import torch.distributed as dist

    from benchmarks.step_terms import collective_s

    rank = dist.get_rank()
    nodes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return {"world": collective_s(), "node": collective_s(nodes[rank // 2]), "across": collective_s(across[rank % 2])}


def _ordinary_step(step: int, span: int) -> int:
    """The first step from ``step`` on from which ``span`` steps run no rank check (those run at powers of two and
    every 100 steps: :func:`lightning_dgc.exchange.agreement.rank_check_due`): the count is of ordinary steps."""
    from lightning_dgc.exchange.agreement import DEFAULT_CHECK_RANKS_EVERY, rank_check_due

    while any(rank_check_due(s, DEFAULT_CHECK_RANKS_EVERY) for s in range(step, step + span + 1)):
        step += 1
    return step


def _strategy(name: str, density: float, sync_every: int = DILOCO_SYNC_EVERY) -> tuple[Any, list[Any]]:
    """The strategy of a name of :data:`STRATEGIES` and the callbacks it needs."""
    import lightning_dgc
    from benchmarks.step_terms import no_exchange_strategy

    if name == "compute":
        strategy, callback = no_exchange_strategy()
        return strategy, [callback]
    if name == "ddp":
        return "ddp", []
    if name == "diloco":
        return lightning_dgc.DiLoCoStrategy(sync_every=sync_every), []
    algorithm, _, level = name.partition("_")
    options: dict[str, Any] = {"density": density} if algorithm != "powersgd" else {
        "matrix_approximation_rank": 4, "start_iter": 2}  # fmt: skip
    return lightning_dgc.CompressionStrategy(algorithm, options, hierarchical=level == "node"), []


def worker(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.step_terms import CollectiveCount, hook_host_s
    from lightning_dgc.front.profiler import bucket_layout

    torch.set_num_threads(1)
    interface = INTERFACES[int(os.environ["GROUP_RANK"])]  # torchrun's node rank
    counter = Path(f"/sys/class/net/{interface}/statistics/tx_bytes")

    class Timer(L.Callback):
        """Every step's time (batch start to batch end) from ``first`` on, ``steps`` of them, and the bytes this
        node's end of the link sent over them; the exchange's settings as the first step runs them."""

        def __init__(self, first: int, steps: int) -> None:
            self.first, self.steps = first, steps
            self.times: list[float] = []
            self.tx: list[int] = []
            self.config: Any = None
            self.settings: dict[str, Any] = {}

        def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
            state = getattr(trainer.strategy, "exchange_state", None)
            if self.config is None and state is not None:
                self.config, self.settings = copy.deepcopy(state.config), copy.deepcopy(dict(state.param_settings))
            if trainer.global_step == self.first:
                torch.distributed.barrier()
                self.tx.append(int(counter.read_text()))
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            if self.first < trainer.global_step <= self.first + self.steps:
                self.times.append(time.perf_counter() - self.start)
            if trainer.global_step == self.first + self.steps:
                torch.distributed.barrier()
                self.tx.append(int(counter.read_text()))

    MLP = _mlp_module()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8192, 256, generator=g), torch.randn(8192, 256, generator=g))
    names = args.strategies.split(",")
    report: dict[str, Any] = {name: {"step_times_s": [], "round_step_s": []} for name in names}
    settings: dict[str, tuple[Any, dict[str, Any]]] = {}
    trainer: Any = None
    for round_ in range(args.rounds):
        for name in names:
            L.seed_everything(0, verbose=False)
            # DiLoCo: whole rounds of sync_every steps, from a round's start (its outer step ends the round)
            first, steps = (DILOCO_SYNC_EVERY, 2 * DILOCO_SYNC_EVERY) if name == "diloco" else (args.warmup, args.steps)
            timer = Timer(first, steps)
            span = DILOCO_SYNC_EVERY if name == "diloco" else args.count_steps
            count = CollectiveCount(_ordinary_step(first + steps, span), span)
            counting = round_ == 0 and args.count_steps > 0
            strategy, callbacks = _strategy(name, args.density)
            trainer = L.Trainer(
                accelerator="cpu", devices=2, num_nodes=2, strategy=strategy,
                max_steps=count.at + count.span + 1 if counting else first + steps,
                logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                callbacks=[timer, *callbacks, *([count] if counting else [])],
            )  # fmt: skip
            trainer.fit(MLP(), DataLoader(data, batch_size=32))
            entry = report[name]
            entry["step_times_s"] += timer.times
            entry["round_step_s"].append(statistics.median(timer.times))
            if round_ == 0:
                stats = trainer.strategy.compression_stats() if hasattr(trainer.strategy, "compression_stats") else {}
                entry.update(
                    tx_bytes_per_step=(timer.tx[1] - timer.tx[0]) / steps if len(timer.tx) == 2 else None,
                    inter_node_bytes=stats.get("inter_node_bytes"), link_bytes=stats.get("link_bytes"),
                    collectives_per_step=count.per_step if counting else None,
                    counted_at_step=count.at if counting else None,
                    buckets=[[n for n, _ in b] for b in bucket_layout(trainer.strategy.model)],
                    hierarchical=getattr(getattr(trainer.strategy, "exchange_state", None), "topology", None) is not None,
                )  # fmt: skip
                if timer.config is not None:
                    settings[name] = (timer.config, timer.settings)
    for entry in report.values():
        times = entry["step_times_s"]
        entry["step_s"] = statistics.median(times)
        entry["mean_step_s"] = statistics.fmean(times)
    rank = trainer.global_rank
    shared: dict[str, Any] = {**_local_bus(args.steps), "latency_s": _latencies(), "hook_host_s": {}}
    net = MLP().net
    x, y = data.tensors[0][:32], data.tensors[1][:32]
    for name, (config, param_settings) in settings.items():  # every rank at once, one strategy after the other
        torch.distributed.barrier()
        shared["hook_host_s"][name] = hook_host_s(
            net, lambda m: torch.nn.functional.mse_loss(m(x), y), config, param_settings, world_size=4,
            per_node=2 if name.endswith("_node") else 1, local_rank=rank % 2,
        )  # fmt: skip
    report["shared"] = shared
    Path(args.out).joinpath(f"rank{rank}.json").write_text(json.dumps(report))
    import lightning_dgc

    lightning_dgc.destroy_process_group()


# -- the driver ----------------------------------------------------------------------------------------------
def parse_links(text: str) -> list[tuple[float | None, float]]:
    """``"none/0,100/0,100/80"`` -> ``[(None, 0.0), (100.0, 0.0), (100.0, 80.0)]``: each link's rate in Mbit/s
    (``none``: not shaped) and the round trip added, in ms."""
    links = []
    for item in text.split(","):
        rate, _, rtt = item.strip().partition("/")
        links.append((None if rate.lower() in ("none", "unshaped") else float(rate), float(rtt or 0)))
    return links


def _median_over_ranks(values: list[Any]) -> Any:
    """The median over the ranks of every number of the same nested dict."""
    if isinstance(values[0], dict):
        return {k: _median_over_ranks([v[k] for v in values]) for k in values[0]}
    return statistics.median(values)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    con = common.console()
    links = []
    with SlowLink() as link:
        for mbit, rtt in parse_links(args.links):
            link.set_rate(mbit, rtt / 2 or None)
            goodput, measured_rtt = link.measure_mbit(), link.measure_rtt_ms()
            con.print(f"link {mbit or 'unshaped'} Mbit/s, round trip {rtt:g} ms: goodput {goodput:.1f} Mbit/s,"
                      f" round trip {measured_rtt:.2f} ms ({link.delay_by or 'no delay'})")  # fmt: skip
            out = Path(tempfile.mkdtemp(prefix="dgc_two_level_"))
            procs = []
            for side in (0, 1):
                cmd = [*link.exec_prefix(side), common.python(), "-m", "torch.distributed.run", "--nnodes", "2",
                       "--nproc-per-node", "2", "--node-rank", str(side), "--master-addr", ADDRESSES[0],
                       "--master-port", str(MASTER_PORT), "-m", "benchmarks.two_level_links", "--worker",
                       "--out", str(out), "--strategies", args.strategies, "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--density", str(args.density), "--rounds",
                       str(args.rounds), "--count-steps", str(COUNTED_STEPS if not links else 0)]  # fmt: skip
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
                    "mean_step_ms": 1e3 * statistics.median([r[name]["mean_step_s"] for r in ranks]),
                    "round_step_ms": [1e3 * statistics.median(x) for x in zip(*(r[name]["round_step_s"] for r in ranks), strict=True)],
                    "veth_tx_bytes_per_step": [n["tx_bytes_per_step"] for n in local0],
                    "stats_inter_node_bytes_per_node": node_inter,
                    "hierarchical": ranks[0][name]["hierarchical"],
                    "collectives_per_step": ranks[0][name]["collectives_per_step"],
                    "counted_at_step": ranks[0][name]["counted_at_step"],
                    "buckets": ranks[0][name]["buckets"],
                }  # fmt: skip
                if name == "diloco":  # a round's steps differ: the mean over whole rounds is its step
                    rows[name]["step_ms"] = rows[name]["mean_step_ms"]
                con.print(f"  {name}: {rows[name]['step_ms']:.1f} ms, collectives {rows[name]['collectives_per_step']}")
            entry = {"rate_mbit": mbit, "rtt_ms": rtt, "goodput_mbit": goodput, "measured_rtt_ms": measured_rtt,
                     "load_average_after": list(os.getloadavg()),
                     "delay_by": link.delay_by, "shared": _median_over_ranks([r["shared"] for r in ranks]),
                     "rows": rows}  # fmt: skip
            links.append(entry)
    result = {"links": links, "strategies": args.strategies.split(","), "settings": _settings(args)}
    add_predictions(result)
    return result


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"density": args.density, "warmup_steps": args.warmup, "timed_steps": args.steps, "rounds": args.rounds,
            "diloco_sync_every": DILOCO_SYNC_EVERY, "powersgd": {"matrix_approximation_rank": 4, "start_iter": 2},
            "batch_size": 32, "threads_per_process": 1, "note": args.note,
            "step": "median of every round's timed steps (batch start to batch end); DiLoCo: the mean over whole"
                    " rounds of sync_every steps"}  # fmt: skip


def add_predictions(result: dict[str, Any]) -> None:
    """The model's step beside every measured one on a shaped link (``predicted_ms``, ``error``: predicted / measured
    - 1), the exchange times taken from the unshaped link of the same record (``exchange_ms`` there)."""
    density = result["settings"]["density"]
    reference = next((e for e in result["links"] if e["rate_mbit"] is None), None)
    if reference is None:
        return
    exchange_s = exchange_times(reference, density)
    for name, row in reference["rows"].items():
        row["exchange_ms"] = exchange_s[name] * 1e3 if name in exchange_s else None
    for entry in result["links"]:
        if entry is reference:
            continue
        rate = next(e["goodput_mbit"] for e in result["links"] if e["rate_mbit"] == entry["rate_mbit"] and not e["rtt_ms"])
        for name, predicted in predict_steps(entry, density, exchange_s, rate).items():
            row = entry["rows"][name]
            row["predicted_ms"] = predicted * 1e3
            row["error"] = row["predicted_ms"] / row["step_ms"] - 1


def mlp_profile(density: float, compute_s: float = 0.0, exchange_s: dict[str, float] | None = None) -> Any:
    """The MLP's :class:`~lightning_dgc.perfmodel.Profile`: DDP's buckets and the strategies' settings, with the
    measured compute and exchange times."""
    from lightning_dgc.front.profiler import bucket_layout, bucket_profiles
    from lightning_dgc.perfmodel import Profile

    buckets = bucket_profiles(bucket_layout(_mlp_module()().net))
    return Profile("mlp", buckets, compute_s=compute_s, density=density, batch_size=32,
                   configs={"powersgd": {"matrix_approximation_rank": 4, "start_iter": 2}},
                   exchange_s=dict(exchange_s or {}))  # fmt: skip


def link_network(entry: dict[str, Any], two_level: bool, goodput_mbit: float | None = None) -> Any:
    """The link of ``entry`` as a :class:`~lightning_dgc.perfmodel.Network`: its measured goodput; a message step's
    latency between the nodes (half the measured all-reduce of the two ranks that share a local rank across the
    nodes: two steps) and inside a node (the same, of a node's two ranks); the local bus from the measured
    all-reduce of the gradient inside a node (``2 (g-1)/g S`` bytes, ``S`` at ``g = 2``); two collectives at once
    (gloo's threads); one network card per node. Flat (``two_level=False``: gloo's groups span the nodes, every step
    of a collective as slow as the link) or two nodes of two workers. ``goodput_mbit``: the rate's, measured without
    an added delay (a one-second transfer over a long round trip measures TCP's start, not the rate)."""
    from lightning_dgc.perfmodel import Network

    shared = entry["shared"]
    latency = shared["latency_s"]
    local = 8 * shared["gradient_bytes"] / shared["local_allreduce_s"]
    return Network(bandwidth=(goodput_mbit or entry["goodput_mbit"]) * 1e6, latency=latency["across"]["all_reduce"] / 2,
                   gpus_per_node=2 if two_level else 1, local_bandwidth=local,
                   local_latency=latency["node"]["all_reduce"] / 2, concurrency=2, nic="node")  # fmt: skip


def _modelled(rows: dict[str, Any]) -> list[str]:
    return [name for name in rows if name not in ("compute", "diloco")]


def exchange_times(reference: dict[str, Any], density: float) -> dict[str, float]:
    """Each strategy's exchange time on this machine apart from its link (:attr:`Profile.exchange_s`), from the
    unshaped link of the same invocation: its measured step less the compute step and less what the model gives its
    collectives there (their bytes and latency)."""
    from lightning_dgc.perfmodel import step_time

    compute = reference["rows"]["compute"]["step_ms"] / 1e3
    out = {}
    for name in _modelled(reference["rows"]):
        profile = mlp_profile(density, compute, {name: 0.0})
        modelled = step_time(profile, name, 4, link_network(reference, name.endswith("_node"))).total_s
        out[name] = max(0.0, reference["rows"][name]["step_ms"] / 1e3 - modelled)
    return out


def predict_steps(
    entry: dict[str, Any], density: float, exchange_s: dict[str, float], goodput_mbit: float | None = None
) -> dict[str, float]:
    """The performance model's step of every strategy at 4 workers, 2 per node, on the link of ``entry``: the compute
    step measured there, each exchange's time apart from the link (``exchange_s``, measured on the unshaped link), and
    the link as :func:`link_network` prices it."""
    from lightning_dgc.perfmodel import step_time

    profile = mlp_profile(density, entry["rows"]["compute"]["step_ms"] / 1e3, exchange_s)
    return {name: step_time(profile, name, 4, link_network(entry, name.endswith("_node"), goodput_mbit)).total_s
            for name in _modelled(entry["rows"]) if name in exchange_s}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--links", default="none/0,100/0,1000/0",
                        help="RATE/RTT, comma-separated: the rate in Mbit/s (none: not shaped) and the round trip added"
                             " in ms (half each way); the unshaped link is where the exchange times are measured")  # fmt: skip
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="times every process runs every strategy, in turn")
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--count-steps", type=int, default=COUNTED_STEPS, help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=1500)
    parser.add_argument("--name", default="two_level_links", help="writes results/<name>.json")
    parser.add_argument("--note", default="", help="a line kept in the record's settings (how the machine was)")
    parser.add_argument("--report-only", action="store_true",
                        help="recompute the model's predictions of results/<name>.json from its measured terms")  # fmt: skip
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.report_only:
        path = common.RESULTS / f"{args.name}.json"
        result = json.loads(path.read_text())
        add_predictions(result)
        show(result)
        path.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    problem = missing_requirements()
    if problem:
        print(f"two_level_links: skipped ({problem})")
        return 0
    result = measure(args)
    show(result)
    path = common.write_json(f"{args.name}.json", result)
    print(f"Wrote {path}")
    return 0


COLUMNS = ["Mbit/s", "round trip ms", "strategy", "step ms", "predicted ms", "error", "collectives/step",
           "bytes leaving a node/step"]  # fmt: skip


def tables(result: dict[str, Any]) -> list[tuple[str, list[str], list[list[Any]]]]:
    """Every measured step beside the model's, link by link (the report's page and :func:`show`)."""
    rows = []
    for entry in result["links"]:
        for name, row in entry["rows"].items():
            tx = row.get("veth_tx_bytes_per_step") or []
            rows.append([f"{entry['rate_mbit'] or 'unshaped'}", f"{entry['rtt_ms']:g}", name, row["step_ms"], row.get("predicted_ms"),
                         None if row.get("error") is None else f"{row['error']:+.0%}",
                         common.fmt(sum(row["collectives_per_step"].values())) if row["collectives_per_step"] else None,
                         common.fmt(sum(tx) / len(tx)) if tx else None])  # fmt: skip
    return [("Two nodes of two processes over a shaped link", COLUMNS, rows)]


def show(result: dict[str, Any]) -> None:
    for title, columns, rows in tables(result):
        common.print_table(title, columns, rows)


if __name__ == "__main__":
    sys.exit(main())
