"""Run a function in N real processes joined by a gloo process group (no Lightning)."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo  # noqa: F401  (DDP imports it when constructed: once here, not in every forked child)
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world_size: int, port: int, fn: Callable[..., Any], out_dir: str, kwargs: dict
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    if kwargs.get("device", "cpu") != "cpu":
        torch.cuda.set_device(torch.device(kwargs["device"]))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, **kwargs)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int = 2, **kwargs: Any) -> list[Any]:
    """Call ``fn(rank, world_size, **kwargs)`` in ``world_size`` processes joined by gloo; return their results.

    Forked, not spawned: children inherit the imported modules, which saves seconds per test.
    The children run single-threaded, so the parent's OpenMP pool is never used after the fork.
    With ``device="cuda..."`` in ``kwargs`` the children are spawned (CUDA cannot be used after a
    fork) and share that GPU, still over gloo (NCCL refuses two ranks on one device).
    """
    if dist.is_initialized():  # a one-process group an earlier test in this process left (a forked child inherits it)
        dist.destroy_process_group()
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _worker,
            args=(world_size, _free_port(), fn, out_dir, kwargs),
            nprocs=world_size,
            join=True,
            start_method="fork" if kwargs.get("device", "cpu") == "cpu" else "spawn",
        )
        return [
            torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)
        ]
