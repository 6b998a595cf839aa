"""DEFT's layer-to-worker plan: fragments, k per fragment, and bin-packing.

DEFT (Yoon and Oh, ICPP 2023) removes the redundant work of DGC-style top-k selection: instead of every
worker scanning the whole gradient, the gradient is cut into *fragments* at layer boundaries and each
fragment is owned by exactly one worker, which selects that fragment's top-k alone. Three decisions
make this work, each a pure function here:

1. :func:`fragment_layers` cuts the flat gradient at layer boundaries, splitting any layer too large
   to fit in one worker's fair share, so that no single fragment dominates the load.
2. :func:`allocate_k` shares the global budget ``k`` between fragments in proportion to the norm of
   each fragment's error-compensated gradient (layers with a larger gradient norm matter more).
3. :func:`lpt_assign` gives fragments to workers by longest-processing-time bin-packing on the
   selection cost (:func:`selection_cost`), rotating bins between steps so no worker is always the
   busiest one.

Every worker calls these with the same (all-reduced) inputs and must reach the same plan without
talking to the others, so everything below is deterministic to the bit: the arithmetic is done on
Python ints and floats (IEEE float64) in a fixed order, never on device tensors whose reduction order
could depend on the thread count or the accelerator.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_dgc.tensor_ops.selection.partitioned import Fragment

__all__ = [
    "FRAGMENT_COST",
    "SELECTED_COST",
    "Fragment",
    "allocate_k",
    "allocate_k_list",
    "fragment_count",
    "fragment_layers",
    "lpt_assign",
    "rank_loads",
    "selection_cost",
]


def fragment_layers(names: Sequence[str], numels: Sequence[int], world_size: int) -> list[Fragment]:
    """Cut a flat gradient made of consecutive layers into fragments for ``world_size`` workers.

    Cuts fall on layer boundaries, except that a layer holding more than ``1 / world_size`` of all
    elements is cut into ``world_size`` contiguous pieces whose sizes differ by at most one (fewer
    pieces if the layer has fewer elements than workers). Without that split, one huge layer (an
    embedding, say) would be a single unit of work and bin-packing could not balance it.

    Layers with zero elements take no space in the flat vector and yield no fragment.

    Args:
        names: Layer (parameter) names, in the order their elements appear in the flat vector.
        numels: Number of elements of each layer.
        world_size: Number of workers, at least 1.

    Returns:
        Fragments in flat-vector order; together they tile ``[0, sum(numels))`` exactly.
    """
    if len(names) != len(numels):
        raise ValueError(f"got {len(names)} names but {len(numels)} sizes; pass one size per layer")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    sizes = [int(n) for n in numels]
    if any(n < 0 for n in sizes):
        raise ValueError(f"layer sizes must be non-negative, got {sizes}")
    total = sum(sizes)

    fragments: list[Fragment] = []
    offset = 0
    for name, numel in zip(names, sizes, strict=True):
        # Integer form of ``numel > total / world_size``, free of rounding.
        pieces = min(world_size, numel) if numel * world_size > total else 1
        base, extra = divmod(numel, pieces)
        layer_offset = 0
        for piece in range(pieces):
            length = base + (1 if piece < extra else 0)
            if length > 0:
                fragments.append(Fragment(name, offset + layer_offset, length, layer_offset))
            layer_offset += length
        offset += numel
    return fragments


def fragment_count(numels: Sequence[int], world_size: int) -> int:
    """How many fragments :func:`fragment_layers` makes of layers of these sizes (without making them).

    A layer holding more than ``1 / world_size`` of the values is cut into ``min(world_size, numel)``
    pieces, every other non-empty layer is one fragment.
    """
    total = sum(int(n) for n in numels)
    return sum((min(world_size, int(n)) if int(n) * world_size > total else 1) for n in numels if int(n) > 0)


def _proportional_within_bounds(weights: list[float], caps: list[int], budget: float) -> list[float]:
    """Real-valued ``x_i = clip(lam * w_i, 1, cap_i)`` with ``lam`` chosen so that ``sum(x) == budget``.

    All weights must be positive and ``len(caps) <= budget <= sum(caps)``. This is the bounded
    proportional share (the minimiser of ``sum(x_i**2 / w_i)`` under the bounds and the sum), found by
    the Bitran-Hax method: share the budget among the free entries, and if some shares leave their
    bounds, pin the side with the larger total violation to its bound (that side is provably at its
    bound in the solution) and repeat. Each round pins at least one entry, so at most ``len(weights)``
    rounds; in practice two or three.
    """
    scale = max(weights)
    weights = [w / scale for w in weights]  # the largest weight is 1, so no overflow in sums below
    shares = [0.0] * len(weights)
    free = list(range(len(weights)))
    while free:
        free_weight = math.fsum(weights[i] for i in free)
        if free_weight == 0.0:  # only weights that underflowed when scaled are left: share equally
            for i in free:
                weights[i] = 1.0
            free_weight = float(len(free))
        lam = budget / free_weight
        over = [i for i in free if lam * weights[i] > caps[i]]
        under = [i for i in free if lam * weights[i] < 1.0]
        if not over and not under:
            for i in free:
                shares[i] = lam * weights[i]
            break
        excess = math.fsum(lam * weights[i] - caps[i] for i in over)
        deficit = math.fsum(1.0 - lam * weights[i] for i in under)
        pinned, bound = (over, None) if excess >= deficit else (under, 1)
        for i in pinned:
            shares[i] = float(caps[i] if bound is None else bound)
        budget -= math.fsum(shares[i] for i in pinned)
        pinned_set = set(pinned)
        free = [i for i in free if i not in pinned_set]
    return shares


def _round_to_total(shares: list[float], caps: list[int], total: int) -> list[int]:
    """Round real shares to integers in ``[1, cap]`` that sum to ``total`` (largest remainder).

    Start from the floors; hand the missing units one at a time to the entries with the largest
    fractional part (ties: lower index first) that still have room, cycling if needed. Should float
    error make the floors overshoot, take units back from the smallest fractional parts instead.
    """
    floors = [min(max(math.floor(s), 1), c) for s, c in zip(shares, caps, strict=True)]
    remainder = total - sum(floors)
    if remainder > 0:
        order = sorted(range(len(shares)), key=lambda i: (-(shares[i] - floors[i]), i))
        while remainder > 0:  # ends: total <= sum(caps), so some entry always has room
            for i in order:
                if remainder == 0:
                    break
                if floors[i] < caps[i]:
                    floors[i] += 1
                    remainder -= 1
    elif remainder < 0:
        order = sorted(range(len(shares)), key=lambda i: (shares[i] - floors[i], i))
        while remainder < 0:  # ends: total >= len(caps), so some entry is above 1
            for i in order:
                if remainder == 0:
                    break
                if floors[i] > 1:
                    floors[i] -= 1
                    remainder += 1
    return floors


def allocate_k_list(
    norms: Tensor | Sequence[float], sizes: Sequence[int] | Tensor, k_total: int
) -> list[int]:
    """Share the selection budget ``k_total`` between fragments in proportion to their gradient norms.

    ``k_l`` is proportional to the norm of fragment ``l``'s error-compensated gradient, clipped to
    ``[1, n_l]`` (every fragment sends at least one element, none more than it has); what clipping
    removes or adds is redistributed among the unclipped fragments, and the real shares are rounded by
    largest remainder (ties: lower index first), so ``sum(k) == k_total`` exactly. A ``k_total``
    outside ``[len(sizes), sum(sizes)]`` cannot be met within the bounds and is clamped into it.

    Degenerate norms never raise: a NaN, infinite or negative norm counts as zero. Fragments with
    zero norm get the minimum of 1, unless the non-zero ones are all full, in which case the rest of
    the budget goes to the zero-norm fragments in proportion to their sizes; with all norms zero the
    whole budget is therefore shared by size (the same k as uniform density everywhere).

    The result depends only on the input values (Python float64 arithmetic in a fixed order), so
    every worker passing the same all-reduced norms gets the same k.

    Args:
        norms: One L2 norm per fragment (any device and float dtype).
        sizes: Number of elements ``n_l`` of each fragment, all positive.
        k_total: Number of elements to select over all fragments.

    Returns:
        One ``k_l`` per fragment (:func:`allocate_k` gives them as a tensor).
    """
    caps = [int(n) for n in (sizes.tolist() if isinstance(sizes, Tensor) else sizes)]
    if isinstance(norms, Tensor):
        values = norms.detach().to(device="cpu", dtype=torch.float64).reshape(-1).tolist()
    else:
        values = [float(v) for v in norms]
    if len(values) != len(caps):
        raise ValueError(f"got {len(values)} norms for {len(caps)} fragments; pass one norm per fragment")
    if any(n < 1 for n in caps):
        raise ValueError("fragment sizes must be positive; fragment_layers never yields empty fragments")
    if not caps:
        return []
    total = min(max(int(k_total), len(caps)), sum(caps))

    weights = [v if math.isfinite(v) and v > 0.0 else 0.0 for v in values]
    positive = [i for i, w in enumerate(weights) if w > 0.0]
    zero = [i for i, w in enumerate(weights) if w == 0.0]
    shares = [1.0] * len(caps)
    room_positive = sum(caps[i] for i in positive)
    if total - len(zero) >= room_positive:
        # The fragments with a gradient take all they can; the rest goes to the others by size.
        for i in positive:
            shares[i] = float(caps[i])
        if zero:
            zero_caps = [caps[i] for i in zero]
            zero_shares = _proportional_within_bounds(
                [float(c) for c in zero_caps], zero_caps, float(total - room_positive)
            )
            for i, s in zip(zero, zero_shares, strict=True):
                shares[i] = s
    else:
        positive_shares = _proportional_within_bounds(
            [weights[i] for i in positive], [caps[i] for i in positive], float(total - len(zero))
        )
        for i, s in zip(positive, positive_shares, strict=True):
            shares[i] = s
    return _round_to_total(shares, caps, total)


def allocate_k(norms: Tensor | Sequence[float], sizes: Sequence[int] | Tensor, k_total: int) -> Tensor:
    """:func:`allocate_k_list` as an int64 CPU tensor."""
    return torch.tensor(allocate_k_list(norms, sizes, k_total), dtype=torch.int64)


#: Fixed cost of selecting in one fragment, in elements: what a selection call costs beyond its pass
#: over the values (drawing the sample, finding the threshold and the candidates, some twenty numpy
#: and torch calls, each slowed by the caches the pass has just flushed). Measured on CPU on
#: ResNet-50's fragments (``benchmarks.selection``): 40-60 us per call, against 0.6-0.7 ns per
#: element of the pass. Balance is flat around it (half or twice this value plan about as well).
FRAGMENT_COST = 1 << 16
#: Cost of each selected element, in elements: the exact re-selection among the candidates (two to
#: three times ``k_l`` of them) and the bookkeeping of the result, 15-60 ns per selected value.
SELECTED_COST = 32


def selection_cost(sizes: Sequence[int] | Tensor, ks: Sequence[int] | Tensor) -> list[float]:
    """Estimated work of selecting the top ``k_l`` of a fragment of ``n_l`` elements, in elements.

    The model is ``n_l + FRAGMENT_COST + SELECTED_COST * k_l``: the selection DEFT runs by default
    (DGC's sampled threshold, :func:`lightning_dgc.tensor_ops.selection.sampled.sampled_topk`) makes one pass over
    the fragment, pays a fixed cost per call, and a little per selected value. The fixed cost matters:
    a bucket holds many small compressed tensors (1x1 convolutions, small layers: one fragment each),
    and a cost of ``n_l`` alone would pile dozens of them on the rank with the fewest elements, which
    then pays dozens of fixed costs; with it, LPT balances the number of fragments too. (Exact top-k
    grows more like ``n_l * log2(k_l)``; the sampled selection barely depends on ``k_l``.)

    Every rank calls this with the same inputs and must get the same costs: the arithmetic is on
    Python ints, converted to float at the end (exact for any realistic size).
    """
    n_list = sizes.tolist() if isinstance(sizes, Tensor) else list(sizes)
    k_list = ks.tolist() if isinstance(ks, Tensor) else list(ks)
    if len(n_list) != len(k_list):
        raise ValueError(f"got {len(n_list)} sizes but {len(k_list)} k values")
    return [
        float(int(n) + FRAGMENT_COST + SELECTED_COST * int(k)) for n, k in zip(n_list, k_list, strict=True)
    ]


def lpt_assign(costs: Sequence[float], world_size: int, rotation: int = 0) -> list[int]:
    """Assign each fragment to a worker by longest-processing-time-first bin-packing.

    Fragments are taken by decreasing cost (ties: lower index first) and each goes to the bin with the
    least load so far (ties: lower bin id). LPT's makespan is at most ``(4/3 - 1/(3n))`` times the
    optimum and at most ``sum/n + max cost``.

    Bins are then mapped to workers as ``owner = (bin + rotation) % world_size``. Bin 0 always gets the
    costliest fragment, so without rotation the same worker would be the straggler at every step;
    passing the step counter as ``rotation`` moves that load around while the multiset of loads, and
    so the makespan, stays the same.

    Args:
        costs: Non-negative finite cost per fragment, e.g. from :func:`selection_cost`.
        world_size: Number of workers, at least 1.
        rotation: Any integer; only its value modulo ``world_size`` matters.

    Returns:
        The owning rank of each fragment, in fragment order.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    cost_list = [float(c) for c in costs]
    if not all(math.isfinite(c) and c >= 0.0 for c in cost_list):
        raise ValueError("costs must be finite and non-negative")
    order = sorted(range(len(cost_list)), key=lambda i: (-cost_list[i], i))
    heap = [(0.0, b) for b in range(world_size)]  # (load, bin): pops least load, then lowest bin
    owners = [0] * len(cost_list)
    for i in order:
        load, b = heapq.heappop(heap)
        owners[i] = (b + rotation) % world_size
        heapq.heappush(heap, (load + cost_list[i], b))
    return owners


def rank_loads(costs: Sequence[float], owners: Sequence[int], world_size: int) -> list[float]:
    """Total cost owned by each rank (for load-balance statistics); exact sums via ``math.fsum``."""
    if len(costs) != len(owners):
        raise ValueError(f"got {len(costs)} costs but {len(owners)} owners")
    per_rank: list[list[float]] = [[] for _ in range(world_size)]
    for cost, owner in zip(costs, owners, strict=True):
        if not 0 <= owner < world_size:
            raise ValueError(f"owner {owner} is not a rank in [0, {world_size})")
        per_rank[owner].append(float(cost))
    return [math.fsum(c) for c in per_rank]


# -- the union's slots ------------------------------------------------------------------------------------
def union_size(k_total: int, fragments: int) -> int:
    """Values in DEFT's union for a density's ``k_total``: every fragment selects at least one
    (:func:`~lightning_dgc.algorithms.deft_partition.allocate_k_list`'s lower bound), so never fewer than the fragments."""
    return max(k_total, fragments) if k_total else 0


def shares(
    ks: list[int], slot_starts: list[int], world_size: int, rank: int, rotation: int = 0
) -> list[tuple[int, int, int]]:
    """``selectors="all"``: this rank's ``(fragment, k, first union slot)`` in every fragment: ``k // N``
    each, the remainder to the ranks ``(i + rotation) % N, ...`` so that small k rotate over the ranks;
    the ranks' slot ranges tile each fragment's ``[slot_start, slot_start + k)``."""
    out = []
    for i, k in enumerate(ks):
        base, extra = divmod(k, world_size)
        j = (rank - i - rotation) % world_size  # this rank's place in the fragment's order
        out.append((i, base + (j < extra), slot_starts[i] + j * base + min(j, extra)))
    return out


def repeated(union: Tensor) -> Tensor:
    """True at every slot whose index an earlier slot (in sorted order) already holds."""
    order = torch.argsort(union, stable=True)
    ordered = union[order]
    mask = torch.zeros_like(union, dtype=torch.bool)
    mask[order[1:]] = ordered[1:] == ordered[:-1]
    return mask
