"""DEFT's partitioned top-k selection: each worker selects only inside the fragments it owns.

With the plan from :mod:`lightning_dgc.algorithms.deft_partition` (fragments, their owners and a ``k_l`` per fragment),
every gradient element is examined by exactly one worker, so the selection work per worker shrinks by
about the number of workers, and the selections of different workers never overlap: the union of all
workers' indices has exactly ``sum(k_l)`` distinct elements, with no duplicates to merge after the
all-gather.

Both functions here run on the hot path of every optimizer step, on the device of the gradient: they
launch a few kernels per owned fragment, never synchronise with the host, and accept an optional
``workspace`` tensor so the caller can reuse one scratch buffer across steps. On the CPU (float32 and
float64) their per-fragment bookkeeping runs on numpy views instead: a rank owns dozens of fragments,
and there a torch call costs several times a numpy one, enough to matter next to the selection itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from lightning_dgc.tensor_ops.selection.batched import to_device

__all__ = ["deft_select", "fragment_norms"]


@dataclass(frozen=True)
class Fragment:
    """A contiguous slice of the flat gradient that lies inside a single layer.

    Attributes:
        name: Name of the layer (parameter) the slice belongs to.
        offset: Start of the slice in the flat gradient vector.
        numel: Number of elements in the slice (always positive).
        layer_offset: Start of the slice inside its layer; 0 unless the layer was split.
    """

    name: str
    offset: int
    numel: int
    layer_offset: int = 0

    @property
    def stop(self) -> int:
        """End of the slice in the flat gradient vector (exclusive)."""
        return self.offset + self.numel


def _as_int_list(values: Sequence[int] | Tensor) -> list[int]:
    return list(map(int, values.tolist() if isinstance(values, Tensor) else values))


def _scratch(workspace: Tensor | None, numel: int, like: Tensor, dtype: torch.dtype) -> Tensor:
    """The first ``numel`` elements of ``workspace``, or a fresh buffer if none was given."""
    if workspace is None:
        return torch.empty(numel, dtype=dtype, device=like.device)
    if workspace.dim() != 1 or workspace.dtype != dtype or workspace.device != like.device:
        raise ValueError(
            f"workspace must be a 1-D {dtype} tensor on {like.device}, got a {workspace.dim()}-D "
            f"{workspace.dtype} tensor on {workspace.device}"
        )
    if workspace.numel() < numel:
        raise ValueError(
            f"workspace holds {workspace.numel()} elements but {numel} are needed; pass a larger one"
        )
    return workspace[:numel]


#: CPU dtypes whose selection bookkeeping runs on numpy views (numpy has no bfloat16).
_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)
_INT64 = np.dtype(np.int64)


def _select_numpy(
    velocity_flat: Tensor,
    fragments: Sequence[Fragment],
    owned: list[int],
    k_list: list[int],
    count: int,
    selector: Callable[[Tensor, int], Tensor],
) -> tuple[Tensor, Tensor]:
    """:func:`deft_select` with a selector, for a CPU tensor: the same result, less overhead.

    The fragments are handed to the selector as tensors over numpy views, and the offsets, the
    output and the values are numpy operations on views: each costs about a microsecond where the
    equivalent torch call (slicing, ``torch.add(out=...)``, ``index_select``) costs several, and a rank
    pays these once per fragment it owns, dozens of times per step.
    """
    x = velocity_flat.numpy()
    if len(owned) == 1:  # the usual case (the hook passes one layer): no output buffer to fill
        fragment, k = fragments[owned[0]], k_list[owned[0]]
        offset = fragment.offset
        chosen = selector(torch.from_numpy(x[offset : offset + fragment.numel]), k).numpy()
        if chosen.size != k:
            raise ValueError(f"the selector returned {chosen.size} positions for k={k}; it must return k")
        out = (chosen if chosen.dtype is _INT64 else chosen.astype(np.int64)) + offset
    else:
        out = np.empty(count, dtype=np.int64)
        position = 0
        for i in owned:
            fragment, k = fragments[i], k_list[i]
            offset = fragment.offset
            chosen = selector(torch.from_numpy(x[offset : offset + fragment.numel]), k)
            np.add(chosen.numpy(), offset, out=out[position : position + k])
            position += k
    return torch.from_numpy(out), torch.from_numpy(x.take(out))


def deft_select(
    velocity_flat: Tensor,
    fragments: Sequence[Fragment],
    owners: Sequence[int],
    ks: Sequence[int] | Tensor,
    rank: int,
    *,
    workspace: Tensor | None = None,
    selector: Callable[[Tensor, int], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Select the top-``k_l`` elements by magnitude of every fragment owned by ``rank``.

    By default selection is exact (``torch.topk`` on the magnitudes of the fragment), so each owned
    fragment contributes exactly its ``k_l`` elements, and they are that fragment's largest in
    magnitude (ties broken by ``torch.topk``). ``selector(values, k)`` may replace it (for example
    DGC's sampled threshold); it must return exactly ``k`` distinct positions within ``values`` (any
    integer dtype). For a CPU float32/float64/float16 vector that does not require grad, the
    selector receives each fragment as a tensor over a numpy view of the vector, and the offsets and
    values are gathered in numpy (see :func:`_select_numpy`); the result is the same.
    Fragments owned by other ranks are not read at all.

    Args:
        velocity_flat: The flat, error-compensated gradient (DGC's velocity) of the bucket, 1-D.
        fragments: The fragments tiling it, from :func:`lightning_dgc.algorithms.deft_partition.fragment_layers`.
        owners: Owning rank of each fragment, from :func:`lightning_dgc.algorithms.deft_partition.lpt_assign`.
        ks: Elements to select per fragment, from :func:`lightning_dgc.algorithms.deft_partition.allocate_k`; a
            ``k_l`` of 0 selects nothing.
        rank: The rank doing the selection.
        workspace: Optional scratch of ``velocity_flat``'s dtype and device with at least as many
            elements as the longest owned fragment, reused for the magnitudes instead of allocating.

    Returns:
        ``(indices, values)``: int64 positions in ``velocity_flat``, grouped by fragment in fragment
        order (unsorted within a fragment), and ``velocity_flat`` at those positions (signed).
    """
    if velocity_flat.dim() != 1:
        raise ValueError(
            f"velocity_flat must be 1-D, got shape {tuple(velocity_flat.shape)}; flatten it first"
        )
    k_list = _as_int_list(ks)
    owner_list = _as_int_list(owners)
    if not len(fragments) == len(owner_list) == len(k_list):
        raise ValueError(
            f"got {len(fragments)} fragments, {len(owner_list)} owners and {len(k_list)} k values; "
            "pass one of each per fragment"
        )
    numel = velocity_flat.numel()
    owned: list[int] = []
    count = 0
    for i, owner in enumerate(owner_list):
        k = k_list[i]
        if owner != rank or k <= 0:
            continue
        fragment = fragments[i]
        if k > fragment.numel:
            raise ValueError(f"k={k} exceeds the {fragment.numel} elements of fragment {fragment}")
        if fragment.offset + fragment.numel > numel:
            raise ValueError(f"fragment {fragment} ends past the {numel} elements of the vector")
        owned.append(i)
        count += k

    if selector is not None and not velocity_flat.requires_grad and velocity_flat.is_cpu:
        if velocity_flat.dtype in _NUMPY_DTYPES:
            return _select_numpy(velocity_flat, fragments, owned, k_list, count, selector)
    indices = torch.empty(count, dtype=torch.int64, device=velocity_flat.device)
    if count == 0:
        return indices, velocity_flat.new_empty(0)

    position = 0
    if selector is not None:  # the hot path of the hook on accelerators: one add per fragment
        for i in owned:
            fragment, k = fragments[i], k_list[i]
            chosen = selector(velocity_flat[fragment.offset : fragment.stop], k)
            torch.add(chosen, fragment.offset, out=indices[position : position + k])
            position += k
        return indices, velocity_flat.index_select(0, indices)

    magnitude = _scratch(
        workspace, max(fragments[i].numel for i in owned), velocity_flat, velocity_flat.dtype
    )
    top_magnitudes = velocity_flat.new_empty(max(k_list[i] for i in owned))  # only needed as an out=
    for i in owned:
        fragment, k = fragments[i], k_list[i]
        fragment_magnitude = torch.abs(
            velocity_flat[fragment.offset : fragment.stop], out=magnitude[: fragment.numel]
        )
        chosen = indices[position : position + k]
        torch.topk(fragment_magnitude, k, sorted=False, out=(top_magnitudes[:k], chosen))
        chosen.add_(fragment.offset)  # fragment-local positions to positions in the flat vector
        position += k
    return indices, velocity_flat.index_select(0, indices)


def fragment_norms(
    velocity_flat: Tensor,
    fragments: Sequence[Fragment],
    *,
    workspace: Tensor | None = None,
    backend: Literal["auto", "torch"] = "auto",
) -> Tensor:
    """L2 norm of ``velocity_flat`` inside each fragment, the input of DEFT's k allocation.

    On CPU (float32/float64, no workspace) each norm is one BLAS dot product: a read-only pass.
    Elsewhere, when the fragments are consecutive (as :func:`lightning_dgc.algorithms.deft_partition.fragment_layers`
    makes them) the norms take one elementwise square and one segmented sum, whatever the number of
    fragments; otherwise one norm per fragment. Squares are accumulated in float32 (float64 for a float64
    vector) so that half-precision gradients do not overflow.

    Args:
        velocity_flat: The flat, error-compensated gradient of the bucket, 1-D.
        fragments: The fragments to measure.
        workspace: Optional scratch of the accumulation dtype (float32, or float64 for a float64
            vector) on the vector's device, at least as long as the span the fragments cover; it
            receives the squares instead of a fresh buffer.
        backend: ``"auto"`` (BLAS dot products on the CPU, the segmented reduction elsewhere) or
            ``"torch"`` (the segmented reduction everywhere: a fixed number of kernels).

    Returns:
        One norm per fragment, float32 (float64 for a float64 vector), on the vector's device.
    """
    if velocity_flat.dim() != 1:
        raise ValueError(
            f"velocity_flat must be 1-D, got shape {tuple(velocity_flat.shape)}; flatten it first"
        )
    accumulate = torch.float64 if velocity_flat.dtype == torch.float64 else torch.float32
    if not fragments:
        return torch.zeros(0, dtype=accumulate, device=velocity_flat.device)
    start, stop = fragments[0].offset, fragments[-1].stop
    if stop > velocity_flat.numel():
        raise ValueError(f"fragments end at {stop}, past the {velocity_flat.numel()} elements of the vector")
    if (
        backend == "auto"
        and workspace is None
        and velocity_flat.device.type == "cpu"
        and velocity_flat.dtype == accumulate
    ):
        # BLAS dot products read each fragment once and write nothing: ~10x faster on CPU than
        # squaring into a buffer and segment-summing it. numpy's, on views: ``torch.dot`` costs
        # about 0.1 ms more per call on CPU (with the run's OMP_WAIT_POLICY=PASSIVE), which over a
        # model's few hundred fragments made the norms cost more than the whole selection.
        x = (velocity_flat.detach() if velocity_flat.requires_grad else velocity_flat).numpy()
        squares = np.empty(len(fragments), dtype=x.dtype)
        for i, fragment in enumerate(fragments):
            segment = x[fragment.offset : fragment.offset + fragment.numel]
            squares[i] = segment.dot(segment)
        return torch.from_numpy(np.sqrt(squares, out=squares))
    consecutive = all(a.stop == b.offset for a, b in zip(fragments[:-1], fragments[1:], strict=True))
    if not consecutive:
        return torch.stack(
            [torch.linalg.vector_norm(velocity_flat[f.offset : f.stop], dtype=accumulate) for f in fragments]
        )
    squares = _scratch(workspace, stop - start, velocity_flat, accumulate)
    squares.copy_(velocity_flat[start:stop]).square_()
    # lengths from pinned memory, and ``unsafe``: the checks segment_reduce makes otherwise read two
    # scalars back (a host synchronisation on a GPU); the lengths are right by construction
    lengths = to_device([f.numel for f in fragments], velocity_flat.device)
    return torch.segment_reduce(squares, "sum", lengths=lengths, unsafe=True).sqrt_()
