"""The exchange state's files: every rank writes its own, beside the checkpoint, and rank 0's file names them.

Layout of a checkpoint ``<path>`` (``trainer.save_checkpoint``, ``ModelCheckpoint``, ``fabric.save``)::

    <path>                                   what DDP's checkpoint holds, plus the manifest (checkpoint["lightning_dgc"])
    <path>.exchange/rank-00000.<save>.pt     rank 0's exchange state (ExchangeState.state_dict())
    <path>.exchange/rank-00001.<save>.pt     ...

``<save>`` is new at every save (the step and a random tag), so a save killed part-way never overwrites the
files the previous checkpoint at ``path`` names: the rank files are written first, then the manifest, with
each file's SHA-256 and size, in rank 0's file; rank 0 then deletes the files of earlier saves. A reader checks
every file it reads against the manifest. Files go through Lightning's ``CheckpointIO`` (remote storage), or
straight to disk through :func:`~lightning_dgc.checkpoint.files.save_atomically` for a local path.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
from typing import Any

import torch

from lightning_dgc.checkpoint.files import is_local, read_checkpoint, save_atomically
from lightning_dgc.exchange.entry import CHECKPOINT_KEY

#: The folder of a checkpoint's rank files is the checkpoint's path with this suffix.
FOLDER_SUFFIX = ".exchange"
_CHUNK = 1 << 20  # the hash reads a file in pieces of 1 MiB


def folder_of(path: Any) -> str:
    """The folder of the rank files of checkpoint ``path``."""
    return f"{path}{FOLDER_SUFFIX}"


def rank_file_name(rank: int, save: str) -> str:
    return f"rank-{rank:05d}.{save}.pt"


def join(folder: str, name: str) -> str:
    """``folder/name`` for a local path or a URL (``s3://...``) alike."""
    return posixpath.join(folder, name) if "://" in folder else os.path.join(folder, name)


def sibling(path: Any, name: str) -> str:
    """``name`` in the folder that holds ``path``."""
    path = str(path)
    return posixpath.join(posixpath.dirname(path), name) if "://" in path else os.path.join(os.path.dirname(path), name)


class FileIO:
    """How rank files are written and read: straight to disk for a local path under Lightning's default
    ``TorchCheckpointIO`` (no copy of the state in memory), else through the strategy's ``CheckpointIO``."""

    def __init__(self, checkpoint_io: Any, storage_options: Any = None) -> None:
        self.checkpoint_io = checkpoint_io
        self.storage_options = storage_options

    def direct(self, path: Any) -> bool:
        from lightning.fabric.plugins import TorchCheckpointIO

        io = self.checkpoint_io
        return (io is None or type(io) is TorchCheckpointIO) and self.storage_options is None and is_local(path)

    def save(self, obj: dict[str, Any], path: Any, record: bool = True) -> dict[str, Any] | None:
        """Write ``obj`` to ``path``; its manifest record ``{"name", "sha256", "bytes"}`` (``record=False``: none)."""
        if self.direct(path):
            save_atomically(obj, path)
        else:
            self.checkpoint_io.save_checkpoint(obj, path, storage_options=self.storage_options)
        if not record:
            return None
        sha256, size = digest(path)
        return {"name": posixpath.basename(str(path).replace(os.sep, "/")), "sha256": sha256, "bytes": size}

    def load(self, path: str) -> dict[str, Any]:
        if self.direct(path):
            return read_checkpoint(lambda: torch.load(path, map_location="cpu", weights_only=True), path)
        return read_checkpoint(lambda: self.checkpoint_io.load_checkpoint(path, map_location="cpu"), path)

    def remove(self, path: str) -> None:
        """Delete ``path`` (a file or a folder), if it exists."""
        from lightning.fabric.utilities.cloud_io import get_filesystem

        fs = get_filesystem(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)

    def remove_unnamed(self, folder: str, keep: set[str]) -> None:
        """Delete every entry of ``folder`` whose name is not in ``keep`` (the files of earlier saves)."""
        from lightning.fabric.utilities.cloud_io import get_filesystem

        fs = get_filesystem(folder)
        if not fs.exists(folder):
            return
        for entry in fs.ls(folder, detail=False):
            if posixpath.basename(str(entry).rstrip("/")) not in keep:
                fs.rm(entry, recursive=True)


def digest(path: Any) -> tuple[str, int]:
    """The SHA-256 (hex) and the size in bytes of the file at ``path``."""
    from lightning.fabric.utilities.cloud_io import get_filesystem

    sha, size = hashlib.sha256(), 0
    with get_filesystem(path).open(str(path), "rb") as file:
        while chunk := file.read(_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return sha.hexdigest(), size


def check_file(path: str, record: dict[str, Any]) -> str | None:
    """What is wrong with the rank file at ``path`` against its manifest ``record`` (``None``: it matches)."""
    from lightning.fabric.utilities.cloud_io import get_filesystem

    if not get_filesystem(path).exists(path):
        return f"the rank file {path!r} is missing"
    sha256, size = digest(path)
    if size != record["bytes"]:
        return (
            f"the rank file {path!r} has {size} bytes, the manifest says {record['bytes']}: it is truncated (its writer"
            " was killed, the disk was full, a copy did not finish) or from another save"
        )
    if sha256 != record["sha256"]:
        return (
            f"the rank file {path!r} does not match the manifest's SHA-256: it is from another save or run, or"
            " damaged"
        )
    return None


def check_manifest(entry: dict[str, Any]) -> None:
    """Raise a ``ValueError`` naming the part of a manifest (a ``"lightning_dgc"`` entry of format 3) that is malformed."""
    key = f"checkpoint[{CHECKPOINT_KEY!r}]"
    fix = f" Resume from an unmodified checkpoint, or delete {key} to start the exchange with empty buffers."
    for field, kind in (("algorithm", str), ("world_size", int), ("step", int), ("folder", str)):
        value = entry.get(field)
        if not isinstance(value, kind) or isinstance(value, bool):
            got = "nothing" if field not in entry else f"a {type(value).__name__}"
            raise ValueError(f"{key}[{field!r}] must be a {kind.__name__}, found {got}.{fix}")
    world, files, topology = entry["world_size"], entry.get("files"), entry.get("topology")
    if not isinstance(topology, dict) or int(topology.get("nodes", 0)) * int(topology.get("per_node", 0)) != world:
        raise ValueError(f"{key}['topology'] must describe the world_size={world} ranks that wrote it, found {topology!r}.{fix}")
    if files is None:
        return
    if not isinstance(files, list) or len(files) != world:
        count = len(files) if isinstance(files, list) else type(files).__name__
        raise ValueError(f"{key} says it was written by world_size={world} ranks but names {count} rank files.{fix}")
    for r, record in enumerate(files):
        if not (
            isinstance(record, dict) and isinstance(record.get("name"), str) and isinstance(record.get("sha256"), str)
            and isinstance(record.get("bytes"), int)
        ):  # fmt: skip
            raise ValueError(f"{key}['files'][{r}] must be a dict with 'name', 'sha256' and 'bytes'.{fix}")
