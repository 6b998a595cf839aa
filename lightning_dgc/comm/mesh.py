"""The device mesh of a sharded model across nodes: FSDP2 inside each node, the compressed exchange across nodes.

:func:`sharded_mesh` lays the ranks out as ``(replicate, data_parallel, tensor_parallel)`` =
``(nodes, per_node, 1)``: ``mesh["data_parallel"]`` is this rank's node (what a ``LightningModule`` written for
Lightning's ``ModelParallelStrategy`` passes to ``fully_shard``), ``mesh["replicate"]`` the ranks that hold the same
shard, one per node (what the exchange runs over), and ``tensor_parallel`` is of size 1 (names that such modules
index keep working). :func:`mesh_topology` gives the two groups as a :class:`~lightning_dgc.comm.Topology`.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from lightning_dgc.comm.collectives import TorchCollectives
from lightning_dgc.comm.topology import Topology

__all__ = ["MESH_DIMS", "across_host_group", "mesh_topology", "shard_group_ranks", "sharded_mesh"]

#: The mesh's dimension names, outermost first.
MESH_DIMS = ("replicate", "data_parallel", "tensor_parallel")


def sharded_mesh(nodes: int, per_node: int, device_type: str) -> Any:
    """The ``(nodes, per_node, 1)`` device mesh of :data:`MESH_DIMS` (blocking; every rank calls it: it makes the
    mesh's process groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (nodes, per_node, 1), mesh_dim_names=MESH_DIMS)


def mesh_topology(mesh: Any) -> Topology:
    """This rank's view of ``mesh`` (:func:`sharded_mesh`): its node's ranks and the ranks across the nodes."""
    nodes, per_node = mesh.size(0), mesh.size(1)
    node_rank, local_rank = mesh.get_local_rank("replicate"), mesh.get_local_rank("data_parallel")
    return Topology(
        nodes, per_node, node_rank, local_rank,
        TorchCollectives(mesh.get_group("data_parallel")), TorchCollectives(mesh.get_group("replicate")),
    )  # fmt: skip


def shard_group_ranks(group: Any) -> list[int]:
    """The global ranks of a process group (a sharded module's shard group), in group order."""
    return list(dist.get_process_group_ranks(group))


def across_host_group(topology: Topology, rank: int) -> Any:
    """A process group of the ranks that hold this rank's shard (one per node) whose collectives run on CPU tensors:
    the mesh's own under gloo, a gloo group beside NCCL's otherwise (blocking; every rank calls it)."""
    across = topology.across
    if dist.get_backend() == dist.Backend.GLOO:
        return getattr(across, "group", None)
    mine = None
    for local in range(topology.per_node):  # every rank creates every group (torch.distributed requires it)
        group = dist.new_group([n * topology.per_node + local for n in range(topology.nodes)], backend="gloo")
        if local == rank % topology.per_node:
            mine = group
    return mine
