"""The two levels of a two-level exchange: the ranks of a node and the ranks across nodes (:class:`Topology`),
and the ``hierarchical`` option that asks for it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from lightning_dgc.comm.collectives import Collectives, TorchCollectives


# -- two levels: the ranks of a node, and the ranks across nodes ------------------------------------------
@dataclass(frozen=True)
class Topology:
    """A two-level exchange's view from one rank: ``nodes`` nodes of ``per_node`` ranks each.

    ``node``: the collectives of the ``per_node`` ranks of this rank's node (the fast local bus);
    ``across``: those of the ``nodes`` ranks that share this rank's local rank, one per node (the
    slow links). Global rank ``r`` is local rank ``r % per_node`` of node ``r // per_node``.
    """

    nodes: int
    per_node: int
    node_rank: int
    local_rank: int
    node: Collectives
    across: Collectives

    @property
    def signature(self) -> dict[str, Any]:
        """What a checkpoint records of the topology (see :func:`topology_signature`)."""
        return topology_signature(self.nodes * self.per_node, self.nodes, self.per_node, True)


def topology_signature(world_size: int, nodes: int, per_node: int, hierarchical: bool) -> dict[str, Any]:
    """``{"hierarchical": bool, "nodes": ..., "per_node": ...}``: what decides where each memory buffer
    lives (a flat run's memory is per rank whatever the nodes: it is recorded as ``world_size`` nodes of 1)."""
    if not hierarchical:
        return {"hierarchical": False, "nodes": world_size, "per_node": 1}
    return {"hierarchical": True, "nodes": nodes, "per_node": per_node}


def check_hierarchical(option: Any) -> Any:
    """``option`` if it is a value of ``hierarchical`` (``"auto"``, ``True``, ``False``), else a ``ValueError``."""
    if option not in ("auto", True, False) or (option in (0, 1) and not isinstance(option, bool)):
        raise ValueError(f"hierarchical must be 'auto', True or False, got {option!r}.")
    return option


def resolve_hierarchical(option: Any, num_nodes: int, world_size: int) -> bool:
    """Whether to run the two-level exchange for ``hierarchical=option`` (``"auto"``, ``True``, ``False``).

    ``"auto"``: when there is more than one node and more than one rank per node. Raises a
    ``ValueError`` for another value, for ``True`` on one node and for ranks that do not divide evenly
    into the nodes.
    """
    check_hierarchical(option)
    if option is False:
        return False
    if num_nodes < 1 or world_size % num_nodes:
        raise ValueError(
            f"hierarchical={option!r}: {world_size} processes do not divide evenly into {num_nodes} nodes; the"
            " two-level exchange needs the same number of devices on every node. Start every node with the same"
            " `devices` (torchrun --nproc-per-node, SLURM --ntasks-per-node), or pass hierarchical=False."
        )
    per_node = world_size // num_nodes
    if option is True and num_nodes < 2:
        raise ValueError(
            f"hierarchical=True needs more than one node, but this run has num_nodes={num_nodes}: inside one node"
            " there are no slow links to save. Set Trainer(num_nodes=...) to the number of nodes, or pass"
            " hierarchical='auto' (or False)."
        )
    return option is True or (num_nodes > 1 and per_node > 1)


def check_node_layout(
    ranks: Sequence[tuple[int, int, int]], nodes: int, what: str = "hierarchical: the two-level exchange",
    otherwise: str = ", or pass hierarchical=False",
) -> int:  # fmt: skip
    """``per_node`` for every rank's ``(global_rank, node_rank, local_rank)``, or a ``ValueError`` when the
    ranks are not ``nodes`` nodes of equally many ranks numbered node by node (rank = node * per_node + local);
    ``what`` needs that layout, ``otherwise`` is the fix besides a launch that gives it."""
    world = len(ranks)
    counts: dict[int, int] = {}
    for _, node, _ in ranks:
        counts[node] = counts.get(node, 0) + 1
    if len(counts) != nodes or len(set(counts.values())) != 1:
        raise ValueError(
            f"{what} needs the same number of devices on every node, but the"
            f" {world} processes report these nodes (node_rank: processes): {dict(sorted(counts.items()))},"
            f" with num_nodes={nodes}. Start every node with the same number of processes{otherwise}."
        )
    per_node = world // nodes
    wrong = [r for r in ranks if r[0] != r[1] * per_node + r[2]]
    if wrong:
        raise ValueError(
            f"{what} needs global ranks numbered node by node (rank = node_rank * {per_node} +"
            f" local_rank), but (rank, node_rank, local_rank) = {wrong[0]}. Use the launcher's default rank"
            f" assignment{otherwise}."
        )
    return per_node


def two_level_topology(nodes: int, per_node: int, rank: int) -> Topology:
    """The process groups of a two-level exchange (blocking; every rank must call it, in the same order)."""
    node_rank, local_rank = divmod(rank, per_node)
    node_group = across_group = None
    for n in range(nodes):  # every rank creates every group (torch.distributed requires it)
        group = dist.new_group([n * per_node + i for i in range(per_node)])
        if n == node_rank:
            node_group = group
    for i in range(per_node):
        group = dist.new_group([n * per_node + i for n in range(nodes)])
        if i == local_rank:
            across_group = group
    return Topology(
        nodes, per_node, node_rank, local_rank, TorchCollectives(node_group), TorchCollectives(across_group)
    )


