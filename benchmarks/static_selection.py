"""DGC's batched selection per DDP bucket: today's eager form, the shape-static form eager, and compiled.

    OMP_WAIT_POLICY=PASSIVE python -m benchmarks.static_selection [--model resnet50] [--reps 7] [--device cpu]

For one model of :mod:`benchmarks.shapes` (default ResNet-50, density 0.001, sample ratio 0.01), one float32
gradient of random normal values per compressed tensor, grouped as DDP buckets them after its first step
(25 MB), each bucket's compressed tensors one flat buffer as the hook keeps them. Per round, interleaved
(load from other processes hits all alike), each time the whole model's selection:

* ``batched``: :func:`~lightning_dgc.tensor_ops.selection.batched.batched_topk`, the eager batched form
  (one host read per bucket): what ``compile_selection=False`` runs on a GPU;
* ``static_eager``: :class:`~lightning_dgc.tensor_ops.selection.static.StaticSelection` run eagerly;
* ``static_compiled``: the same, one ``torch.compile`` program per bucket (``compile_selection``);
* ``per_tensor``: ``sampled_topk`` tensor by tensor, the CPU's default (numpy) path;
* ``floor``: one ``torch.abs`` pass per bucket buffer.

Every form gets the same draws (a generator reseeded per call); the record says whether the compiled and
eager static forms selected the same indices, and whether they selected what ``batched`` did. The first
compiled call per bucket (compilation) is timed apart. Times are medians over rounds after one warm-up
round; on a loaded machine quote the ratios, measured in the same rounds. Writes
``benchmarks/results/static_selection.json`` (``static_selection_cuda.json`` with ``--device cuda``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP: no spin-waiting

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from benchmarks import common
from benchmarks.selection import DDP_BUCKET_MB, Timer, ddp_buckets, median_ms, run_rounds
from benchmarks.shapes import MODELS, is_compressed, param_shapes
from lightning_dgc.algorithms.topk_plan import values_per_step
from lightning_dgc.tensor_ops.selection.batched import batched_topk, segment_layout
from lightning_dgc.tensor_ops.selection.sampled import SelectionWorkspace, sampled_topk
from lightning_dgc.tensor_ops.selection.static import StaticSelection

FORMS = ("floor", "per_tensor", "batched", "static_eager", "static_compiled")


def measure(model: str, reps: int, device: torch.device, density: float = 0.001, sample_ratio: float = 0.01,
            seed: int = 0) -> dict[str, Any]:  # fmt: skip
    shapes = param_shapes(model)
    compressed = [i for i, s in enumerate(shapes) if is_compressed(s)]
    generator = torch.Generator().manual_seed(seed)
    grads = {i: torch.randn(shapes[i].numel, generator=generator) for i in compressed}
    buckets = [[i for i in bucket if i in grads] for bucket in ddp_buckets(shapes, DDP_BUCKET_MB)]
    buckets = [b for b in buckets if b]
    flats = [torch.cat([grads[i] for i in b]).to(device) for b in buckets]
    layouts = [
        segment_layout([grads[i].numel() for i in b], [values_per_step(grads[i].numel(), density) for i in b],
                       sample_ratio, device)
        for b in buckets
    ]  # fmt: skip
    eager = [StaticSelection(layout, sample_ratio, compiled=False) for layout in layouts]
    compiled = [StaticSelection(layout, sample_ratio, compiled=True) for layout in layouts]
    per_tensor = [(grads[i], values_per_step(grads[i].numel(), density)) for b in buckets for i in b]
    workspace, outs = SelectionWorkspace(), [torch.empty_like(flat) for flat in flats]

    def draws() -> torch.Generator:
        return torch.Generator(device=device).manual_seed(seed + 1)

    compile_s = []
    same_compiled, same_batched = True, True
    for flat, layout, e, c in zip(flats, layouts, eager, compiled, strict=True):
        start = time.perf_counter()
        got = c(flat, draws())
        compile_s.append(time.perf_counter() - start)
        reference = e(flat, draws())
        same_compiled &= torch.equal(got, reference)
        same_batched &= torch.equal(reference, batched_topk(flat, layout, draws()))

    def run(fn: Callable[[torch.Tensor, int], Any]) -> Callable[[], None]:
        return lambda: [fn(flat, j) for j, flat in enumerate(flats)] and None

    fns: dict[str, Callable[[], Any]] = {
        "floor": run(lambda flat, j: torch.abs(flat, out=outs[j])),
        "per_tensor": lambda: [sampled_topk(g, k, sample_ratio, draws(), workspace=workspace)
                               for g, k in per_tensor] and None,  # fmt: skip
        "batched": run(lambda flat, j: batched_topk(flat, layouts[j], draws())),
        "static_eager": run(lambda flat, j: eager[j](flat, draws())),
        "static_compiled": run(lambda flat, j: compiled[j](flat, draws())),
    }
    if device.type != "cpu":
        del fns["per_tensor"]
    times = run_rounds(fns, reps, Timer(device))
    med = {name: median_ms(samples) for name, samples in times.items()}
    return {
        "model": model,
        "buckets": len(buckets),
        "compressed_tensors": len(compressed),
        "compressed_values": sum(g.numel() for g in grads.values()),
        "k": sum(layout.k_total for layout in layouts),
        "capacity": sum(t.capacity for s in compiled for _, _, t in s.groups),
        "median_ms": med,
        "ratios": {
            "static_eager_over_batched": med["static_eager"] / med["batched"],
            "static_compiled_over_batched": med["static_compiled"] / med["batched"],
            "static_compiled_over_static_eager": med["static_compiled"] / med["static_eager"],
            "static_compiled_over_floor": med["static_compiled"] / med["floor"],
        },
        "compile_s_per_bucket": compile_s,
        "compiled_equals_eager": bool(same_compiled),
        "compile_failures": [c.failed for c in compiled if c.failed],  # (such a bucket selected eagerly)
        "static_equals_batched": bool(same_batched),
        "samples_ms": {name: [t * 1e3 for t in samples] for name, samples in times.items()},
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.static_selection", description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=MODELS, default="resnet50")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    result = measure(args.model, args.reps, device)
    m = result["median_ms"]
    common.print_table(
        f"DGC's batched selection, {args.model}, {device}, median of {args.reps} rounds (ms)",
        ["form", "ms", "x batched"], [[f, m[f], m[f] / m["batched"]] for f in FORMS if f in m],
        caption=f"compiled = eager: {result['compiled_equals_eager']}; static = batched: "
                f"{result['static_equals_batched']}; compile s per bucket: "
                f"{', '.join(f'{s:.1f}' for s in result['compile_s_per_bucket'])}",
    )  # fmt: skip
    payload = {"command": "python -m benchmarks.static_selection " + " ".join(argv if argv is not None else []),
               "config": {"device": str(device), "reps": args.reps, "density": 0.001, "sample_ratio": 0.01,
                          "torch_threads": torch.get_num_threads()}, **result}  # fmt: skip
    name = "static_selection.json" if device.type == "cpu" else f"static_selection_{device.type}.json"
    common.write_json(name, payload)
    return payload


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
