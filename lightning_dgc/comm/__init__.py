"""Collectives: the only module that calls ``torch.distributed``.

An algorithm's exchange talks to a :class:`Collectives` object, never to ``torch.distributed``:

* :class:`TorchCollectives` runs the collectives on a process group (gloo, NCCL);
* :class:`LocalCollectives` simulates ``N`` ranks in one process (one thread per rank, see
  :func:`simulate`), so that an exchange can be unit-tested on the CPU without a process group.

Every collective is started from the hook's thread, in bucket order, so that every rank issues the
same collectives in the same order (gloo matches collectives by the order in which a process starts
them; a collective started from a future's callback, which runs in a backend thread, could be
interleaved differently on different ranks). :meth:`Pending.wait` lets an exchange wait for one
step's result before it starts the next (with NCCL that orders the stream without a host
synchronisation; with gloo, and on the CPU, the host waits); :func:`when_all` runs the decode once
the last ones are done.

Beside the step's collectives: blocking helpers for setup and checkpoints (gathering objects and
tensors), the bucket layout DDP builds, and ending the process group cleanly.
"""

from __future__ import annotations

from lightning_dgc.comm.collectives import (
    DEVICE_FUTURES_TORCH,
    CollectiveError,
    Collectives,
    GradBucket,
    Pending,
    TorchCollectives,
    when_all,
    world_size_and_rank,
)
from lightning_dgc.comm.local import LocalCollectives, LocalGroup, simulate, simulate_nodes
from lightning_dgc.comm.process import (
    all_gather_host,
    all_gather_object,
    average,
    bucket_assignment,
    destroy_process_group,
    destroy_process_group_at_exit,
    gather_object,
    gather_tensors,
    host_group,
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
    "Topology",
    "TorchCollectives",
    "all_gather_host",
    "all_gather_object",
    "average",
    "bucket_assignment",
    "check_hierarchical",
    "check_node_layout",
    "destroy_process_group",
    "destroy_process_group_at_exit",
    "gather_object",
    "gather_tensors",
    "host_group",
    "resolve_hierarchical",
    "simulate",
    "simulate_nodes",
    "topology_signature",
    "two_level_topology",
    "when_all",
    "world_size_and_rank",
]
