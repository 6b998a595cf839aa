"""Checkpoint I/O of the exchange state: every rank's memory gathered into the file rank 0 writes.

Shared by the Trainer strategy (:mod:`lightning_dgc.front.strategy`) and the Fabric strategy
(:mod:`lightning_dgc.front.fabric`). The entry under :data:`CHECKPOINT_KEY` holds the algorithm's name, the
format, the world size and one state per rank (:meth:`ExchangeState.state_dict`); a resume on another
world size gives every rank the mean (:func:`lightning_dgc.exchange.entry.state_for_rank`).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch

from lightning_dgc import comm
from lightning_dgc.checkpoint import rank_files
from lightning_dgc.checkpoint.files import rank_zero_warn
from lightning_dgc.checkpoint.rank_files import FileIO, check_manifest
from lightning_dgc.exchange import shards
from lightning_dgc.exchange.entry import CHECKPOINT_KEY, check_checkpoint_entry
from lightning_dgc.exchange.state import ExchangeState

__all__ = [
    "CHECKPOINT_FORMAT", "CHECKPOINT_KEY", "FileIO", "check_entry", "inline_exchange_state", "restore_exchange_state",
    "save_exchange_state",
]  # fmt: skip
#: Version of that entry. 3: a manifest; every rank's state is in its own file beside the checkpoint
#: (:mod:`lightning_dgc.checkpoint.rank_files`). 2: every rank's state in the entry (``"ranks"``), the optimizer state with
#: the user's SGD hyper-parameters and momentum. Absent: as 2, with the take-over's zeros in the optimizer state.
CHECKPOINT_FORMAT = 3
#: The format of an entry that holds every rank's state itself (:func:`inline_exchange_state`).
SINGLE_FILE_FORMAT = 2


def is_manifest(entry: Any) -> bool:
    """Whether a checkpoint's exchange entry is a manifest of rank files (format 3), not the states themselves."""
    return isinstance(entry, dict) and "ranks" not in entry and isinstance(entry.get("format"), int) and entry["format"] >= 3


def save_exchange_state(
    state: ExchangeState,
    algorithm: str,
    path: Any,
    io: FileIO,
    owner: str,
    with_memory: bool = True,
) -> dict[str, Any] | None:
    """Every rank writes its exchange state into its own file beside checkpoint ``path`` (all ranks call this).

    Returns the manifest on rank 0 (``None`` elsewhere), once every rank's file is written: rank 0 writes it
    into its checkpoint file last. ``with_memory=False``: no rank files, a manifest without ``"files"`` (a resume
    then starts the exchange with empty buffers). ``owner`` is the strategy's class name, used in messages.
    """
    committed = state.memory.committed
    layout = sorted((kind, name, list(t.shape)) for kind, by_name in committed.items() for name, t in by_name.items())
    digest = hashlib.sha256(json.dumps(layout).encode()).hexdigest()
    nodes = state.nodes  # two levels or a sharded model: the ranks of the same local rank hold the same buffers
    local = nodes.local_rank if nodes is not None else 0
    tag = f"{state.step:08d}-{os.urandom(4).hex()}"  # a new name at every save; rank 0's is taken
    agreed = comm.all_gather_object((local, digest, tag))
    per_node = nodes.per_node if nodes is not None else 1
    if len({(r[0], r[1]) for r in agreed}) != per_node:  # type: ignore[index]
        raise RuntimeError(
            f"{owner}: the ranks hold memory for different parameters and cannot write one"
            " checkpoint; every rank must train the same model."
        )
    tag = agreed[0][2]  # type: ignore[index]
    folder = rank_files.folder_of(path)
    record = None
    if with_memory:
        # written at once: the memory's CPU buffers need no copy
        rank_path = rank_files.join(folder, rank_files.rank_file_name(state.global_rank, tag))
        record = io.save(state.state_dict(copy=False), rank_path)
    records = comm.gather_object(record)  # every rank's file is written once rank 0 has its record
    if records is None:
        return None
    return {
        "algorithm": algorithm,
        "format": CHECKPOINT_FORMAT,
        "world_size": len(records),
        "topology": state.topology_signature,
        "step": state.step,
        "folder": os.path.basename(folder.rstrip("/")),
        "files": records if with_memory else None,
    }


def finish_save(path: Any, manifest: dict[str, Any], io: FileIO) -> None:
    """After rank 0 wrote the checkpoint at ``path``: delete the rank files of earlier saves to it."""
    folder = rank_files.folder_of(path)
    if manifest.get("files") is None:
        io.remove(folder)
    else:
        io.remove_unnamed(folder, {record["name"] for record in manifest["files"]})


def remove_rank_files(path: Any, io: FileIO) -> None:
    """Delete the rank files of checkpoint ``path`` (rank 0, when the checkpoint itself is removed)."""
    io.remove(rank_files.folder_of(path))


#: Values per all-reduce of :func:`mean_momentum` (1 MiB in fp32).
MEAN_CHUNK = 1 << 18


def mean_momentum(state: ExchangeState) -> dict[str, torch.Tensor] | None:
    """The mean over ranks of the exchange's momentum (two-level: over nodes, each node's pieces put together),
    by parameter name, flat in bucket order, on rank 0's CPU (``None`` on the other ranks).

    All ranks call this. All-reduces of at most :data:`MEAN_CHUNK` values each: beyond rank 0's result (what
    DDP's checkpoint holds as SGD's momentum buffers) no rank holds more than one chunk's copy (a two-level
    run: one parameter's).
    """
    committed = state.memory.committed.get("momentum", {})
    topology = state.topology
    first = state.global_rank == 0
    out: dict[str, torch.Tensor] = {}
    if topology is None:
        for name in sorted(committed):
            flat = committed[name].detach().reshape(-1)
            mean = torch.empty(flat.numel(), dtype=torch.float32) if first else None
            for start in range(0, flat.numel(), MEAN_CHUNK):
                chunk = comm.average(flat[start : start + MEAN_CHUNK].clone())
                if mean is not None:
                    mean[start : start + chunk.numel()].copy_(chunk)
            if mean is not None:
                out[name] = mean.view(committed[name].shape)
        return out if first else None
    mine = {shards.parse_piece(n)[0] if shards.parse_piece(n) else n for n in committed}  # type: ignore[index]
    parents = sorted({n for names in comm.all_gather_object(sorted(mine)) for n in names})  # type: ignore[attr-defined]
    numels = state.parameter_numels()
    for parent in parents:
        full = torch.zeros(numels[parent], dtype=torch.float32, device=state.param(parent).device)
        for name, tensor in committed.items():
            piece = shards.parse_piece(name)
            if name == parent:  # a whole parameter, the same on every rank of the node
                full.copy_(tensor.reshape(-1)).div_(topology.per_node)
            elif piece is not None and piece[0] == parent:
                full[piece[1] : piece[2]] = tensor.reshape(-1)
        comm.average(full).mul_(topology.per_node)  # the sum over every rank / nodes
        if first:
            out[parent] = full.cpu()
    return out if first else None


def check_entry(entry: dict[str, Any] | None, algorithm: str, owner: str, has_optimizer_state: bool) -> bool:
    """Check a checkpoint's exchange entry against the strategy's algorithm before it is restored.

    Warns when there is none but there is optimizer state (another strategy wrote the checkpoint);
    raises for another algorithm's entry. Returns whether the entry is of a format written before the
    checkpoint kept the user's SGD hyper-parameters (a "legacy" checkpoint). A malformed entry is an error
    that names the part (:func:`lightning_dgc.exchange.entry.check_checkpoint_entry`).
    """
    if is_manifest(entry):
        check_manifest(entry)  # type: ignore[arg-type]
    elif entry is not None:
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


def restore_exchange_state(
    state: ExchangeState, entry: dict[str, Any], device: torch.device, path: Any = None, io: FileIO | None = None
) -> None:
    """Load this rank's part of a checkpoint entry into ``state`` (the mean of all ranks' on another world size).

    A collective: every rank checks what it loads (:meth:`ExchangeState.restore`), and a problem on any rank
    is raised on every rank before the first step, never a silent reset. A manifest (format 3) is resolved
    against the rank files beside ``path``: on the same topology each rank reads its own file only; on another
    one every rank reads every file (they are redistributed).
    """
    if is_manifest(entry):
        if entry.get("files") is None:
            state.step = int(entry["step"])
            rank_zero_warn(
                "The checkpoint was saved without the exchange memory (save_exchange_state=False): the residuals"
                " start from zero, and momentum continues from the optimizer's SGD buffers (the mean over ranks)."
            )
            return
        same = entry["topology"] == state.topology_signature
        states = read_rank_states(entry, [state.global_rank] if same else range(entry["world_size"]), path, io)
        if same:
            state.restore_rank_state(states[state.global_rank], device)
            return
        entry = {k: v for k, v in entry.items() if k not in ("files", "folder", "step")}
        entry["format"], entry["ranks"] = SINGLE_FILE_FORMAT, [states[r] for r in range(entry["world_size"])]
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


def read_rank_states(
    entry: dict[str, Any], ranks: Any, path: Any, io: FileIO | None = None, collective: bool = True
) -> dict[int, dict[str, Any]]:
    """The saved states of ``ranks`` from the rank files a manifest names, each checked against its record
    (``collective``: a missing, truncated or foreign file on any rank is an error on every rank, naming it)."""
    io = io or FileIO(None)
    folder = rank_files.sibling(path, entry["folder"])
    files = {r: rank_files.join(folder, entry["files"][r]["name"]) for r in ranks}
    problems = [p for r, f in files.items() if (p := rank_files.check_file(f, entry["files"][r])) is not None]
    if collective:
        problems = [p for mine in comm.all_gather_object(problems) for p in mine]  # type: ignore[attr-defined]
    everyone = sorted(set(problems))
    if everyone:
        shown = "\n  ".join(everyone[:20]) + (f"\n  ... and {len(everyone) - 20} more" if len(everyone) > 20 else "")
        raise RuntimeError(
            f"The checkpoint {str(path)!r} names {entry['world_size']} rank files of exchange state in {folder!r}"
            f" that cannot be resumed from:\n  {shown}\nThe folder must sit beside the checkpoint, as the save left"
            " it: copy or move it with the file. Or resume from another checkpoint, or delete the checkpoint's"
            f" {CHECKPOINT_KEY!r} entry to resume the model and optimizer with empty exchange buffers."
        )
    return {r: io.load(f) for r, f in files.items()}


def inline_exchange_state(path: Any, io: FileIO | None = None) -> dict[str, Any]:
    """The checkpoint at ``path`` with every rank's exchange state read from its file into the entry: the
    single-file form (format 2, ``checkpoint["lightning_dgc"]["ranks"]``), which every version resumes.

    To inspect a checkpoint's exchange state, or to move it as one file (``torch.save(inline_exchange_state(p),
    q)``). A checkpoint already in that form, or saved without exchange memory, is returned as it is.
    """
    io = io or FileIO(None)
    checkpoint = io.load(str(path))
    entry = checkpoint.get(CHECKPOINT_KEY)
    if is_manifest(entry) and entry.get("files") is not None:
        check_manifest(entry)
        states = read_rank_states(entry, range(entry["world_size"]), path, io, collective=False)
        inlined = {k: v for k, v in entry.items() if k not in ("files", "folder", "step")}
        checkpoint[CHECKPOINT_KEY] = inlined | {"format": SINGLE_FILE_FORMAT, "ranks": [states[r] for r in sorted(states)]}
    return checkpoint
