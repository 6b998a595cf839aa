"""A bucket's plan in a two-level exchange (:func:`lightning_dgc.exchange.hook.exchange`, ``state.topology``): how this
rank's shard is cut (:mod:`lightning_dgc.exchange.shards`), the algorithm's plan of it, and the bucket in the node
layout that the first collective inside the node sums."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from lightning_dgc.algorithms.base import TensorSpec, allgather_volume
from lightning_dgc.exchange import shards

if TYPE_CHECKING:
    from lightning_dgc.comm import Topology


class ShardPlanner(Protocol):
    """What a two-level plan needs of the exchange (:class:`~lightning_dgc.exchange.state.ExchangeState` has it): the
    two levels, and the algorithm's plan of this rank's shard."""

    topology: Topology | None

    def algorithm_plan(self, layout: list[TensorSpec], buffer: Tensor) -> Any: ...


class TwoLevelPlan:
    """A bucket's plan in a two-level exchange: its :class:`~lightning_dgc.exchange.shards.ShardLayout` for this
    rank and the algorithm's plan of this rank's shard (``inner``: ``None`` when the rank owns no piece of the
    bucket).

    It holds no buffer of the bucket's size: each exchange makes the node layout of the local gradient (freed once
    summed) and the all-gather's output (freed once the update is back in the bucket), so that the plans in force
    cost nothing beside the algorithm's payload buffers, and neither do the plans of DDP's first buckets in the
    step that replaces them.
    """

    def __init__(self, shard: shards.ShardLayout, inner: Any, bucket_layout: list[TensorSpec]) -> None:
        self.shard = shard
        #: The bucket's tensors, whole: any local rank's shard can be priced from it (``density="auto"`` prices
        #: the longest on every rank, so that every rank prices the same).
        self.bucket_layout = bucket_layout
        self.inner = inner
        self.layout: list[TensorSpec] = inner.layout if inner is not None else []
        self.dense_bytes: int = inner.dense_bytes if inner is not None else 0
        #: Bytes this rank's link inside the node carries per step: the reduce-scatter and the all-gather (a ring
        #: reduce-scatter moves what an all-gather does).
        self.node_link_bytes = allgather_volume(4 * shard.shard_numel, shard.parts) * 2

    @classmethod
    def make(cls, state: ShardPlanner, layout: list[TensorSpec], buffer: Tensor) -> TwoLevelPlan:
        topology = state.topology
        assert topology is not None
        shard = shards.shard_layout(layout, topology.per_node, topology.local_rank)
        # a rank that owns no piece of the bucket (tensors of fewer rows than ranks) only takes part in the
        # node's collectives: its group across the nodes owns nothing either; the algorithm plans a shard of
        # fp32 values on the bucket's device (uninitialised: only its size, type and device are read)
        like = torch.empty(shard.numel, dtype=torch.float32, device=buffer.device)
        inner = state.algorithm_plan(shard.pieces, like) if shard.pieces else None
        return cls(shard, inner, list(layout))

    def node_gradient(self, buffer: Tensor, scale: float) -> Tensor:
        """Step 1 of a two-level exchange: the local gradient ``buffer`` in the node layout, fp32, the loss
        ``scale`` divided out (a new tensor, which the reduce-scatter inside the node sums)."""
        node = torch.empty(self.shard.parts * self.shard.shard_numel, dtype=torch.float32, device=buffer.device)
        self.shard.to_node(buffer, node)
        if scale != 1.0:
            node.mul_(1.0 / scale)
        return node
