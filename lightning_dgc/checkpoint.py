"""Checkpoint I/O of the exchange state: every rank's memory gathered into the file rank 0 writes.

Shared by the Trainer strategy (:mod:`lightning_dgc.strategy`) and the Fabric strategy
(:mod:`lightning_dgc.fabric`). The entry under :data:`CHECKPOINT_KEY` holds the algorithm's name, the
format, the world size and one state per rank (:meth:`ExchangeState.state_dict`); a resume on another
world size gives every rank the mean (:func:`lightning_dgc.state.state_for_rank`).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem

from lightning_dgc import comm
from lightning_dgc.state import CHECKPOINT_KEY, ExchangeState, check_checkpoint_entry

__all__ = ["CHECKPOINT_FORMAT", "CHECKPOINT_KEY", "check_entry", "gather_exchange_state", "restore_exchange_state"]
#: Version of that entry. 2: the checkpoint's optimizer state holds the user's SGD hyper-parameters and
#: momentum (absent: written before, with the take-over's zeros there).
CHECKPOINT_FORMAT = 2


# Lightning is imported where it is used: importing it registers the strategy names, whose modules import this
# one, so that ``from lightning_dgc.checkpoint import ...`` as a program's first import would find it half-made.
def is_local(path: Any) -> bool:
    from lightning.fabric.utilities.cloud_io import get_filesystem

    return isinstance(get_filesystem(path), LocalFileSystem)


def rank_zero_warn(message: str) -> None:
    from lightning.fabric.utilities.rank_zero import rank_zero_warn as warn

    warn(message, stacklevel=5)  # as a direct call would (its default, 4), one frame up


def save_atomically(checkpoint: dict[str, Any], filepath: Any) -> None:
    """``torch.save`` straight into a temporary file beside ``filepath``, then renamed over it.

    As atomic as Lightning's ``TorchCheckpointIO`` (a crash leaves the previous file or none), but
    without serialising the whole checkpoint into memory first: the exchange's memory makes a
    checkpoint ``2 x world_size`` model sizes larger than DDP's, and that buffer would double it.
    """
    path = Path(filepath)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        torch.save(checkpoint, partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def read_checkpoint(load: Callable[[], dict[str, Any]], path: Any) -> dict[str, Any]:
    """``load()`` (a checkpoint I/O's read of ``path``); if it fails on a file that is not a whole checkpoint
    archive (truncated: its writer was killed, the disk was full, a copy did not finish), a ``RuntimeError``
    naming the file and the fix instead of torch's bare reader error. Other failures are raised as they are."""
    try:
        return load()
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except (RuntimeError, EOFError, OSError) as error:
        if not _is_incomplete(path):
            raise
        raise RuntimeError(
            f"The checkpoint {str(path)!r} is incomplete or damaged, not a whole checkpoint archive (its writer was"
            " killed, the disk was full, or a copy did not finish), and cannot be resumed from"
            f" ({type(error).__name__}: {error}). Resume from an earlier checkpoint (ckpt_path=<another file>), or"
            " delete this file: with ckpt_path='last', Lightning then takes the newest other '*last*' checkpoint"
            " of the folder, or starts afresh if there is none."
        ) from error


def _is_incomplete(path: Any) -> bool:
    """Whether ``path`` exists but lacks the end of a zip archive (every ``torch.save`` file has it)."""
    from lightning.fabric.utilities.cloud_io import get_filesystem

    try:
        with get_filesystem(path).open(str(path), "rb") as file:
            return not zipfile.is_zipfile(file)
    except OSError:
        return False


def remove_stale_partials(path: Path) -> list[Path]:
    """Delete the temporary files of ``path`` (``.<name>.<pid>.partial``, :func:`save_atomically`) whose writing
    process is no longer alive on this machine: left behind by a process killed while it saved. Returns them.

    Only one process writes a given checkpoint at a time (rank 0), so any other writer of it is dead; a file
    whose process id is alive here is left alone (on a shared file system it may belong to another machine's
    process, and is then removed by a save on that machine).
    """
    stale: list[Path] = []
    if os.name != "posix":  # os.kill(pid, 0) would end the process elsewhere
        return stale
    for partial in path.parent.glob(f".{glob.escape(path.name)}.*.partial"):
        pid = partial.name[len(path.name) + 2 : -len(".partial")]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            partial.unlink(missing_ok=True)
            stale.append(partial)
    return stale


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def gather_exchange_state(
    state: ExchangeState, algorithm: str, world_size: int, owner: str, copy_own: bool = True
) -> dict[str, Any] | None:
    """Every rank's exchange state, gathered into rank 0 tensor by tensor (all ranks call this).

    Returns the checkpoint entry on rank 0, ``None`` on the other ranks (their buffers were sent as
    they are, without copies). ``owner`` is the strategy's class name, used in messages. ``copy_own=False``:
    rank 0's own CPU buffers go into the entry as they are (for a file written before training goes on).
    """
    committed = state.memory.committed
    keys = sorted((kind, name) for kind, by_name in committed.items() for name in by_name)
    layout = [(kind, name, list(committed[kind][name].shape)) for kind, name in keys]
    digest = hashlib.sha256(json.dumps(layout).encode()).hexdigest()
    if state.topology is not None:
        return _gather_two_level_state(state, algorithm, world_size, owner, digest)
    if len(set(comm.all_gather_object(digest))) != 1:
        raise RuntimeError(
            f"{owner}: the ranks hold memory for different parameters and cannot write one"
            " checkpoint; every rank must train the same model."
        )
    metadata = comm.gather_object(state.state_dict(memory=False))
    gathered = comm.gather_tensors([committed[kind][name] for kind, name in keys], copy_own=copy_own)
    if metadata is None or gathered is None:
        return None
    ranks = []
    for r, meta in enumerate(metadata):
        memory: dict[str, dict[str, torch.Tensor]] = {kind: {} for kind in committed}
        for (kind, name), copies in zip(keys, gathered, strict=True):
            memory[kind][name] = copies[r]
        ranks.append({**meta, "memory": memory})  # type: ignore[dict-item]
    return _entry(state, algorithm, world_size, ranks)


def _entry(state: ExchangeState, algorithm: str, world_size: int, ranks: list[Any]) -> dict[str, Any]:
    return {
        "algorithm": algorithm,
        "format": CHECKPOINT_FORMAT,
        "world_size": world_size,
        "topology": state.topology_signature,
        "ranks": ranks,
    }


def _gather_two_level_state(
    state: ExchangeState, algorithm: str, world_size: int, owner: str, digest: str
) -> dict[str, Any] | None:
    """:func:`gather_exchange_state` of a two-level exchange, whose ranks hold different pieces: the ranks
    sharing a local rank must agree, and each rank's state travels as one object."""
    assert state.topology is not None
    if len(set(comm.all_gather_object((state.topology.local_rank, digest)))) != state.topology.per_node:
        raise RuntimeError(
            f"{owner}: the ranks hold memory for different parameters and cannot write one"
            " checkpoint; every rank must train the same model."
        )
    ranks = comm.gather_object(state.state_dict())
    return None if ranks is None else _entry(state, algorithm, world_size, ranks)


def check_entry(entry: dict[str, Any] | None, algorithm: str, owner: str, has_optimizer_state: bool) -> bool:
    """Check a checkpoint's exchange entry against the strategy's algorithm before it is restored.

    Warns when there is none but there is optimizer state (another strategy wrote the checkpoint);
    raises for another algorithm's entry. Returns whether the entry is of a format written before the
    checkpoint kept the user's SGD hyper-parameters (a "legacy" checkpoint). A malformed entry is an error
    that names the part (:func:`lightning_dgc.state.check_checkpoint_entry`).
    """
    if entry is not None:
        check_checkpoint_entry(entry)
    if entry is None and has_optimizer_state:
        rank_zero_warn(
            f"The checkpoint holds no {owner} state (it was written by another strategy):"
            " its SGD momentum buffers continue as the exchange's momentum, and the residuals start empty."
        )
    elif entry is not None and entry.get("algorithm") != algorithm:
        found = entry.get("algorithm")
        raise ValueError(
            f"This checkpoint holds the exchange state of {found!r}, not {algorithm!r}: its residuals mean"
            f" something else here. Resume with strategy={found!r}, or delete the checkpoint's"
            f" {CHECKPOINT_KEY!r} entry to start {algorithm!r} with empty buffers."
        )
    elif entry is not None and "format" not in entry:
        rank_zero_warn(
            "This checkpoint was written by an earlier lightning-dgc, whose optimizer state holds 0 for the SGD"
            " momentum and weight decay that the exchange applied: they are taken from configure_optimizers()."
        )
        return True
    return False


def restore_exchange_state(state: ExchangeState, entry: dict[str, Any], device: torch.device) -> None:
    """Load this rank's part of a checkpoint entry into ``state`` (the mean of all ranks' on another world size).

    A collective: every rank checks what it loads (:meth:`ExchangeState.restore`), and a problem on any rank
    is raised on every rank before the first step, never a silent reset.
    """
    if not state.restore(entry, device):
        return
    saved, topology = entry.get("topology"), state.topology_signature
    if topology["hierarchical"] or (saved or {}).get("hierarchical", False):
        rank_zero_warn(
            f"The checkpoint's exchange memory was laid out as {saved} and is resumed as {topology}: every"
            " node (every rank when flat) starts from the mean of the saved nodes' momentum and residual"
            " buffers, which keeps the pending update of the whole group and drops per-node detail."
        )
    else:
        rank_zero_warn(
            f"The checkpoint was written by {entry['world_size']} ranks and is resumed by {state.world_size}:"
            " every rank starts from the mean of the saved momentum and residual buffers, which keeps the"
            " pending update of the whole group and drops per-rank detail."
        )
