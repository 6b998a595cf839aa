"""File primitives of checkpoints: a local path told apart, a file written atomically (its partial files of
killed writers removed), a checkpoint read with a clear error when it is incomplete."""

from __future__ import annotations

import glob
import os
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem


# Lightning is imported where it is used: importing it registers the strategy names, whose modules import this
# one, so that ``from lightning_dgc.checkpoint.files import ...`` as a program's first import would find it half-made.
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
