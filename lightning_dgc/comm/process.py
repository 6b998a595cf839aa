"""Blocking helpers for setup, checks and checkpoints (gathering objects and tensors on the process group), the
bucket layout DDP builds, and ending the process group cleanly at exit. Never on the hot path."""

from __future__ import annotations

import atexit
import gc
import os
import socket
import sys
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dgc.comm.collectives import _failed, world_size_and_rank


# -- setup, checkpoints and exit (blocking; never on the hot path) ----------------------------------------
def all_gather_object(obj: object, group: dist.ProcessGroup | None = None) -> list[object]:
    """Every rank's ``obj`` (blocking; for setup-time consistency checks, never per step)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def host_group() -> dist.ProcessGroup | None:
    """A process group of every rank whose collectives run on CPU tensors (blocking; every rank calls it):
    the default group under gloo, a gloo group beside NCCL's otherwise. ``None`` also when not distributed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() == dist.Backend.GLOO:
        return None
    return dist.new_group(backend="gloo")


def all_gather_host(
    tensor: Tensor, group: dist.ProcessGroup | None = None, what: str = "all-gather of the ranks' settings"
) -> list[Tensor]:
    """Every rank's copy of a small CPU ``tensor`` over a :func:`host_group` (blocking; no device synchronisation).

    A peer lost meanwhile is a :class:`CollectiveError`, as in the step's own collectives."""
    if not (dist.is_available() and dist.is_initialized()):
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(out, tensor, group=group)
    except RuntimeError as error:  # gloo's and NCCL's errors (DistBackendError is one)
        raise _failed(what, dist.get_rank(), error) from error
    return out


def gather_object(obj: object, dst: int = 0, group: dist.ProcessGroup | None = None) -> list[object] | None:
    """Every rank's ``obj`` on rank ``dst`` (``None`` elsewhere); blocking, for checkpoints only."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[object] | None = [None] * dist.get_world_size(group) if dist.get_rank(group) == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def gather_tensors(
    tensors: Sequence[Tensor], dst: int = 0, group: dist.ProcessGroup | None = None, copy_own: bool = True
) -> list[list[Tensor]] | None:
    """Every rank's copy of each tensor, as CPU tensors on rank ``dst`` (``None`` elsewhere); blocking.

    For checkpoints, with as little memory as possible: tensor by tensor, point to point, so that a rank
    other than ``dst`` sends its tensors as they are (a device tensor straight from the device with NCCL;
    with gloo, brought to the CPU one at a time), and ``dst`` holds only what it received plus its own
    tensors: copies, or with ``copy_own=False`` on the CPU the tensors themselves (for a caller that is
    done with them before they change, e.g. one that writes them to a file synchronously).
    Every rank must pass tensors of the same shapes and dtypes in the same order.
    """
    world, rank = world_size_and_rank(group)
    if world == 1:
        return [[t.detach().cpu().clone()] for t in tensors]
    on_cpu = dist.get_backend(group) == dist.Backend.GLOO
    peer = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    out: list[list[Tensor]] = []
    for tensor in tensors:
        source = tensor.detach()
        source = (source.cpu() if on_cpu else source).contiguous()
        if rank != dst:
            dist.send(source, peer(dst), group=group)
            continue
        copies = []
        for r in range(world):
            if r == dst:
                own = source.cpu()
                copies.append(own.clone() if copy_own and own.data_ptr() == tensor.data_ptr() else own)
            else:
                received = torch.empty_like(source)
                dist.recv(received, peer(r), group=group)
                copies.append(received.cpu())
        out.append(copies)
    return out if rank == dst else None


def average(tensor: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """``tensor`` replaced, in place, by its mean over ranks (blocking; not for the hot path)."""
    world, _ = world_size_and_rank(group)
    if world > 1:
        dist.all_reduce(tensor, group=group)
        tensor.div_(world)
    return tensor


def broadcast_(tensors: Sequence[Tensor], src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Every tensor replaced, in place, by rank ``src``'s (blocking; not for the hot path)."""
    world, _ = world_size_and_rank(group)
    if world > 1:
        for tensor in tensors:
            dist.broadcast(tensor, src, group=group)


def bucket_assignment(tensors: Sequence[Tensor], caps: Sequence[int]) -> list[list[int]]:
    """The buckets DDP builds for ``tensors`` (in the order given) with these byte caps: indices per bucket."""
    groups, _ = dist._compute_bucket_assignment_by_size(list(tensors), list(caps), [False] * len(tensors))
    return [list(group) for group in groups]


def destroy_process_group() -> None:
    """End the default process group cleanly (a no-op when none is initialised).

    A process that exits with a gloo process group still alive can abort at interpreter exit
    (``terminate called without an active exception``): gloo's worker threads still hold finished
    work, and its tensors, while the interpreter is torn down. Ending the group first avoids that.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _destroy_at_exit() -> None:
    # After an uncaught exception (a peer died, say) collectives may still be pending on a dead peer,
    # and ending the group would wait for them: exit at once instead, as the exception demands.
    if getattr(sys, "last_value", None) is None:
        # Free unreachable DDP wrappers (their reducers, comm hook states and futures) while the
        # interpreter and the group are still whole: a launcher that built several (one Fabric per
        # phase, say) leaves them in reference cycles, to be torn down during finalization otherwise.
        gc.collect()
        destroy_process_group()


_destroy_registered = False


def destroy_process_group_at_exit() -> None:
    """Register, once per process, :func:`destroy_process_group` to run at interpreter exit.

    At exit rather than in the strategy's teardown: a Trainer keeps its process group between
    ``fit`` and a later ``validate`` or ``test`` (Lightning initialises it only once).
    """
    global _destroy_registered
    if not _destroy_registered:
        atexit.register(_destroy_at_exit)
        _destroy_registered = True


def host_key() -> float:
    """This process's host and network namespace as a number (exact in float64, for an all-gather): ranks with the
    same key exchange without a network link between them. Processes in other network namespaces of one machine
    (joined by a shaped veth, as the benchmarks do) get other keys."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/net"):
        try:
            parts.append(Path(path).read_text().strip() if path.endswith("boot_id") else str(os.stat(path).st_ino))
        except OSError:
            parts.append("")
    return float(zlib.crc32("|".join(parts).encode()))
