"""``density="auto"`` under the two-level exchange (``state.topology``): what the decision prices, and the layout of
nodes on hosts it needs.

In two levels the density changes only the exchange across nodes: the dense reduce-scatter and all-gather inside
the node are paid at every density. So the measuring phase times the collectives across nodes alone (the state's
``collectives`` are those of the ranks that share this rank's local rank, one per node, and only they are timed),
and :func:`priced_buckets` prices one shard of every bucket across the ``nodes`` ranks of its group: the longest
(:func:`longest_shard`, which the other local ranks wait for), whatever the rank. With the figures every rank
gathers, every rank of every node prices the same buckets on the same link and picks the same density. The local ranks of a node exchange their shards across nodes at once, through the node's
link: each one's measured throughput is its share of it, the share its own shard then gets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_dgc.algorithms import TensorSpec
from lightning_dgc.exchange import shards
from lightning_dgc.exchange.two_level import TwoLevelPlan

__all__ = ["check_nodes_on_hosts", "longest_shard", "priced_buckets"]

#: Bytes per value of a shard: the two-level exchange sums and sends the node's gradient in fp32.
SHARD_VALUE_BYTES = 4


def priced_buckets(plans: Sequence[Any]) -> list[tuple[list[TensorSpec], int]]:
    """What the decision prices for each plan in force: a flat bucket's tensors and its dense bytes; for a
    two-level plan, the longest shard of the bucket (:func:`longest_shard`: its pieces, and their bytes in fp32),
    the same on every rank (pure)."""
    out: list[tuple[list[TensorSpec], int]] = []
    for plan in plans:
        if isinstance(plan, TwoLevelPlan):
            pieces = longest_shard(plan.bucket_layout, plan.shard.parts)
            out.append((pieces, SHARD_VALUE_BYTES * sum(p.numel for p in pieces)))
        else:
            out.append((list(plan.layout), plan.dense_bytes))
    return out


def longest_shard(layout: Sequence[TensorSpec], parts: int) -> list[TensorSpec]:
    """The pieces of the longest of the ``parts`` shards of a bucket of ``layout`` (the first of equals), whose
    exchange across nodes the others wait for (pure)."""
    every = [shards.shard_pieces(layout, parts, i) for i in range(parts)]
    return max(every, key=lambda pieces: sum(p.numel for p in pieces))


def check_nodes_on_hosts(host_keys: Sequence[float], per_node: int, owner: str) -> None:
    """A ``ValueError`` when the processes of one node (global ranks ``n * per_node`` to ``(n + 1) * per_node - 1``)
    run on more than one host (:func:`lightning_dgc.comm.host_key`, gathered from every rank in rank order): the
    node's dense exchange would then cross a network link that ``density="auto"`` neither times nor prices, and
    the density it picks for the link across nodes would not say what the run waits for (pure)."""
    for start in range(0, len(host_keys), per_node):
        if len(set(host_keys[start : start + per_node])) > 1:
            node = start // per_node
            raise ValueError(
                f"{owner}: density='auto' with the two-level exchange needs the processes of each node on one"
                f" machine, but those of node {node} (global ranks {start} to {start + per_node - 1}) run on"
                " different hosts or network namespaces, so the dense exchange inside the node crosses a network"
                " link that density='auto' does not price. Launch each node's processes on one machine"
                " (Trainer(num_nodes=...) the number of machines, devices= the processes on each), or pass a"
                " fixed density (e.g. density=0.01), or hierarchical=False."
            )
