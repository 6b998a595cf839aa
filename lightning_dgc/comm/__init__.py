"""Collectives: the only package that calls ``torch.distributed``.

An algorithm's exchange talks to a :class:`Collectives` object, never to ``torch.distributed``:

* :class:`TorchCollectives` runs the collectives on a process group (gloo, NCCL);
* :class:`LocalCollectives` simulates ``N`` ranks in one process (one thread per rank, see
  :func:`simulate`), so that an exchange can be unit-tested on the CPU without a process group.

The step's collectives and their order (:mod:`~lightning_dgc.comm.collectives`), simulated ranks
(:mod:`~lightning_dgc.comm.local`), the two levels of a two-level exchange (:mod:`~lightning_dgc.comm.topology`),
and blocking helpers for setup, checks and checkpoints and a clean end of the process group
(:mod:`~lightning_dgc.comm.process`).
"""

from __future__ import annotations

from lightning_dgc.comm.collectives import (
    DEVICE_FUTURES_TORCH,
    CollectiveError,
    Collectives,
    GradBucket,
    Pending,
    TimedCollectives,
    TorchCollectives,
    when_all,
    world_size_and_rank,
)
from lightning_dgc.comm.local import LocalCollectives, LocalGroup, simulate, simulate_nodes
from lightning_dgc.comm.process import (
    all_gather_host,
    all_gather_object,
    average,
    broadcast_,
    bucket_assignment,
    destroy_process_group,
    destroy_process_group_at_exit,
    gather_object,
    gather_tensors,
    host_group,
    host_key,
)
from lightning_dgc.comm.topology import (
    Topology,
    check_hierarchical,
    check_node_layout,
    resolve_hierarchical,
    topology_signature,
    two_level_topology,
)

__all__ = [
    "CollectiveError",
    "Collectives",
    "DEVICE_FUTURES_TORCH",
    "GradBucket",
    "LocalCollectives",
    "LocalGroup",
    "Pending",
    "TimedCollectives",
    "Topology",
    "TorchCollectives",
    "all_gather_host",
    "all_gather_object",
    "average",
    "broadcast_",
    "bucket_assignment",
    "check_hierarchical",
    "check_node_layout",
    "destroy_process_group",
    "destroy_process_group_at_exit",
    "gather_object",
    "gather_tensors",
    "host_group",
    "host_key",
    "resolve_hierarchical",
    "simulate",
    "simulate_nodes",
    "topology_signature",
    "two_level_topology",
    "when_all",
    "world_size_and_rank",
]
