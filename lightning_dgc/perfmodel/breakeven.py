"""The break-even density: the highest density at which a sparse exchange carries no more link bytes than
DDP's ring all-reduce (the cap of the warm-up's ``byte_cap`` and of the critical regimes' windows)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from lightning_dgc.algorithms.base import TensorSpec, ring_allreduce_volume

#: The layout :func:`breakeven_density` prices: one large matrix, so that no tensor is sent dense for
#: being small.
_PRICED_LAYOUT = [TensorSpec("weight", (1024, 1024), 0, 1024 * 1024)]


def breakeven_density(algorithm_class: Any, config: Any, world_size: int) -> float:
    """The highest density at which ``algorithm_class``'s exchange (by its own ``wire_cost``) carries no
    more link bytes per step than DDP's ring all-reduce of the same fp32 gradient at ``world_size``
    ranks: 1/N for DGC's all-gather of fp32 values and int32 indices (0.125 at 8 ranks), 1.0 where
    every density costs less than DDP (DGC at 2 ranks, where a density of 0.5 or more is sent whole).

    The cost need not grow with the density (a tensor dense enough is sent whole), so the densities are
    scanned down from 1 in steps of 0.8x to the first that costs more than DDP, and the break-even is
    found by bisection below it."""
    if world_size < 2:
        return 1.0
    numel = _PRICED_LAYOUT[0].numel
    dense = ring_allreduce_volume(numel * 4, world_size)

    def cheaper(density: float) -> bool:
        priced = dataclasses.replace(config, density=density)
        cost = algorithm_class.wire_cost(priced, _PRICED_LAYOUT, world_size, numel * 4)
        return float(cost.link_bytes(world_size)) <= dense

    high = 1.0
    while cheaper(high):
        if high * numel < 2:
            return 1.0  # no density costs more than DDP
        high *= 0.8
    low = high * 0.8
    while not cheaper(low):
        high, low = low, low * 0.8
        if low * numel < 1:
            return 1.0 / numel
    for _ in range(30):
        middle = math.sqrt(low * high)
        low, high = (middle, high) if cheaper(middle) else (low, middle)
    return low
