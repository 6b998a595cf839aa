"""Which tensors a top-k algorithm sends and how many values of each: the settings it reads
(:class:`TopKSettings`), k per tensor (:func:`tensor_values`), each tensor's kind (:func:`tensor_kind`) and a
bucket's split (:func:`split_layout`), shared by the exchange's plan, its wire cost and the memory account.

A tensor is handled in one of three ways, decided once per bucket layout and density (the *plan*):
``sparse`` (compressed), ``full`` (density so high that sending everything dense is cheaper: the
velocity is all-reduced and cleared, which is what selecting every index means; the momentum is
not masked, so this is DDP + SGD momentum) and ``dense`` (1-D or too small to compress, unless the
configuration's ``small_density`` compresses them too: plain averaging, then the optimizer's momentum in the decode).
With DGC's ``small_every`` above 1 those small tensors are ``full`` instead, and *periodic*: sent every
``small_every`` steps, their velocity held between two sends (:func:`small_every`).
"""

from __future__ import annotations

import math
from typing import Literal, Protocol

import torch

from lightning_dgc.algorithms.base import TensorSpec
from lightning_dgc.tensor_ops import codec

Kind = Literal["sparse", "full", "dense"]


def values_per_step(numel: int, density: float) -> int:
    """k for a tensor of ``numel`` values: ``ceil(density * numel)``, at least 1."""
    return min(numel, max(1, math.ceil(density * numel)))


class TopKSettings(Protocol):
    """What the shared top-k base reads of its algorithm's configuration (DGC's
    :class:`~lightning_dgc.algorithms.dgc_config.DGCConfig` has it all; an outside top-k declares the same fields)."""

    density: float
    value_dtype: str
    sample_ratio: float
    selection: str
    selection_backend: str
    momentum_masking: bool
    momentum_correction: bool

    @property
    def value_dtype_torch(self) -> torch.dtype: ...

    def averaged_dense(self, numel: int, ndim: int) -> bool: ...

    def tensor_density(self, numel: int, ndim: int, density: float) -> float: ...


def tensor_values(config: TopKSettings, numel: int, ndim: int, density: float) -> int:
    """k for one compressed tensor when the step's density is ``density`` (the config's density per tensor)."""
    return values_per_step(numel, config.tensor_density(numel, ndim, density))


def small_every(config: TopKSettings) -> int:
    """Steps between two sends of the small tensors (DGC's ``small_every``; 1 for a configuration without it)."""
    return int(getattr(config, "small_every", 1))


def periodic(numel: int, ndim: int, config: TopKSettings) -> bool:
    """Whether a tensor is one of the small ones sent whole every ``small_every`` steps (see the module docstring)."""
    return small_every(config) > 1 and config.averaged_dense(numel, ndim)


def holds_back(periodic_flags: list[bool]) -> bool:
    """Whether a bucket whose tensors are periodic or not as ``periodic_flags`` says holds its periodic ones back in
    some steps: it has some, and others to send every step (a bucket of small tensors alone sends them every step)."""
    return any(periodic_flags) and not all(periodic_flags)


def tensor_kind(numel: int, ndim: int, k: int, config: TopKSettings) -> Kind:
    """How one tensor is exchanged (see the module docstring)."""
    if config.averaged_dense(numel, ndim):
        return "full" if small_every(config) > 1 else "dense"
    if codec.sparse_nbytes(k, config.value_dtype_torch) >= numel * 4:
        return "full"
    return "sparse"


def split_layout(
    config: TopKSettings, layout: list[TensorSpec], density: float | None = None
) -> tuple[list[int], int, int]:
    """Of a bucket's tensors: the sizes of those sent sparse, their total k, and how many values go dense
    (sent whole or averaged), as :func:`tensor_kind` decides at ``density`` (default: the config's); what
    the wire costs are computed from."""
    density = config.density if density is None else density
    sparse_numels, k_total, dense_numel = [], 0, 0
    for spec in layout:
        k = tensor_values(config, spec.numel, spec.ndim, density)
        if tensor_kind(spec.numel, spec.ndim, k, config) == "sparse":
            sparse_numels.append(spec.numel)
            k_total += k
        else:
            dense_numel += spec.numel
    return sparse_numels, k_total, dense_numel
