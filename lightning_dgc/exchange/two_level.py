"""A bucket's plan in a two-level exchange (:func:`lightning_dgc.exchange.hook.exchange`, ``state.topology``): how this
rank's shard is cut (:mod:`lightning_dgc.exchange.shards`), the algorithm's plan of it, and the buffers of the two
collectives inside the node."""

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
    rank, the algorithm's plan of this rank's shard (``inner``: ``None`` when the rank owns no piece of the
    bucket), and the buffers the two node-level collectives use."""

    def __init__(
        self, shard: shards.ShardLayout, inner: Any, node: Tensor, gathered: Tensor, bucket_layout: list[TensorSpec]
    ) -> None:
        self.shard = shard
        #: The bucket's tensors, whole: any local rank's shard can be priced from it (``density="auto"`` prices
        #: the longest on every rank, so that every rank prices the same).
        self.bucket_layout = bucket_layout
        self.inner = inner
        self.node = node  # parts * shard_numel: the bucket in the node layout (padding stays 0)
        self.gathered = gathered  # parts * shard_numel: every local rank's decoded shard
        self.decoded = torch.zeros(shard.shard_numel, dtype=torch.float32, device=node.device)  # this rank's
        self.layout: list[TensorSpec] = inner.layout if inner is not None else []
        self.dense_bytes: int = inner.dense_bytes if inner is not None else 0
        #: Bytes this rank's link inside the node carries per step: the reduce-scatter and the all-gather (a ring
        #: reduce-scatter moves what an all-gather does).
        self.node_link_bytes = allgather_volume(4 * shard.shard_numel, shard.parts) * 2

    @classmethod
    def make(cls, state: ShardPlanner, layout: list[TensorSpec], buffer: Tensor) -> TwoLevelPlan:
        topology = state.topology
        assert topology is not None
        shard = shards.shard_layout(layout, topology.per_node, topology.local_rank, buffer.device)
        node = torch.zeros(topology.per_node * shard.shard_numel, dtype=torch.float32, device=buffer.device)
        # a rank that owns no piece of the bucket (tensors of fewer rows than ranks) only takes part in the
        # node's collectives: its group across the nodes owns nothing either
        inner = state.algorithm_plan(shard.pieces, node[: shard.numel]) if shard.pieces else None
        return cls(shard, inner, node, torch.empty_like(node), list(layout))
