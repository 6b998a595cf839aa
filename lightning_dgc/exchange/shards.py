"""How a two-level exchange cuts a bucket into the shards of a node's GPUs; pure, no ``torch.distributed``.

In a two-level exchange (:func:`lightning_dgc.exchange.hook.exchange_two_level`) the ``G`` ranks of a node
reduce-scatter every bucket, and each runs the algorithm across the nodes on its *shard*. The shards
are cut **tensor by tensor, along the first dimension**: local rank ``i`` of ``G`` gets rows
``[i R / G, (i+1) R / G)`` of every tensor of ``R`` rows (a 1-D tensor's rows are its values, a
0-d tensor is one row). Each cut is a tensor of its own for the algorithm, named
``"<param>[a:b]"`` (``a:b``: its values' range in the parameter's flat, bucket-ordered gradient) and
shaped ``(rows, *shape[1:])``, so that every per-tensor rule stays well defined on it: top-k per
piece, "1-D or small tensors dense" by the piece's own size, DEFT's fragments of the pieces,
PowerSGD's matrix of the piece's rows. The names depend on the parameter's shape, ``G`` and the
local rank only, never on DDP's buckets: the memory keyed by them survives DDP rebuilding its buckets
after the first step. A shard is the concatenation of its pieces in bucket order, padded to the
longest shard of the bucket (the collectives move equal blocks).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_dgc.algorithms.base import TensorSpec

_PIECE = re.compile(r"^(?P<parent>.*)\[(?P<a>\d+):(?P<b>\d+)\]$")


def row_ranges(shape: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """The value range ``(a, b)`` of each of ``parts`` pieces of a tensor of ``shape`` (empty: ``a == b``)."""
    shape = tuple(int(s) for s in shape)
    numel = 1
    for s in shape:
        numel *= s
    rows = shape[0] if shape else 1
    row = numel // rows if rows else 0
    return [((i * rows // parts) * row, ((i + 1) * rows // parts) * row) for i in range(parts)]


def piece_name(name: str, a: int, b: int) -> str:
    return f"{name}[{a}:{b}]"


def parse_piece(name: str) -> tuple[str, int, int] | None:
    """``(parameter, a, b)`` of a piece's name, ``None`` for a whole parameter's name."""
    match = _PIECE.match(name)
    return (match["parent"], int(match["a"]), int(match["b"])) if match else None


def piece_shape(shape: Sequence[int], a: int, b: int) -> tuple[int, ...]:
    """The shape of values ``[a, b)`` of a tensor of ``shape`` (whole rows, see the module docstring)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) <= 1:
        return (b - a,)
    row = 1
    for s in shape[1:]:
        row *= s
    return ((b - a) // row, *shape[1:])


def pieces_of(name: str, shape: Sequence[int], parts: int, index: int) -> list[tuple[str, int, int]]:
    """The piece of parameter ``name`` that local rank ``index`` of ``parts`` owns: ``[(name[a:b], a, b)]``
    or ``[]`` when it owns none (a tensor of fewer rows than ``parts``)."""
    a, b = row_ranges(shape, parts)[index]
    return [(piece_name(name, a, b), a, b)] if b > a else []


@dataclass
class ShardLayout:
    """One bucket cut into the shards of ``parts`` local ranks, seen from local rank ``index``.

    ``pieces``: this rank's pieces (offsets within its shard). The *node layout* is ``parts`` blocks of
    ``shard_numel`` values (block ``i``: local rank ``i``'s shard, zero-padded); ``numel``: the values of this
    rank's shard without the padding. The bucket is a sequence of *runs*, one per non-empty piece of each tensor
    in bucket order (``run_numels``), each in the block of the rank that owns it (``block_runs``);
    :meth:`to_node` and :meth:`to_bucket` copy between the two layouts run by run, with no index tensor (which
    would hold 8 bytes per value of the bucket).
    """

    pieces: list[TensorSpec]
    shard_numel: int
    numel: int
    parts: int
    index: int
    bucket_numel: int
    run_numels: list[int]
    #: every local rank's shard without its padding, and its runs (in bucket order, their order in the block)
    block_numels: list[int]
    block_runs: list[list[int]]

    def to_node(self, bucket: Tensor, node: Tensor) -> Tensor:
        """Copy ``bucket`` (bucket order, any floating dtype) into ``node`` (the node layout, ``parts *
        shard_numel`` values), its padding zeroed; returns ``node``."""
        runs = bucket.split(self.run_numels)
        for members, count, block in zip(self.block_runs, self.block_numels, node.view(self.parts, -1), strict=True):
            if members:
                torch.cat([runs[j] for j in members], out=block[:count])
            block[count:].zero_()
        return node

    def to_bucket(self, node: Tensor, out: Tensor | None = None) -> Tensor:
        """The bucket (bucket order) from ``node`` (the node layout): written into ``out`` when given, else new."""
        runs: dict[int, Tensor] = {}
        for members, count, block in zip(self.block_runs, self.block_numels, node.view(self.parts, -1), strict=True):
            runs.update(zip(members, block[:count].split([self.run_numels[j] for j in members]), strict=True))
        in_order = [runs[j] for j in range(len(self.run_numels))]
        return torch.cat(in_order) if out is None else torch.cat(in_order, out=out)


def shard_pieces(layout: Sequence[TensorSpec], parts: int, index: int) -> list[TensorSpec]:
    """The pieces of a bucket of ``layout`` that local rank ``index`` of ``parts`` owns (offsets in its shard);
    what the performance model hands an algorithm's ``wire_cost``."""
    pieces: list[TensorSpec] = []
    offset = 0
    for spec in layout:
        a, b = row_ranges(spec.shape, parts)[index]
        if b > a:
            pieces.append(TensorSpec(piece_name(spec.name, a, b), piece_shape(spec.shape, a, b), offset, b - a))
            offset += b - a
    return pieces


def shard_layout(layout: Sequence[TensorSpec], parts: int, index: int) -> ShardLayout:
    """The :class:`ShardLayout` of a bucket of ``layout`` for local rank ``index`` of ``parts``."""
    sizes = [0] * parts
    run_numels: list[int] = []
    block_runs: list[list[int]] = [[] for _ in range(parts)]
    pieces: list[TensorSpec] = []
    for spec in layout:
        for i, (a, b) in enumerate(row_ranges(spec.shape, parts)):
            if b == a:
                continue
            block_runs[i].append(len(run_numels))
            run_numels.append(b - a)
            if i == index:
                pieces.append(TensorSpec(piece_name(spec.name, a, b), piece_shape(spec.shape, a, b), sizes[i], b - a))
            sizes[i] += b - a
    total = sum(s.numel for s in layout)
    return ShardLayout(pieces, max(max(sizes), 1), sizes[index], parts, index, total, run_numels, sizes, block_runs)


# -- checkpoints across topologies -------------------------------------------------------------------------
Memory = dict[str, dict[str, Tensor]]  # kind -> name -> flat tensor


def assemble(ranks: Sequence[Memory], numels: Mapping[str, int]) -> Memory:
    """One memory of whole parameters from the pieces the ranks of one node hold (each piece in its range).

    ``numels``: every parameter's number of values. Whole-parameter entries are taken as they are; values
    no rank holds stay 0 (a piece the algorithm never kept memory for). Buffers of a piece that do not
    hold one value per gradient value (PowerSGD's ``q``) are left out: they restart.
    """
    out: Memory = {}
    for memory in ranks:
        for kind, by_name in memory.items():
            target = out.setdefault(kind, {})
            for name, tensor in by_name.items():
                piece = parse_piece(name)
                if piece is None or piece[0] not in numels:
                    target[name] = tensor.reshape(-1).clone()
                    continue
                parent, a, b = piece
                if tensor.numel() != b - a:  # not one value per gradient value (PowerSGD's q): restarts
                    continue
                whole = target.get(parent)
                if whole is None:
                    whole = target[parent] = torch.zeros(numels[parent], dtype=tensor.dtype)
                whole[a:b] = tensor.reshape(-1)
    return out


def mean_memory(memories: Sequence[Memory]) -> Memory:
    """The mean over ``memories`` of every buffer (a buffer some lack counts as zeros there)."""
    out: Memory = {}
    kinds = {kind for m in memories for kind in m}
    for kind in kinds:
        names = {name for m in memories for name in m.get(kind, {})}
        out[kind] = {}
        for name in names:
            present = [m[kind][name] for m in memories if name in m.get(kind, {})]
            out[kind][name] = torch.stack(present).sum(0) / len(memories)
    return out


def slice_memory(memory: Memory, shapes: Mapping[str, Sequence[int]], parts: int, index: int) -> Memory:
    """The pieces local rank ``index`` of ``parts`` owns, cut from a memory of whole parameters."""
    out: Memory = {}
    for kind, by_name in memory.items():
        out[kind] = {}
        for name, tensor in by_name.items():
            if name not in shapes or tensor.numel() != math.prod(shapes[name]):
                continue  # not one value per gradient value (PowerSGD's q): restarts
            for piece, a, b in pieces_of(name, shapes[name], parts, index):
                out[kind][piece] = tensor.reshape(-1)[a:b].clone()
    return out
