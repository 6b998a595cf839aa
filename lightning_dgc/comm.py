"""The exchange: the only module that calls ``torch.distributed``.

Wire format of one bucket's sparse part (the *payload*, one flat uint8 tensor per rank, the same
size on every rank because every compressed tensor yields exactly k values):

    [ K int32 indices (bucket-flat offsets) | K values (fp32 or fp16) | 0-2 bytes of padding ]

Indices come first so that both views stay aligned; padding keeps the row length a multiple of
4 bytes so that rows of the gathered ``(world, nbytes)`` tensor can be viewed as int32 too.
One ``all_gather_into_tensor`` moves every rank's payload; tensors too small to compress travel in
one dense ``all_reduce``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

VALUE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16}
INDEX_BYTES = 4


def payload_nbytes(k_total: int, value_dtype: torch.dtype) -> int:
    """Bytes of one rank's payload for ``k_total`` values, padding included."""
    raw = k_total * (INDEX_BYTES + torch.tensor([], dtype=value_dtype).element_size())
    return raw + (-raw) % 4


def pack_into(payload: Tensor, indices: Tensor, values: Tensor, value_dtype: torch.dtype) -> None:
    """Write ``indices`` (any int dtype) and ``values`` (cast to ``value_dtype``) into ``payload``."""
    k = indices.numel()
    payload[: k * INDEX_BYTES].view(torch.int32).copy_(indices)
    payload_values(payload, k, value_dtype).copy_(values)


def payload_values(payload: Tensor, k: int, value_dtype: torch.dtype) -> Tensor:
    """The value part of a payload (a view), for writing selected values in place."""
    width = torch.tensor([], dtype=value_dtype).element_size()
    start = k * INDEX_BYTES
    return payload[start : start + k * width].view(value_dtype)


def unpack(gathered: Tensor, k: int, value_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Split a gathered ``(world, nbytes)`` uint8 tensor into flat indices (int32) and values."""
    width = torch.tensor([], dtype=value_dtype).element_size()
    indices = gathered[:, : k * INDEX_BYTES].contiguous().view(torch.int32).reshape(-1)
    values = gathered[:, k * INDEX_BYTES : k * (INDEX_BYTES + width)].contiguous().view(value_dtype)
    return indices, values.reshape(-1)


def all_gather_payload(payload: Tensor, out: Tensor, group: dist.ProcessGroup | None) -> torch.futures.Future:
    """Start gathering every rank's ``payload`` into the rows of ``out``; the future yields ``out``."""
    work = dist.all_gather_into_tensor(out, payload, group=group, async_op=True)
    return work.get_future().then(lambda _: out)


def all_reduce_sum(tensor: Tensor, group: dist.ProcessGroup | None) -> torch.futures.Future:
    """Start summing ``tensor`` over ranks in place; the future yields ``tensor``."""
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda _: tensor)


def completed(value: Tensor) -> torch.futures.Future:
    """A future that already holds ``value`` (for buckets with nothing to exchange)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def all_gather_object(obj: object, group: dist.ProcessGroup | None = None) -> list[object]:
    """Every rank's ``obj`` (blocking; for setup-time consistency checks, never per step)."""
    out: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_object(obj: object, dst: int = 0, group: dist.ProcessGroup | None = None) -> list[object] | None:
    """Every rank's ``obj`` on rank ``dst`` (``None`` elsewhere); blocking, for checkpoints only."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[object] | None = [None] * dist.get_world_size(group) if dist.get_rank(group) == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def world_size_and_rank(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(world_size, rank)`` of ``group``, or ``(1, 0)`` when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)
