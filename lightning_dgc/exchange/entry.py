"""The exchange state's checkpoint entry (``checkpoint["lightning_dgc"]``): its key, its validation, and its
redistribution to another world size or topology. Pure: no process group, no Lightning (the save and load
flow is :mod:`lightning_dgc.checkpoint.exchange`; each rank's state is :meth:`ExchangeState.state_dict`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_dgc.exchange import shards


def restore_error(problems: list[str]) -> str:
    """The error for exchange state that a run cannot resume from."""
    shown = "\n  ".join(problems[:20]) + (
        f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
    )
    return (
        f"The checkpoint's {CHECKPOINT_KEY!r} exchange state does not fit this run:\n  {shown}\nResume with the"
        " model and the settings that wrote it, or delete the checkpoint's"
        f" {CHECKPOINT_KEY!r} entry to resume the model and optimizer with empty exchange buffers."
    )


#: Key of the per-rank exchange state in Lightning checkpoints.
CHECKPOINT_KEY = "lightning_dgc"


def missing_buffers(state: dict[str, Any]) -> list[tuple[str, str]]:
    """The ``(kind, parameter)`` buffers a rank's saved state lists under ``"buffers"`` (what the run that wrote
    it kept, :meth:`ExchangeState.state_dict`) but its ``"memory"`` lacks: lost on the way to the resume.

    The list is what the saving run held, so buffers it never made (a kind its algorithm or settings do not
    use, tensors averaged dense, PowerSGD's ``q`` of tensors it does not factorise, every buffer before the
    first step) are not asked for. A state without the list (written before it was kept) is not checked.
    """
    listed, memory = state.get("buffers"), state.get("memory")
    if not isinstance(listed, dict) or not isinstance(memory, dict):
        return []
    return [
        (kind, name)
        for kind, names in listed.items()
        for name in names
        if not isinstance(memory.get(kind), dict) or name not in memory[kind]
    ]


def check_checkpoint_entry(entry: object) -> None:
    """Raise a ``ValueError`` naming the part of a checkpoint's ``"lightning_dgc"`` entry that is malformed.

    The entry is ``{"algorithm": name, "world_size": N, "ranks": [state_0, ..., state_N-1]}``, every state
    with a ``"step"`` and a ``"memory"`` of ``{kind: {parameter: tensor}}``, the same kinds, parameters and
    shapes on every rank (in a two-level exchange: on every rank of the same local rank; the strategies write
    it so), and every buffer a state lists under ``"buffers"`` in its memory (:func:`missing_buffers`). The
    check is the same on every rank.
    """
    key = f"checkpoint[{CHECKPOINT_KEY!r}]"
    fix = f" Resume from an unmodified checkpoint, or delete {key} to start the exchange with empty buffers."
    if not isinstance(entry, dict):
        raise ValueError(f"{key} must be a dict written by lightning-dgc, got a {type(entry).__name__}.{fix}")
    for field_, kind in (("algorithm", str), ("world_size", int), ("ranks", list)):
        if not isinstance(entry.get(field_), kind) or isinstance(entry.get(field_), bool):
            got = "nothing" if field_ not in entry else f"a {type(entry[field_]).__name__}"
            raise ValueError(f"{key}[{field_!r}] must be a {kind.__name__}, found {got}.{fix}")
    ranks, world_size = entry["ranks"], entry["world_size"]
    if world_size < 1 or len(ranks) != world_size:
        raise ValueError(
            f"{key} says it was written by world_size={world_size} ranks but holds {len(ranks)} rank states"
            f" ({key}['ranks']).{fix}"
        )
    topology = entry.get("topology")
    # a two-level exchange's ranks hold the pieces of their local rank: compare ranks of the same local rank
    per_node = (
        int(topology.get("per_node", 1))
        if isinstance(topology, dict) and (topology.get("hierarchical") or topology.get("sharded")) else 1
    )  # fmt: skip
    layouts: dict[int, dict[tuple[str, str], tuple[int, ...]]] = {}
    for r, state in enumerate(ranks):
        where = f"{key}['ranks'][{r}]"
        if not isinstance(state, dict) or not isinstance(state.get("memory"), dict) or "step" not in state:
            raise ValueError(f"{where} must be a dict with 'step' and 'memory' entries.{fix}")
        memory, listed = state["memory"], state.get("buffers")
        if not all(
            isinstance(by_name, dict) and all(isinstance(t, Tensor) for t in by_name.values())
            for by_name in memory.values()
        ):
            raise ValueError(
                f"{where}['memory'] must map every buffer kind to {{parameter name: tensor}}.{fix}"
            )
        if listed is not None and not (
            isinstance(listed, dict) and all(isinstance(names, list | tuple) for names in listed.values())
        ):
            raise ValueError(
                f"{where}['buffers'] must map every buffer kind to a list of parameter names.{fix}"
            )
        missing = missing_buffers(state)
        if missing:
            shown = ", ".join(f"{kind!r} of {name!r}" for kind, name in missing[:10])
            more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
            raise ValueError(
                f"{where}['memory'] lacks buffers that the run which wrote it kept ({where}['buffers'] lists"
                f" them): {shown}{more}. The checkpoint was edited or damaged, and these would restart from zeros."
                f"{fix} To restart only these buffers from zeros, delete 'buffers' from every state of {key}['ranks']."
            )
        mine = {
            (kind, name): tuple(t.shape) for kind, by_name in memory.items() for name, t in by_name.items()
        }
        first = layouts.setdefault(r % per_node, mine)
        if mine != first:
            differ = sorted({key for key in mine.keys() | first.keys() if mine.get(key) != first.get(key)})
            shown = ", ".join(f"{kind!r} of {name!r}" for kind, name in differ[:10])
            raise ValueError(
                f"{where}['memory'] holds other buffers (or shapes) than rank {r % per_node}'s: {shown}.{fix}"
            )


def state_for_topology(
    saved: dict[str, Any], topology: dict[str, Any], rank: int, shapes: dict[str, tuple[int, ...]]
) -> tuple[dict[str, Any], bool]:
    """This rank's state from a checkpoint entry, for a run whose memory lives as ``topology`` says
    (:attr:`ExchangeState.topology_signature`). Returns ``(state, redistributed)``.

    Same topology (flat at the same world size, or two-level with the same nodes and ranks per node):
    rank r gets exactly what rank r saved. Otherwise the buffers are redistributed as a change of world
    size redistributes them (:func:`state_for_rank`), with a node's shards put back together first: every
    saved node (a flat run: every rank) becomes one memory of whole parameters, their mean is what every
    new node (flat: every rank) starts from, cut into this rank's pieces in a two-level run. The update
    still owed to the model (the mean over nodes) is kept; buffers that are not one value per gradient
    value (PowerSGD's ``q``) restart. ``shapes``: every parameter's shape.
    """
    check_checkpoint_entry(saved)
    world = topology["nodes"] * topology["per_node"]
    old = saved.get("topology") or {"hierarchical": False, "nodes": int(saved["world_size"]), "per_node": 1}
    if old.get("sharded") or topology.get("sharded"):
        if old == topology:
            return saved["ranks"][rank], False
        raise ValueError(restore_error([sharded_layout_problem(old, topology)]))
    if not old["hierarchical"] and not topology["hierarchical"]:
        return state_for_rank(saved, world, rank)
    ranks = saved["ranks"]
    if old == topology:
        return ranks[rank], False
    numels = {name: math.prod(shape) for name, shape in shapes.items()}
    per_node = int(old["per_node"])
    nodes = [
        shards.assemble([r["memory"] for r in ranks[n * per_node : (n + 1) * per_node]], numels)
        for n in range(int(old["nodes"]))
    ]
    memory = shards.mean_memory(nodes)
    if topology["hierarchical"]:
        memory = shards.slice_memory(memory, shapes, topology["per_node"], rank % topology["per_node"])
    merged = {k: v for k, v in ranks[0].items() if k not in ("memory", "generator", "rank", "buffers")}
    merged["memory"] = memory
    merged["topology"] = topology
    return merged, True


def sharded_layout_problem(saved: dict[str, Any], run: dict[str, Any]) -> str:
    """Why a sharded model's exchange state cannot move between these layouts (:func:`state_for_topology`)."""

    def said(layout: dict[str, Any]) -> str:
        kind = "a sharded model" if layout.get("sharded") else "a replicated model"
        return f"{kind} on {layout['nodes']} node(s) x {layout['per_node']} process(es)"

    return (
        f"the exchange state was saved by {said(saved)}, this run is {said(run)}: each process's buffers are its"
        " shard's, and a sharded exchange state resumes only on the layout that saved it (the model and the"
        " optimizer reshard, they are saved with torch.distributed.checkpoint). Resume with the same nodes and"
        " processes per node, or resume with empty exchange buffers (the update they still held is dropped):"
        " HSDPCompressionStrategy(..., resume_exchange_state=False)."
    )


def state_for_rank(saved: dict[str, Any], world_size: int, rank: int) -> tuple[dict[str, Any], bool]:
    """This rank's state from a checkpoint entry ``{"world_size": N, "ranks": [state_0, ...]}``.

    Same world size: rank r gets exactly what rank r saved. Another world size M: every new rank
    gets the *mean* of the N saved buffers of every kind. For DGC the update still owed to the model,
    ``sum(v_r) / N``, is then preserved exactly (``M * mean / M``), while per-rank detail is lost; the
    sampling generator restarts from the seed. Returns ``(state, redistributed)``.
    """
    check_checkpoint_entry(saved)
    ranks = saved["ranks"]
    if int(saved["world_size"]) == world_size:
        return ranks[rank], False
    first = ranks[0]
    memory: dict[str, dict[str, Tensor]] = {
        kind: {name: torch.stack([r["memory"][kind][name] for r in ranks]).mean(0) for name in by_name}
        for kind, by_name in first["memory"].items()
    }
    merged = {k: v for k, v in first.items() if k not in ("memory", "generator", "rank", "buffers")}
    merged["memory"] = memory
    return merged, True


def state_problems(exchange: Any, state: dict[str, Any]) -> list[str]:
    """What in a rank's saved state (``ExchangeState.state_dict``) the run of ``exchange`` (an
    :class:`~lightning_dgc.exchange.state.ExchangeState`) cannot take, one line per problem (empty: it loads): every
    buffer against what the run keeps for its parameter (the algorithm's ``memory_shape``: a tensor, fp32, of that
    shape, finite), and the saved settings that shape the memory (``Algorithm.state_settings``) against the run's."""
    problems = [
        f"the checkpoint has no {kind!r} buffer of parameter {name!r}, which the run that wrote it kept (it"
        " would restart from zeros): the checkpoint was edited or damaged. To restart it from zeros on"
        " purpose, delete the state's 'buffers' list."
        for kind, name in missing_buffers(state)
    ]
    saved_config = state.get("config")
    for setting in exchange.algorithm.state_settings if isinstance(saved_config, dict) else ():
        ours = getattr(exchange.config, setting)
        if setting in saved_config and saved_config[setting] != ours:
            problems.append(
                f"the checkpoint's exchange state was made with {setting}={saved_config[setting]!r}, this run has"
                f" {setting}={ours!r}: its buffers have other shapes. Resume with"
                f" {setting}={saved_config[setting]!r}."
            )
    for kind, by_name in state["memory"].items():
        for name, tensor in by_name.items():
            where = f"the checkpoint's {kind!r} buffer of parameter {name!r}"
            try:  # a parameter, or a piece "<param>[a:b]" of one in a two-level exchange
                param: Tensor | None = exchange.param(name)
            except (KeyError, ValueError, RuntimeError):
                param = None
            expected = (
                None if param is None else exchange.algorithm.memory_shape(kind, name, tuple(param.shape))
            )
            if param is None:
                problems.append(f"{where}: the model has no parameter of that name.")
            elif expected is None:
                problems.append(
                    f"{where}: this run of {exchange.algorithm.name} keeps no such buffer for it."
                )
            elif not isinstance(tensor, Tensor):
                problems.append(f"{where} is a {type(tensor).__name__}, not a tensor.")
            elif tuple(tensor.shape) != tuple(expected):
                problems.append(
                    f"{where} has shape {tuple(tensor.shape)}, this run expects {tuple(expected)}."
                )
            elif tensor.dtype != torch.float32:
                problems.append(f"{where} is {tensor.dtype}, the memory is torch.float32.")
            elif not bool(torch.isfinite(tensor).all()):
                problems.append(f"{where} holds NaN or inf values (the run that saved it had diverged?).")
    return problems
