"""The performance model's figures that the docs quote, each table and sentence rendered from its committed record.

    python -m benchmarks.model_figures      # print every table and sentence, to paste where the docs quote it

* The model against measured steps (:mod:`benchmarks.two_level_links`): ``two_level_links.json`` (two emulated nodes
  of 2 CPU processes, unshaped, 100 Mbit/s and 1 Gbit/s) and ``two_level_links_latency.json`` (100 Mbit/s at 0, 20
  and 80 ms round trip), each measured step beside the model's.
* The inputs of the cluster prediction (:mod:`benchmarks.scaling_model`): ``two_level/scaling_resnet50.json``, which
  times came from a GPU's profile and which parts of the network are the model's assumptions.

Nothing here trains or measures. ``tests/test_doc_model.py`` holds every page to these texts.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from benchmarks import common

#: The strategies of :mod:`benchmarks.two_level_links` as the tables name them, in their order.
LABELS = {"ddp": "DDP", "dgc": "DGC, flat", "dgc_node": "DGC, two-level", "deft": "DEFT, flat",
          "deft_node": "DEFT, two-level", "powersgd": "PowerSGD, flat", "powersgd_node": "PowerSGD, two-level",
          "diloco": "DiLoCo (H = 10)"}  # fmt: skip
#: The same in running text.
NAMES = {"ddp": "DDP", "dgc": "flat DGC", "dgc_node": "two-level DGC", "deft": "flat DEFT", "deft_node": "two-level DEFT",
         "powersgd": "flat PowerSGD", "powersgd_node": "two-level PowerSGD", "diloco": "DiLoCo with H = 10"}  # fmt: skip
#: The record of the cluster prediction that the README, the performance model, multi-node and the guide quote.
SCALING = "two_level/scaling_resnet50"


def record(name: str) -> dict[str, Any]:
    return json.loads((common.RESULTS / f"{name}.json").read_text())


def _links(result: dict[str, Any] | None) -> dict[str, Any]:
    return result if result is not None else record("two_level_links")


def _latency(result: dict[str, Any] | None) -> dict[str, Any]:
    return result if result is not None else record("two_level_links_latency")


def link(result: dict[str, Any], rate: float | None, rtt: float = 0.0) -> dict[str, Any]:
    """The record's entry for the link of ``rate`` Mbit/s (``None``: unshaped) and ``rtt`` ms of added round trip."""
    return next(e for e in result["links"] if (e["rate_mbit"], e["rtt_ms"]) == (rate, rtt))


def _rate(entry: dict[str, Any]) -> str:
    rate = entry["rate_mbit"]
    return "unshaped" if rate is None else f"{rate / 1e3:g} Gbit/s" if rate >= 1000 else f"{rate:g} Mbit/s"


def _percent(error: float) -> str:
    return f"{error:+.0%}".replace("-0%", "+0%")


def _pair(row: dict[str, Any]) -> str:
    return f"{row['step_ms']:,.0f} / {row['predicted_ms']:,.0f} ms ({_percent(row['error'])})"


def _ms(value: float) -> str:
    return f"{value:,.0f} ms"


def predicted(result: dict[str, Any], delayed: bool | None = None) -> list[tuple[float, str, dict[str, Any]]]:
    """Every ``(error, strategy, link)`` the model predicted on the record's shaped links (``delayed``: only those with
    an added round trip, or only those without)."""
    return [(row["error"], name, e) for e in result["links"] for name, row in e["rows"].items()
            if row.get("error") is not None and (delayed is None or bool(e["rtt_ms"]) == delayed)]  # fmt: skip


def largest_error(result: dict[str, Any], delayed: bool | None = None) -> tuple[float, str, dict[str, Any]]:
    """The model's largest error on the record's shaped links: ``(error, strategy, link)``."""
    return max(predicted(result, delayed), key=lambda t: abs(t[0]))


def largest_error_text(result: dict[str, Any], delayed: bool | None = None) -> str:
    """``13% (DEFT, flat, 1 Gbit/s: 77 ms predicted, 68 measured)``."""
    error, name, entry = largest_error(result, delayed)
    row = entry["rows"][name]
    where = _rate(entry) + (f" and {entry['rtt_ms']:g} ms" if entry["rtt_ms"] else "")
    return (f"{abs(error):.0%} ({LABELS[name]}, {where}: {row['predicted_ms']:.0f} ms predicted,"
            f" {row['step_ms']:.0f} measured)")  # fmt: skip


# -- the model against the measured links ---------------------------------------------------------------------
def agreement(links: dict[str, Any] | None = None, latency: dict[str, Any] | None = None) -> str:
    """The one sentence on how close the model came, for every page that quotes a predicted speedup."""
    links, latency = _links(links), _latency(latency)
    rows = predicted(links) + predicted(latency)
    error, name, entry = max(rows, key=lambda t: abs(t[0]))
    rates = sorted({e["rate_mbit"] for _, _, e in rows})
    longest = max(e["rtt_ms"] for _, _, e in rows)
    return (f"against {len(rows)} steps measured between two emulated CPU nodes"
            f" ({' and '.join(_rate({'rate_mbit': r}) for r in rates)}, round trips up to {longest:g} ms),"
            f" the model was off by at most {abs(error):.0%}")


def settings(links: dict[str, Any] | None = None) -> str:
    """The strategies' settings in the records: what the tables' rows ran."""
    run = _links(links)["settings"]
    rank = run["powersgd"]["matrix_approximation_rank"]
    return (f"DGC and DEFT at density {run['density']:g} with fp32 values and otherwise their strategies' defaults,"
            f" PowerSGD at rank {rank}, DiLoCo with H = {run['diloco_sync_every']} and a dense outer exchange")


def prediction_table(links: dict[str, Any] | None = None) -> str:
    """Measured against predicted at every shaped rate of ``two_level_links.json`` (no added delay)."""
    shaped = [e for e in _links(links)["links"] if e["rate_mbit"] is not None and e["rtt_ms"] == 0]
    lines = ["| strategy | " + " | ".join(f"{_rate(e)}: measured / predicted" for e in shaped) + " |",
             "| --- |" + " --- |" * len(shaped)]  # fmt: skip
    for name, label in LABELS.items():
        if all(e["rows"].get(name, {}).get("predicted_ms") is not None for e in shaped):
            lines.append(f"| {label} | " + " | ".join(_pair(e["rows"][name]) for e in shaped) + " |")
    return "\n".join(lines)


def collectives(entry: dict[str, Any], name: str) -> float:
    """The collectives a step of ``name`` issues beyond the step without exchange (Lightning's own), counted."""
    counts, base = entry["rows"][name]["collectives_per_step"], entry["rows"]["compute"]["collectives_per_step"]
    return round(sum(counts.values()) - sum(base.values()), 1)


def _link_ms(links: dict[str, Any], name: str, rate: float) -> float:
    """The model's time on the link of a step of ``name`` at ``rate``: predicted less compute and exchange."""
    row = link(links, rate)["rows"]
    return float(row[name]["predicted_ms"] - row["compute"]["step_ms"] - link(links, None)["rows"][name]["exchange_ms"])


def terms_table(links: dict[str, Any] | None = None, rate: float = 100.0) -> str:
    """Where a step's time goes at ``rate`` Mbit/s: the terms measured apart, and the whole step."""
    links = _links(links)
    ref, shaped = link(links, None), link(links, rate)
    compute = shaped["rows"]["compute"]["step_ms"]
    lines = ["| strategy | compute (no exchange) | the hook's host work alone | exchange apart from the link |"
             " collectives per step | the link (model) | step: measured / predicted |",
             "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, label in LABELS.items():
        row = shaped["rows"].get(name)
        if row is None or row.get("predicted_ms") is None:
            continue
        hook = ref["shared"]["hook_host_s"].get(name)
        lines.append(
            f"| {label} | {compute:.1f} ms | {'-' if hook is None else f'{hook * 1e3:.1f} ms'} |"
            f" {ref['rows'][name]['exchange_ms']:.1f} ms | {collectives(ref, name):g} | {_link_ms(links, name, rate):.1f} ms |"
            f" {_pair(row)} |"
        )
    return "\n".join(lines)


def link_share(links: dict[str, Any] | None = None, rate: float = 100.0) -> str:
    """``The link costs DGC's flat step about 8 ms of its 57``."""
    links = _links(links)
    step = link(links, rate)["rows"]["dgc"]["step_ms"]
    return f"The link costs DGC's flat step about {_link_ms(links, 'dgc', rate):.0f} ms of its {step:.0f}"


def message_step(latency: dict[str, Any] | None = None, rtt: float = 80.0) -> str:
    """``81 ms a step measured at an 80 ms round trip``: half a two-rank all-reduce across the link."""
    entry = link(_latency(latency), 100.0, rtt)
    step = entry["shared"]["latency_s"]["across"]["all_reduce"] / 2
    return f"{step * 1e3:.0f} ms a step measured at an {rtt:g} ms round trip"


def latency_table(latency: dict[str, Any] | None = None, rate: float = 100.0) -> str:
    """Every strategy's step at ``rate`` Mbit/s and each added round trip: measured, and the model's."""
    latency = _latency(latency)
    delays = [e for e in latency["links"] if e["rate_mbit"] == rate]
    ref = link(latency, None)
    lines = ["| strategy | collectives per step | " + " | ".join(
        f"{e['rtt_ms']:g} ms round trip: measured / predicted" for e in delays) + " |",
             "| --- | --- |" + " --- |" * len(delays)]  # fmt: skip
    for name, label in LABELS.items():
        if name not in ref["rows"]:
            continue
        cells = [_pair(e["rows"][name]) if e["rows"][name].get("predicted_ms") is not None
                 else _ms(e["rows"][name]["step_ms"]) for e in delays]  # fmt: skip
        lines.append(f"| {label} | {collectives(ref, name):g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rerun_spread(links: dict[str, Any] | None = None, latency: dict[str, Any] | None = None) -> str:
    """How far apart the two records' steps on the same link (100 Mbit/s, no delay) were: the noise of one invocation
    on these shared cores, beside which the model's errors are read."""
    first, second = link(_links(links), 100.0)["rows"], link(_latency(latency), 100.0)["rows"]
    spread = {n: max(first[n]["step_ms"], second[n]["step_ms"]) / min(first[n]["step_ms"], second[n]["step_ms"]) - 1
              for n in NAMES if n in first and n in second}  # fmt: skip
    name = max(spread, key=spread.__getitem__)
    return (f"The same 100 Mbit/s link without delay, measured in both invocations, gave steps up to {spread[name]:.0%}"
            f" apart ({NAMES[name]}: {first[name]['step_ms']:.0f} and {second[name]['step_ms']:.0f} ms)")


def against_ddp(latency: dict[str, Any] | None = None, rtt: float = 80.0) -> dict[str, float]:
    """Each strategy's speed at ``rtt`` ms on 100 Mbit/s as a multiple of DDP's (above 1: faster than DDP)."""
    rows = link(_latency(latency), 100.0, rtt)["rows"]
    return {name: rows["ddp"]["step_ms"] / rows[name]["step_ms"] for name in NAMES if name != "ddp" and name in rows}


def round_trip_sentence(latency: dict[str, Any] | None = None, rtt: float = 80.0) -> str:
    """Which strategies were slower than DDP at an added round trip of ``rtt`` ms, and how fast the others were (the
    performance model's page and the algorithm guide)."""
    rows = link(_latency(latency), 100.0, rtt)["rows"]
    speed = against_ddp(latency, rtt)
    slower = [f"{NAMES[n]} ({_ms(rows[n]['step_ms'])})" for n, s in speed.items() if s < 1]
    faster = [f"{NAMES[n]} ({_ms(rows[n]['step_ms'])}, {s:.1f}x DDP's speed)" for n, s in speed.items() if s >= 1]
    return (f"at an {rtt:g} ms round trip on 100 Mbit/s a DDP step took {_ms(rows['ddp']['step_ms'])};"
            f" {_series(slower)} {'was' if len(slower) == 1 else 'were'} slower, {_series(faster)} faster")


def _series(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def auto_choice(latency: dict[str, Any] | None = None, rtt: float = 80.0, value_dtype: str = "fp32") -> Any:
    """What ``density="auto"``'s pricing (:func:`~lightning_dgc.schedules.auto_density.choose_density`) picks for the
    flat DGC of :mod:`benchmarks.two_level_links` on the link of ``rtt`` ms: that link's message step, the rate's
    goodput, the step without exchange as the compute window, the settings check over the 4 workers."""
    from benchmarks.two_level_links import link_network, mlp_profile
    from lightning_dgc.algorithms.dgc import DGC, DGCConfig
    from lightning_dgc.schedules.auto_density import choose_density
    from lightning_dgc.schedules.link_measure import LinkEstimate

    latency = _latency(latency)
    entry, plain = link(latency, 100.0, rtt), link(latency, 100.0)
    network = link_network(entry, two_level=False, goodput_mbit=plain["goodput_mbit"])
    profile = mlp_profile(latency["settings"]["density"])
    buckets = [(list(b.layout()), b.dense_bytes) for b in profile.buckets]
    estimate = LinkEstimate(network.bandwidth, network.latency, entry["rows"]["compute"]["step_ms"] / 1e3)
    config = DGCConfig(density="auto", value_dtype=value_dtype)
    return choose_density(estimate, buckets, 4, DGC, config, config.min_density, check_s=3 * network.latency)


def auto_sentence(latency: dict[str, Any] | None = None, rtt: float = 80.0) -> str:
    """What ``density="auto"`` prices on the link of ``rtt`` ms, and what the measured steps were."""
    choice, rows = auto_choice(latency, rtt), link(_latency(latency), 100.0, rtt)["rows"]
    if choice.density == 1.0:
        return (f"On this record's {rtt:g} ms link `density=\"auto\"` prices DDP's all-reduce at"
                f" {_ms(choice.dense_s * 1e3)} a step and no lower density faster: it stays dense")
    return (f"On this record's {rtt:g} ms link `density=\"auto\"` prices flat DGC's collectives at density"
            f" {choice.density:g} at {_ms(choice.predicted_s * 1e3)} a step against {_ms(choice.dense_s * 1e3)} for"
            f" DDP's all-reduce, and picks {choice.density:g}; measured, that step took {_ms(rows['dgc']['step_ms'])}"
            f" and DDP's {_ms(rows['ddp']['step_ms'])}")  # fmt: skip


#: The benchmark's flat strategies -> the shipped configuration users pick for that algorithm.
SHIPPED = {"dgc": "dgc_1pct_int8", "deft": "deft", "powersgd": "powersgd"}


def shipped_config(name: str) -> Any:
    """The :class:`~lightning_dgc.algorithms.AlgorithmConfig` of ``configs/algo/<name>.yaml``'s strategy."""
    import importlib

    import yaml

    strategy = yaml.safe_load((common.REPO / "configs" / "algo" / f"{name}.yaml").read_text())["trainer"]["strategy"]
    module, _, cls = strategy["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), cls)(**strategy["init_args"]).config


def collectives_per_step(config: Any, density: float | None = None) -> int:
    """The collectives a flat compressed step of the benchmark's MLP issues with ``config``, as the model counts
    them: each bucket's messages (:meth:`~lightning_dgc.algorithms.Algorithm.wire_cost`) and the settings check."""
    from benchmarks.two_level_links import mlp_profile
    from lightning_dgc.algorithms.base import algorithm_for

    algorithm = algorithm_for(config)
    return 1 + sum(len(algorithm.wire_cost(config, list(b.layout()), 4, b.dense_bytes).messages)
                   for b in mlp_profile(density or 0.001).buckets)  # fmt: skip


def measured_config(name: str, latency: dict[str, Any] | None = None) -> Any:
    """The configuration the benchmark ran for ``name`` (``dgc``, ``deft``, ``powersgd``): the record's settings."""
    from lightning_dgc.algorithms.base import config_of

    run = _latency(latency)["settings"]
    return config_of(name, run["powersgd"] if name == "powersgd" else {"density": run["density"]})


def shipped_collectives(latency: dict[str, Any] | None = None) -> str:
    """How many collectives a step of each shipped configuration issues, against the one measured."""
    parts = []
    for name, config in SHIPPED.items():
        shipped, measured = collectives_per_step(shipped_config(config)), collectives_per_step(measured_config(name, latency))
        label = LABELS[name].split(",")[0]
        parts.append(f"{shipped} under `algo/{config}`" + (f", as the {label} measured" if shipped == measured
                                                           else f" against the measured {label}'s {measured}"))  # fmt: skip
    return ("The shipped configurations issue about as many collectives a flat step of this MLP (the model's count, the"
            " settings check included): " + "; ".join(parts))


# -- the bytes of the two-level exchange (docs/multi-node.md, benchmarks/README.md) ------------------------------
def _left(row: dict[str, Any]) -> float:
    """Bytes leaving a node per step: the mean over the two nodes' ends of the link."""
    return sum(row["veth_tx_bytes_per_step"]) / len(row["veth_tx_bytes_per_step"])


def bytes_table(links: dict[str, Any] | None = None, rate: float = 100.0) -> str:
    """Bytes leaving a node and the step, flat / two-level, on the link of ``rate`` Mbit/s."""
    rows = link(_links(links), rate)["rows"]
    lines = ["| method | bytes leaving a node per step | step |", "| --- | --- | --- |",
             f"| DDP | {_left(rows['ddp']) / 1e6:.2f} MB | {rows['ddp']['step_ms']:.0f} ms |"]  # fmt: skip
    for label, name in (("DGC", "dgc"), ("DEFT", "deft"), ("PowerSGD", "powersgd")):
        flat, node = _left(rows[name]), _left(rows[f"{name}_node"])
        digits = 0 if flat >= 1e5 else 1
        lines.append(f"| {label} | {flat / 1e3:.{digits}f} kB / {node / 1e3:.{digits}f} kB |"
                     f" {rows[name]['step_ms']:.0f} / {rows[f'{name}_node']['step_ms']:.0f} ms |")  # fmt: skip
    return "\n".join(lines)


def bytes_sentence(links: dict[str, Any] | None = None, rate: float = 100.0) -> str:
    """``two levels halved DGC's bytes leaving a node (31.6 against 60.1 kB per step)``."""
    rows = link(_links(links), rate)["rows"]
    flat, node = _left(rows["dgc"]), _left(rows["dgc_node"])
    return (f"on {rate:g} Mbit/s, two levels {'halved' if node < 0.6 * flat else 'cut'} DGC's bytes leaving a node"
            f" ({node / 1e3:.1f} against {flat / 1e3:.1f} kB per step)")


def measured_agreement(links: dict[str, Any] | None = None, rate: float = 100.0) -> str:
    """How close the model came on the bytes table's link: ``within 8%``."""
    errors = [abs(row["error"]) for row in link(_links(links), rate)["rows"].values() if row.get("error") is not None]
    return f"The performance model predicts each of these steps within {max(errors):.0%}"


# -- the cluster prediction's inputs (two_level/scaling_resnet50.json) ----------------------------------------
def inputs_label(scaling: dict[str, Any] | None = None) -> str:
    """The GPU times the cluster prediction was made with, and the profile that measured them."""
    profile = (scaling or record(SCALING))["profile"]
    gpu = profile["device"].removeprefix("NVIDIA ").split()[0]  # "H100"
    return (f"compute and selection measured on one {gpu}: {profile['compute_s'] * 1e3:.1f} and"
            f" {profile['selection_s'] * 1e3:.1f} ms a step at batch {profile['batch_size']}")


def assumptions(scaling: dict[str, Any] | None = None) -> str:
    """The network the cluster prediction assumed: every figure of it is set, none measured."""
    net = (scaling or record(SCALING))["network"]
    cards = "one network card per node, shared by its GPUs" if net["nic"] == "node" else "one network card per GPU"
    return (f"{net['latency'] * 1e6:g} µs per message step across nodes, a {net['local_bandwidth'] / 1e9:g} Gbit/s bus"
            f" and {net['local_latency'] * 1e6:g} µs per message step inside a node, {cards},"
            f" {net['concurrency']} collective at a time (NCCL's one stream)")


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    for name in ("agreement", "settings", "prediction_table", "terms_table", "link_share", "message_step", "latency_table",
                 "rerun_spread", "round_trip_sentence", "shipped_collectives", "auto_sentence", "bytes_table", "bytes_sentence", "measured_agreement",
                 "inputs_label", "assumptions"):  # fmt: skip
        print(f"-- {name}\n{globals()[name]()}\n")
    print(f"-- largest errors\n{largest_error_text(_links(None))}\n{largest_error_text(_latency(None), delayed=True)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
