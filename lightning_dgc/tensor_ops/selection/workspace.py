"""Scratch buffers of the CPU selection pass (:mod:`lightning_dgc.tensor_ops.selection.sampled`), reused across tensors,
steps and calls: a fresh multi-megabyte buffer can cost more than the pass that fills it (page faults)."""

from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

#: Up to this many values, the CPU pass computes the magnitudes of the whole tensor at once (they
#: stay in cache, and a few large operations cost less than many small ones); above, it goes chunk
#: by chunk and never writes the magnitudes to memory.
DIRECT_NUMEL = 1 << 20
#: Values per chunk of the CPU threshold pass: the chunk's scratch stays in the L2 cache.
CHUNK = 1 << 17


def _block(n: int) -> int:
    """Values per block of the chunked pass's mask: a whole number of chunks, about ``DIRECT_NUMEL``."""
    return min(n, max(CHUNK, DIRECT_NUMEL - DIRECT_NUMEL % CHUNK))


class _Layout(NamedTuple):
    """The workspace's views for one tensor size, made once and kept (:meth:`SelectionWorkspace.layout`)."""

    positions: Tensor  # int64 CPU tensor of the sample's size, drawn into on every call
    sample_positions: np.ndarray  # numpy view of ``positions``
    magnitudes: np.ndarray | None  # ``n`` values for the direct pass; None above ``DIRECT_NUMEL``
    mask: np.ndarray  # ``8 * ceil(n / 8)`` bytes (direct pass; the chunked pass's are one block's)
    mask_head: np.ndarray  # its first ``n`` bytes
    flags: np.ndarray  # ``ceil(n / 8)`` bytes


class SelectionWorkspace:
    """Scratch buffers for :func:`sampled_topk`, reused across tensors and steps.

    One workspace serves any number of tensors selected one after the other (a selection never
    keeps a reference into it), so a run needs one per thread, not one per tensor. The buffers grow
    to the largest tensor seen and are then reused: a fresh multi-megabyte buffer can cost more than
    the pass that fills it (page faults), which is what this object saves.

    Holds, for the CPU (numpy) pass, a candidate mask of one byte per value (of a whole tensor up to
    ``DIRECT_NUMEL`` values, else of one block of about as many), one flag byte per 8 values,
    magnitudes (of a whole tensor up to ``DIRECT_NUMEL`` values, else of one chunk) and the sample
    positions; for the torch pass, one magnitude tensor per device and dtype.
    """

    #: Most tensor sizes whose views :meth:`layout` keeps (a model has a few dozen distinct sizes).
    MAX_LAYOUTS = 1024

    def __init__(self) -> None:
        self._mask: np.ndarray | None = None
        self._flags: np.ndarray | None = None
        self._floats: dict[np.dtype, np.ndarray] = {}
        self._magnitudes: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        self._positions: Tensor | None = None
        self._layouts: dict[tuple[int, np.dtype, int, bool], _Layout] = {}

    def mask(self, numel: int) -> tuple[np.ndarray, np.ndarray]:
        """A ``bool`` array of ``8 * ceil(numel / 8)`` values and one of ``ceil(numel / 8)`` (views)."""
        words = -(-numel // 8)
        if self._mask is None or self._flags is None or self._flags.size < words:
            self._mask, self._flags = _new_mask(words)
            self._layouts.clear()  # they hold views of the old buffers
        return self._mask[: 8 * words], self._flags[:words]

    def floats(self, numel: int, dtype: np.dtype) -> np.ndarray:
        """An array of ``numel`` values of ``dtype`` (a view; at most ``max(DIRECT_NUMEL, CHUNK)``)."""
        buffer = self._floats.get(dtype)
        if buffer is None or buffer.size < numel:
            buffer = self._floats[dtype] = np.empty(max(numel, CHUNK), dtype=dtype)
            self._layouts.clear()
        return buffer[:numel]

    def positions(self, num_samples: int) -> Tensor:
        """An int64 CPU tensor of ``num_samples`` values (a view)."""
        if self._positions is None or self._positions.numel() < num_samples:
            self._positions = torch.empty(num_samples, dtype=torch.int64)
            self._layouts.clear()
        return self._positions[:num_samples]

    def layout(self, numel: int, dtype: np.dtype, num_samples: int, direct: bool) -> _Layout:
        """Every view the CPU pass needs for a tensor of ``numel`` values of ``dtype``.

        ``direct``: whether the pass keeps the magnitudes of the whole tensor (else ``magnitudes`` is
        None). Made on the first call for these arguments and then kept (until a buffer grows), so
        that the hot path pays one dictionary lookup instead of a dozen slicing and conversion calls
        per selection.
        """
        key = (numel, dtype, num_samples, direct)
        layout = self._layouts.get(key)
        if layout is None:
            # Grow every buffer first: growing clears the kept layouts.
            mask, flags = self.mask(numel if direct else _block(numel))  # (the chunked pass: one block)
            magnitudes = self.floats(numel, dtype) if direct else None
            positions = self.positions(num_samples)
            if len(self._layouts) >= self.MAX_LAYOUTS:
                self._layouts.clear()
            layout = _Layout(positions, positions.numpy(), magnitudes, mask, mask[:numel], flags)
            self._layouts[key] = layout
        return layout

    def magnitudes(self, like: Tensor, numel: int) -> Tensor:
        """A 1-D tensor of ``numel`` elements with ``like``'s dtype and device (a view)."""
        key = (like.device, like.dtype)
        buffer = self._magnitudes.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._magnitudes[key] = buffer
        return buffer[:numel]

    def nbytes(self) -> int:
        """Bytes held by the buffers (for memory accounting)."""
        arrays = [a for a in (self._mask, self._flags) if a is not None] + list(self._floats.values())
        tensors = list(self._magnitudes.values())
        if self._positions is not None:
            tensors.append(self._positions)
        return sum(a.nbytes for a in arrays) + sum(t.numel() * t.element_size() for t in tensors)


def _new_mask(words: int) -> tuple[np.ndarray, np.ndarray]:
    return np.empty(8 * words, dtype=np.bool_), np.empty(words, dtype=np.bool_)


_thread_local = threading.local()


def default_workspace() -> SelectionWorkspace:
    """The calling thread's own :class:`SelectionWorkspace`, used by the CPU pass when none is passed.

    Fresh scratch on every call would cost about as much as the pass itself (page faults on new
    memory), so callers that pass nothing still reuse buffers. It holds about ``1.1 * n`` bytes
    for the largest CPU tensor ``n`` selected from on this thread, at most ``1.1 * DIRECT_NUMEL``
    (larger tensors are scanned block by block), plus up to ``DIRECT_NUMEL`` magnitudes; pass an
    explicit workspace to control that memory instead.
    """
    workspace = getattr(_thread_local, "workspace", None)
    if workspace is None:
        workspace = _thread_local.workspace = SelectionWorkspace()
    return workspace
