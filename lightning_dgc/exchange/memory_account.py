"""An account of the memory a top-k exchange (DGC, DEFT) holds at its peak: every tensor by name and size.

:func:`memory_account` derives it from the model's tensor sizes, DDP's buckets and the configuration, the
way the exchange plans them (:mod:`lightning_dgc.algorithms.sparse`), without running a step. Two kinds
of rows:

* ``run``: held from the first step to the end of training, per parameter or per bucket: the residual
  (DGC's velocity ``v``, DEFT's error feedback), the momentum ``u`` when the exchange keeps one (momentum
  correction with SGD's momentum taken over, or ``momentum > 0``), the momentum of the tensors averaged dense,
  and each bucket's wire buffers (DGC's payload and every rank's gathered payloads; DEFT's union of indices, its
  values and the control vector of norms);
* ``step``: a step's temporaries at their largest bucket, one bucket at a time: the velocity selected from
  (``v'``, when it is not made in the bucket itself), the local gradient's copy (when the caller reads the
  update before the commit), the batched selection's scratch (9 bytes a value of a group of segments, 5 for a
  tensor selected alone; compiled, 10 and 6; DEFT: its own fragments gathered into one buffer besides), the selected indices and
  values and the decode's every-rank indices and values.

The total, divided by the parameters' bytes, is what the exchange adds over DDP in *model sizes*; the CPU's
default path (numpy, tensor by tensor) holds less than the ``step`` rows say (one tensor's v' at a time,
selected chunk by chunk), so the account is stated for the batched path, a GPU's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lightning_dgc.algorithms.dgc import DGCConfig
from lightning_dgc.algorithms.topk_plan import tensor_kind, tensor_values
from lightning_dgc.tensor_ops import codec
from lightning_dgc.tensor_ops.selection.batched import MAX_BATCH_VALUES, _group_bounds, selected_in_groups

__all__ = ["AccountRow", "MemoryAccount", "memory_account"]

Lifetime = Literal["run", "step"]
#: Bytes a value of the eager batched selection's scratch: ``|x|`` or a running sum (4), every value's threshold
#: (4) and the candidate mask (1); a segment alone needs no threshold table.
SCRATCH_BYTES, SCRATCH_BYTES_ALONE = 9, 5
#: The compiled shape-static selection's (``compile_selection``): every value's segment (4), its two comparisons
#: (1 each) and a running sum (4); a segment alone needs no segment table.
COMPILED_SCRATCH_BYTES, COMPILED_SCRATCH_BYTES_ALONE = 10, 6


@dataclass(frozen=True)
class AccountRow:
    """One tensor (or one kind of tensor summed over parameters or buckets) the exchange holds."""

    name: str
    nbytes: int
    lifetime: Lifetime  # "run": held across steps; "step": a step's temporaries, at the largest bucket
    what: str


@dataclass(frozen=True)
class MemoryAccount:
    algorithm: str
    model_bytes: int  # the parameters' bytes: one model size
    rows: tuple[AccountRow, ...]

    def nbytes(self, lifetime: Lifetime | None = None) -> int:
        return sum(r.nbytes for r in self.rows if lifetime is None or r.lifetime == lifetime)

    def model_sizes(self, lifetime: Lifetime | None = None) -> float:
        """Bytes in model sizes (``run``, ``step``, or both: the peak over DDP)."""
        return self.nbytes(lifetime) / self.model_bytes if self.model_bytes else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "algorithm": self.algorithm,
            "model_bytes": self.model_bytes,
            "rows": [{"name": r.name, "bytes": r.nbytes, "model_sizes": r.nbytes / self.model_bytes,
                      "lifetime": r.lifetime, "what": r.what} for r in self.rows],  # fmt: skip
            "run_model_sizes": self.model_sizes("run"),
            "step_model_sizes": self.model_sizes("step"),
            "total_model_sizes": self.model_sizes(),
        }


def _scratch(sizes: Sequence[int], compiled: bool) -> int:
    """The batched selection's scratch for segments of ``sizes``: the largest group's (the compiled form's
    when ``compiled``: the larger, it runs from a layout's second step)."""
    several, alone = (COMPILED_SCRATCH_BYTES, COMPILED_SCRATCH_BYTES_ALONE) if compiled else (SCRATCH_BYTES, SCRATCH_BYTES_ALONE)
    if not sizes:
        return 0
    groups = _group_bounds(sizes, MAX_BATCH_VALUES) if selected_in_groups(sizes) else [(0, len(sizes))]
    return max((several if b - a > 1 else alone) * sum(sizes[a:b]) for a, b in groups)


def memory_account(
    config: DGCConfig, tensors: Sequence[tuple[int, int]], buckets: Sequence[Sequence[int]] | None = None,
    world_size: int = 2, momentum: bool = True, finish_writes_grads: bool = True, compiled: bool = True,
) -> MemoryAccount:  # fmt: skip
    """The account of DGC's or DEFT's exchange (by ``config``'s type) for float32 parameters.

    Args:
        config: a :class:`~lightning_dgc.algorithms.dgc_config.DGCConfig` or a DEFT config (its subclass).
        tensors: ``(numel, ndim)`` of every parameter, in the model's order.
        buckets: the parameters of each DDP bucket (indices into ``tensors``); default one bucket.
        world_size: the ranks exchanging.
        momentum: whether the compressed tensors keep a momentum in the exchange (SGD's momentum taken over
            with ``momentum_correction=True``, or ``config.momentum > 0``).
        finish_writes_grads: whether the update is written after the commit (the strategies'), which spares
            the copy of the local gradient.
        compiled: whether DGC's selection runs compiled (``compile_selection``, on CUDA by default); DEFT's never.
    """
    from lightning_dgc.algorithms import get

    algorithm = get("deft" if type(config).__name__.startswith("DEFT") else "dgc")
    deft = algorithm.name == "deft"
    density = algorithm.selected_density(config, world_size)
    buckets = buckets if buckets is not None else [list(range(len(tensors)))]
    momentum = momentum and (config.momentum_correction or config.momentum > 0)
    value_bytes = config.value_dtype_torch.itemsize
    residual = held_momentum = dense_momentum = payloads = union = 0
    v_prime = local = scratch = selected = decoded = 0
    for bucket in buckets:
        sizes, ks, dense, numel = [], [], 0, 0
        for i in bucket:
            n, ndim = tensors[i]
            numel += n
            k = tensor_values(config, n, ndim, density)
            kind = tensor_kind(n, ndim, k, config)
            if kind == "dense":
                dense += n
                continue
            residual += 4 * n
            held_momentum += 4 * n if momentum else 0
            if kind == "sparse":
                sizes.append(n)
                ks.append(k)
        dense_momentum += 2 * 4 * dense if momentum and config.momentum_correction else 0  # (buffer, scratch)
        k_total, compressed = sum(ks), sum(sizes)
        if deft:
            fragments = len(sizes) * (world_size if config.fragmenting else 1)
            union += (4 + value_bytes) * k_total + 8 * (fragments + world_size)
            own = math.ceil(compressed / world_size)  # this rank's fragments, gathered into one buffer
            alone = fragments <= world_size  # (a rank owns one fragment at most)
            bucket_scratch = (4 + (SCRATCH_BYTES_ALONE if alone else SCRATCH_BYTES)) * own
            bucket_decoded = (4 + 8 + value_bytes) * k_total
        else:
            payload = codec.payload_nbytes(k_total, config.value_dtype_torch, numel) if k_total else 0
            payloads += payload * (1 + world_size)
            bucket_scratch = _scratch(sizes, compiled)
            bucket_decoded = world_size * k_total * (8 + 4)
        separate = momentum or not deft and not _side_by_side(bucket, tensors, config, density)
        bucket_v = 4 * compressed if separate else 0  # error feedback alone makes v' in the bucket itself
        if not deft and separate and selected_in_groups(sizes):
            bucket_v = 4 * max(sum(sizes[a:b]) for a, b in _group_bounds(sizes, MAX_BATCH_VALUES))
        v_prime = max(v_prime, bucket_v)
        local = max(local, 0 if finish_writes_grads else 4 * numel)
        scratch = max(scratch, bucket_scratch)
        selected = max(selected, k_total * (8 + 8 + 4))  # indices, their order, values
        decoded = max(decoded, bucket_decoded)
    model_bytes = 4 * sum(n for n, _ in tensors)
    rows = [
        AccountRow("velocity (residual)", residual, "run", "v: what was not sent yet, every tensor not averaged dense"),
        AccountRow("momentum", held_momentum, "run", "u: the momentum the exchange keeps (momentum correction)"),
        AccountRow("dense momentum", dense_momentum, "run", "momentum of the tensors averaged dense, and its scratch"),
        AccountRow("wire buffers", payloads + union, "run",
                   "DEFT: union indices, values, norms" if deft else "payload and every rank's gathered payloads"),
        AccountRow("v' (selected from)", v_prime, "step", "momentum-corrected velocity, largest bucket or group"),
        AccountRow("local gradient copy", local, "step", "kept for the commit when the decode overwrites the bucket"),
        AccountRow("selection scratch", scratch, "step", "batched selection: |x|, thresholds, mask (largest group)"),
        AccountRow("selected", selected, "step", "this rank's indices, their order and values"),
        AccountRow("decode", decoded, "step", "every rank's indices and values, unpacked"),
    ]  # fmt: skip
    return MemoryAccount(algorithm.name, model_bytes, tuple(rows))


def _side_by_side(bucket: Sequence[int], tensors: Sequence[tuple[int, int]], config: DGCConfig, density: float) -> bool:
    """Whether a bucket's compressed tensors are consecutive (error feedback then makes v' in the bucket)."""
    sparse = [j for j, i in enumerate(bucket)
              if tensor_kind(*tensors[i], tensor_values(config, *tensors[i], density), config) == "sparse"]  # fmt: skip
    return not sparse or sparse == list(range(sparse[0], sparse[-1] + 1))
