"""DEFT's settings: DGC's (:class:`~lightning_dgc.algorithms.dgc_config.DGCConfig`) plus the parts of the method,
each switchable for ablations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_dgc.algorithms.checks import flag
from lightning_dgc.algorithms.dgc_config import DGCConfig


@dataclass
class DEFTConfig(DGCConfig):
    """DGC's hyper-parameters (:class:`~lightning_dgc.algorithms.dgc_config.DGCConfig`), with ``momentum_correction``
    off by default (DEFT's plain error feedback, which leaves momentum and weight decay to the optimizer: any
    optimizer works), plus:

    The method's parts, each switchable for ablations (the defaults are DEFT as published):

    k_allocation: ``"norm"``: k shared among fragments in proportion to their norms; ``"size"``: in
        proportion to their sizes (every fragment at the same density, as DGC), which needs no norms:
        the step skips their computation and their blocking all-reduce (and so does not report
        ``max_rank_selection_ms``).
    fragmenting: cut a layer larger than 1/N of the bucket into N pieces (``False``: whole layers).
    rotation: rotate the fragments' owners with the step counter (``False``: fixed owners).
    union_values: ``"all"``: every rank sends, and clears from its memory, its values at the whole
        union; ``"owner"``: only a fragment's owner does, at the indices it selected (the other
        ranks keep theirs).

    selectors: ``"owner"`` (as published): a fragment's k values are those its owner selects from its
        own memory. ``"all"``: every rank selects ``k/N`` of them (the remainder rotating), so the union
        reflects all ranks' memories, as DGC's does, at DEFT's volume (duplicates are sent once); the
        selection is no longer shared out (each rank reads the whole bucket, as with DGC; the
        performance model still charges DEFT's published 1/N share of it).

    The wire (not a part of the method: how the union travels; the union and the update are the same):

    wire: ``"allreduce"`` (as published): the union's indices merged by an int32 all-reduce (sum) of the
        disjoint selections, the values all-reduced in ``value_dtype``: about ``2 (N-1)/N (4 + b)``
        bytes per union value on each link (``b``: the value's bytes). ``"compact"``: every rank's own
        selections as 2-byte delta codes (DGC's, :mod:`lightning_dgc.tensor_ops.codec`), one
        all-gather of a row per rank padded to the largest rank's count (every rank knows every count
        from the shared plan), then the values all-reduced in fp16 whatever ``value_dtype`` (which
        still sets the tensors averaged dense, and the DGC that ``budget="dgc_link"`` matches),
        divided by the number of ranks first as the dense fp16 all-reduce is: about ``6 (N-1)/N``
        bytes per union value when the ranks select equal counts, 2.7 times fewer than ``"allreduce"``
        in fp32. A value whose average overflows fp16 makes the step non-finite, and it is skipped on
        every rank with the memory intact; values below fp16's range are sent as 0 (and cleared from
        the memory, as DGC's fp16 values' rounding is).

    And the budget (not a part of the method: how many values its union holds):

    budget: ``"k"`` (as published): the union holds ``k = ceil(density * numel)`` values per compressed
        tensor, what one DGC rank sends. ``"dgc_link"``: as many values as DGC's exchange at the same
        density carries on each worker's link (``WireCost.link_bytes``), never fewer than k. DGC's ring
        all-gather forwards ``(N-1)`` payloads of k values with 2-byte index codes (``(N-1) (2 + b) k``
        bytes); with ``wire="allreduce"`` DEFT's ring all-reduce carries ``2 (N-1)/N`` times its union of
        values with int32 indices: so the union holds ``N (2 + b) / (2 (4 + b))`` times k (``b`` bytes per
        value: 3 k at 8 ranks in fp32), capped at every value, and k at 2 ranks (where DEFT's k already
        costs 4/3 of DGC's bytes). With ``wire="compact"`` (``6 (N-1)/N`` bytes per union value) it holds
        ``N (2 + b) / 6`` times k: N k against DGC in fp32 (2 k at 2 ranks, 8 k at 8). The density a
        schedule sets keeps its meaning (DGC's), so one warm-up YAML serves both strategies.
    """

    momentum_correction: bool = False
    k_allocation: Literal["norm", "size"] = "norm"
    fragmenting: bool = True
    rotation: bool = True
    union_values: Literal["all", "owner"] = "all"
    budget: Literal["k", "dgc_link"] = "k"
    selectors: Literal["owner", "all"] = "owner"
    wire: Literal["allreduce", "compact"] = "allreduce"

    def validate(self) -> None:
        if self.compile_selection is True:
            raise ValueError(
                "`compile_selection=True` compiles DGC's selection, whose shapes are fixed by the bucket; DEFT's"
                " are not: which fragments a rank selects, and how many values from each, change with every step's"
                " norms and owners, so a compiled program would be rebuilt step after step. Pass"
                " `compile_selection='auto'` or False (DEFT never compiles its selection)."
            )
        super().validate()
        if self.small_density is not None:
            raise ValueError(
                f"`small_density={self.small_density!r}` is DGC's: DEFT splits each step's selection among the"
                " workers by the tensors' norms and sizes, not at a density per tensor. Drop it (DEFT averages the"
                " small tensors dense), or use DGC."
            )
        if self.small_every != 1:
            raise ValueError(
                f"`small_every={self.small_every!r}` is DGC's: DEFT averages the small tensors dense every step."
                " Drop it, or use DGC."
            )
        if self.value_dtype == "int8":
            raise ValueError(
                "DEFT sums its values in an all-reduce, which int8 levels scaled on each rank cannot take;"
                " use value_dtype='fp16' (or 'fp32'), or DGC for int8 values."
            )
        self.fragmenting = flag(self.fragmenting, "fragmenting")
        self.rotation = flag(self.rotation, "rotation")
        if self.k_allocation not in ("norm", "size"):
            raise ValueError(f"`k_allocation` must be 'norm' or 'size', got {self.k_allocation!r}.")
        if self.union_values not in ("all", "owner"):
            raise ValueError(f"`union_values` must be 'all' or 'owner', got {self.union_values!r}.")
        if self.selectors not in ("owner", "all"):
            raise ValueError(f"`selectors` must be 'owner' or 'all', got {self.selectors!r}.")
        if self.selectors == "all" and self.union_values == "owner":
            raise ValueError(
                "`union_values='owner'` needs one selecting rank per fragment; it does not combine with"
                " `selectors='all'`."
            )
        if self.budget not in ("k", "dgc_link"):
            raise ValueError(
                f"`budget` must be 'k' (k values per step, as published) or 'dgc_link' (the values that fill"
                f" what DGC's exchange carries on each link), got {self.budget!r}."
            )
        if self.wire not in ("allreduce", "compact"):
            raise ValueError(
                f"`wire` must be 'allreduce' (int32 indices merged by an all-reduce, as published) or 'compact'"
                f" (2-byte index codes all-gathered, fp16 values), got {self.wire!r}."
            )
