"""``lightning-dgc-predict``: what speedup DDP, DGC, DEFT and PowerSGD would give on your cluster.

    lightning-dgc-predict --model resnet50_h100 --workers 512 --gpus-per-node 8 --bandwidths 1,10
    lightning-dgc-predict --model resnet50 --compute-ms 40 --selection-ms 8 --batch-size 64 --workers 512
    lightning-dgc-predict --profile profile.json --workers 8,64 --bandwidths 0.1,1
    python -m lightning_dgc.perfmodel.cli --list

Evaluates :mod:`lightning_dgc.perfmodel` on a profile of one node: one of the profiles that ship with the package
(``--model``: the tensor shapes of the model and the times measured on a CPU, or on one H100 for ``resnet50_h100``)
or a JSON written by :class:`lightning_dgc.ExchangeProfiler` on your hardware (``--profile``). ``--compute-ms`` and
``--selection-ms`` replace the profile's times by yours (the bytes stay exact). Prints, per method, worker count and
bandwidth, the step time, the speedup over one worker (over one node with ``--gpus-per-node`` above 1) and the bytes
each worker receives per step (for a two-level method, ``<algorithm>_node``, those that cross the nodes); ``--json``
prints the rows as JSON instead. These are predictions of a model, not measurements.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from lightning_dgc.perfmodel import METHODS, NODE_METHODS, Network, Profile, step_time, wire_bytes

__all__ = ["main", "rows", "shipped_profiles", "speedup_over_node", "with_times"]

_PACKAGE = Path(__file__).resolve().parent.parent  # lightning_dgc/


def shipped_profiles() -> dict[str, Path]:
    """The profiles that ship with the package, by model name: ``lightning_dgc/profiles`` in an installed
    wheel, ``benchmarks/results`` in a checkout (the same files)."""
    folder = _PACKAGE / "profiles"
    if not folder.is_dir():
        folder = _PACKAGE.parent / "benchmarks" / "results"
    return {p.stem.removeprefix("profile_"): p for p in sorted(folder.glob("profile_*.json"))}


def with_times(
    profile: Profile, compute_ms: float | None = None, selection_ms: float | None = None,
    batch_size: int | None = None,
) -> Profile:  # fmt: skip
    """``profile`` with the compute time (the backward window scaled alike), the selection time and the
    batch size replaced where given; each replacement is written to ``notes``."""
    notes = list(profile.notes)
    if compute_ms is not None:
        if compute_ms <= 0:
            raise ValueError(f"--compute-ms must be > 0 milliseconds per step, got {compute_ms}.")
        scale = compute_ms / 1e3 / profile.compute_s if profile.compute_s else 1.0
        backward = profile.backward_s * scale if profile.backward_s is not None else None
        notes.append(f"compute_s set to {compute_ms:g} ms (measured {profile.compute_s * 1e3:.1f} ms), backward scaled")
        profile = replace(profile, compute_s=compute_ms / 1e3, backward_s=backward)
    if selection_ms is not None:
        if selection_ms < 0:
            raise ValueError(f"--selection-ms must be >= 0 milliseconds per step, got {selection_ms}.")
        notes.append(f"selection_s set to {selection_ms:g} ms (measured {profile.selection_s * 1e3:.1f} ms)")
        profile = replace(profile, selection_s=selection_ms / 1e3)
    if batch_size is not None:
        profile = replace(profile, batch_size=batch_size)
    return replace(profile, notes=notes)


def speedup_over_node(profile: Profile, method: str, n: int, network: Network, overlap: bool = True) -> float:
    """Throughput of ``n`` workers over that of one node (``gpus_per_node`` workers, exchanging with
    ``method`` among themselves; one worker on a flat network)."""
    g = min(network.gpus_per_node, n)
    one_node = g / step_time(profile, method, g, network, overlap).total_s
    return n / step_time(profile, method, n, network, overlap).total_s / one_node


def _floats(text: str, what: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{what} takes numbers separated by commas, e.g. 1,10; got {text!r}.") from None
    if not values or min(values) <= 0:
        raise SystemExit(f"{what} takes positive numbers separated by commas, e.g. 1,10; got {text!r}.")
    return values


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-dgc-predict", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default=None, help="a shipped profile (--list shows them; default resnet50)")
    source.add_argument("--profile", type=Path, default=None, help="a profile JSON from ExchangeProfiler")
    source.add_argument("--list", action="store_true", help="list the shipped profiles and exit")
    parser.add_argument("--workers", default="8,64", help="worker counts, e.g. 8,64,512")
    parser.add_argument("--bandwidths", default="1,10", help="link bandwidths in Gbit/s, e.g. 0.1,1,10")
    parser.add_argument("--methods", default="ddp,dgc,deft,powersgd", help=f"of {', '.join(METHODS + NODE_METHODS)}")
    parser.add_argument("--compute-ms", type=float, default=None, help="replace the profile's compute time")
    parser.add_argument("--selection-ms", type=float, default=None, help="replace the profile's selection time")
    parser.add_argument("--batch-size", type=int, default=None, help="samples per worker and step")
    parser.add_argument("--gpus-per-node", type=int, default=1, help="> 1: nodes joined by the slow links")
    parser.add_argument("--nic", default="node", choices=["node", "gpu"], help="one network card per node or per GPU")
    parser.add_argument("--latency-us", type=float, default=50.0,
                        help="per message step on the slow links (gloo: about a round trip)")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="collectives a process group runs at once (gloo: 2, NCCL: 1)")
    parser.add_argument("--local-gbps", type=float, default=100.0, help="the node's local bus, Gbit/s")
    parser.add_argument("--no-overlap", action="store_true", help="communication not overlapped with backward")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    return parser


def rows(profile: Profile, methods: Sequence[str], workers: Sequence[int], bandwidths: Sequence[float],
         network: Network, overlap: bool = True) -> list[dict[str, Any]]:  # fmt: skip
    """One row per method, worker count and bandwidth (bits/s)."""
    out = []
    for method in methods:
        for bandwidth in bandwidths:
            net = replace(network, bandwidth=bandwidth)
            for n in workers:
                t = step_time(profile, method, n, net, overlap)
                out.append({
                    "method": method, "workers": n, "bandwidth_bps": bandwidth, "step_ms": t.total_s * 1e3,
                    "speedup": speedup_over_node(profile, method, n, net, overlap),
                    "link_bytes": wire_bytes(profile, method, n, net.gpus_per_node),
                })  # fmt: skip
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (``lightning-dgc-predict``); returns the exit status, 0."""
    args = _parser().parse_args(argv)
    shipped = shipped_profiles()
    if args.list:
        for name, path in shipped.items():
            p = Profile.load(path)
            print(f"{name:10s} {p.numel:>12,} parameters, {p.device} profile: compute {p.compute_s * 1e3:.1f} ms,"
                  f" selection {p.selection_s * 1e3:.1f} ms, batch {p.batch_size}")  # fmt: skip
        return 0
    if args.profile is not None:
        if not args.profile.is_file():
            raise SystemExit(f"--profile {args.profile}: no such file; write one with lightning_dgc.ExchangeProfiler.")
        try:
            profile = Profile.load(args.profile)
        except (ValueError, KeyError, TypeError) as err:
            raise SystemExit(f"--profile {args.profile}: {err}") from None
    else:
        name = args.model or "resnet50"
        if name not in shipped:
            raise SystemExit(f"--model {name!r} is not a shipped profile; choose one of {sorted(shipped)}"
                             " or give your own with --profile.")  # fmt: skip
        profile = Profile.load(shipped[name])
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS + NODE_METHODS))
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; choose from {', '.join(METHODS + NODE_METHODS)}.")
    workers = [int(w) for w in _floats(args.workers, "--workers")]
    bandwidths = [b * 1e9 for b in _floats(args.bandwidths, "--bandwidths")]
    try:
        profile = with_times(profile, args.compute_ms, args.selection_ms, args.batch_size)
        network = Network(bandwidths[0], latency=args.latency_us * 1e-6, gpus_per_node=args.gpus_per_node,
                          local_bandwidth=args.local_gbps * 1e9, nic=args.nic, concurrency=args.concurrency)  # fmt: skip
    except ValueError as err:
        raise SystemExit(str(err)) from None
    table = rows(profile, methods, workers, bandwidths, network, overlap=not args.no_overlap)
    if args.json:
        print(json.dumps(table, indent=1))
        return 0
    over = "one node" if args.gpus_per_node > 1 else "one worker"
    print(f"{profile.model}: compute {profile.compute_s * 1e3:.1f} ms, selection {profile.selection_s * 1e3:.1f} ms"
          f" per step, batch {profile.batch_size}, {args.gpus_per_node} GPU(s) per node; predicted, not measured")  # fmt: skip
    for note in profile.notes:
        print(f"  note: {note}")
    print(f"{'method':14s} {'workers':>7s} {'link':>10s} {'step ms':>9s} {'speedup over ' + over:>24s} {'MB/step':>9s}")
    for r in table:
        link = f"{r['bandwidth_bps'] / 1e9:g} Gbit/s"
        print(f"{r['method']:14s} {r['workers']:7d} {link:>10s} {r['step_ms']:9.1f} {r['speedup']:23.1f}x"
              f" {r['link_bytes'] / 1e6:9.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
