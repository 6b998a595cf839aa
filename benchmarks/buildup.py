"""How many distinct values one step updates: DGC's union of every rank's top-k against DEFT's k.

    python -m benchmarks.buildup [--data-root ../shared/data] [--workers 2,8] [--steps 10]

ResNet-20 (the CIFAR recipe's model) at the densities of the warm-up and the final 0.001, on N
simulated ranks (:func:`lightning_dgc.comm.simulate`, the real exchange on threads), each with its
own batch of ``128 / N`` CIFAR-10 images (the 8-worker parity run's split of the global batch),
from ``<data-root>/cifar10-subset`` or, without it, from the demo's generated data. The model stays
at its initialisation; each step draws new batches, so the memory accumulates as in training. The
figure is ``union_values / k`` (``buildup_factor``), averaged over ``--steps`` steps: DGC's union
grows with N (each rank's own top-k), DEFT's stays k (the ranks select in disjoint fragments), which
is the difference in coordinates updated per step behind DEFT's accuracy at 8 workers.
Writes ``results/buildup.json``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks import common

DENSITIES = (0.25, 0.0625, 0.015625, 0.004, 0.001)
GLOBAL_BATCH = 128


def images(data_root: Path | None) -> tuple[torch.Tensor, torch.Tensor]:
    from lightning_dgc_recipes.vision import load_cifar_batch

    if data_root is not None and (data_root / "cifar10-subset").is_dir():
        return load_cifar_batch(data_root / "cifar10-subset" / "cifar-10-batches-py" / "data_batch_1")
    from lightning_dgc_recipes.demo import write_synthetic_cifar

    with tempfile.TemporaryDirectory() as tmp:
        write_synthetic_cifar(Path(tmp), train_per_class=100, test_per_class=1)
        return load_cifar_batch(Path(tmp) / "cifar-10-batches-py" / "data_batch_1")


def measure(
    algo: str, world: int, density: float, steps: int, data: tuple[torch.Tensor, torch.Tensor]
) -> float:
    """The mean ``buildup_factor`` of ``steps`` exchanges of ResNet-20 gradients on ``world`` ranks."""
    from lightning_dgc import algorithms, comm
    from lightning_dgc.exchange import hook
    from lightning_dgc.exchange.state import ExchangeState
    from lightning_dgc_recipes.vision import ImageClassifier

    x_all, y_all = data
    per_rank = GLOBAL_BATCH // world

    def rank_run(collectives: comm.Collectives) -> list[float]:
        torch.manual_seed(0)
        model = ImageClassifier(arch="resnet20").network
        config = algorithms.get(algo).config_class(density=density, momentum=0.9, **(
            {"momentum_correction": True} if algo == "deft" else {}))  # fmt: skip
        state = ExchangeState(config, collectives=collectives, measure_buildup=True)
        state.register_parameters(model.named_parameters())
        params = list(model.parameters())
        factors = []
        for step in range(steps):
            start = (step * GLOBAL_BATCH + collectives.rank * per_rank) % (len(y_all) - per_rank)
            x = x_all[start : start + per_rank].float().div(255.0)
            y = y_all[start : start + per_rank]
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            hook.exchange(state, params, flat).wait()
            state.finish_step()
            factors.append(float(state.compression_stats()["buildup_factor"]))
        return factors

    torch.set_num_threads(1)
    return statistics.mean(comm.simulate(world, rank_run)[0])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.buildup", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--data-root", type=Path, default=common.REPO.parent / "shared" / "data")
    parser.add_argument("--workers", type=lambda s: [int(v) for v in s.split(",")], default=[2, 8])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    data = images(args.data_root)
    rows = []
    for world in args.workers:
        for density in DENSITIES:
            row = {"workers": world, "density": density}
            for algo in ("dgc", "deft"):
                row[algo] = measure(algo, world, density, args.steps, data)
            rows.append(row)
            common.console().print(row)
    result = {
        "source": "cifar10-subset" if (args.data_root / "cifar10-subset").is_dir() else "generated data",
        "steps": args.steps,
        "rows": rows,
    }
    common.write_json("buildup.json", result)
    return result


def tables(result: dict[str, Any]) -> list[tuple[str, list[str], list[list[Any]]]]:
    rows = [
        [r["workers"], r["density"], r["dgc"], r["dgc"] * min(1.0, r["density"]) * 100, r["deft"]]
        for r in result["rows"]
    ]
    return [
        (
            f"Distinct values updated per step / k (ResNet-20, {result['source']}, mean of {result['steps']} steps)",
            ["workers", "density", "dgc union / k", "dgc: % of values updated", "deft union / k"],
            rows,
        )
    ]


if __name__ == "__main__":
    main()
