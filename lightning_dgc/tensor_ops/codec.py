"""DGC's wire format: the selected values and their indices packed into one fixed-size payload.

Wire format of one bucket's sparse part (the *payload*, one flat uint8 tensor per rank, the same
size on every rank because every rank selects exactly ``K`` values and the code array has a fixed
length; gloo has no all-gather of uneven sizes)::

    [ K values (fp32 or fp16) | K + F uint16 delta codes | 0-2 bytes of padding (zeros) ]
    [ B fp32 scales | K int8 values | 0-1 byte | K + F uint16 delta codes | 0-3 bytes of padding ]   (int8)

    F = span // FILLER_SPAN   (FILLER_SPAN = 65535; span = the bucket's numel; F = 0 below 65535)
    nbytes = K * value_bytes + 2 * (K + F), rounded up to a multiple of 4   (0 when K = 0)
    int8: 4 * B + K rounded up to even, + 2 * (K + F), rounded up to a multiple of 4; B = ceil(K / 32)

With ``int8`` the ``K`` values (in index order) are cut into blocks of ``INT8_BLOCK`` = 32, and each value
is ``round(v / scale)`` in ``[-127, 127]`` with its block's ``scale = max |v| / 127``; the receiver
multiplies back. Values next to each other in the bucket mostly come from one tensor, so a block's scale
follows its layer's gradient size (one scale for the whole payload would round a layer with small gradients
to zero). The scales cost 1/8 byte a value. The sender keeps ``v - scale * round(v / scale)`` (at most
``scale / 2``) in its error feedback, so nothing is lost, only delayed; a non-finite value makes its block's
scale, and so the block's decoded values, non-finite.

Values come first so that the fp32 view is 4-byte aligned (the codes then start at an even
offset; an int8 value part is padded to an even length); the padding keeps every row of the gathered
``(world, nbytes)`` tensor a multiple of 4 bytes. The ``K`` selected bucket-flat indices
``p_1 < p_2 < ... < p_K`` (in ``[0, span)``) travel as gaps ``d_i = p_i - p_{i-1}`` with ``p_0 = -1``, so
every ``d_i >= 1``:

* a code ``c`` in ``1..65535`` means "advance ``c`` positions; an entry is here" (the i-th entry
  code goes with the i-th value);
* code ``0`` is a *filler*: "advance 65535 positions, no entry";
* a gap ``d`` is written as ``f = (d - 1) // 65535`` fillers followed by the code ``d - 65535 f``;
* after the last entry the rest of the ``K + F`` codes are 0 (trailing fillers, ignored).

Decoding a row: ``advance = where(code == 0, 65535, code)``, ``position = cumsum(advance) - 1``,
and the entries are the slots with ``code != 0``, exactly ``K`` of them, in order.

Why ``K + F`` codes always suffice: the gaps sum to ``p_K + 1 <= span``, so the fillers number
``sum_i (d_i - 1) // 65535 <= sum_i (d_i - 1) / 65535 <= (span - K) / 65535``; being an integer, the
count is at most ``(span - K) // 65535 <= span // 65535 = F``. (The worst case puts ``span - K``
unselected positions in one gap; spreading them over several gaps only loses fillers to rounding.)

Compared with int32 indices a value costs ``2 + value_bytes`` bytes instead of ``4 + value_bytes``
(plus ``2 F`` bytes per bucket: 778 bytes for a bucket of 25.6 M values). One all-gather
(``all_gather_single``) moves every rank's payload; tensors too small to compress travel in one
dense ``all_reduce``.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Dtypes a value may travel in (``value_dtype`` of the algorithms that send values).
VALUE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "int8": torch.int8}
#: Bytes of one scale of an int8 payload (fp32, the scales ahead of the values).
SCALE_BYTES = 4
#: Consecutive int8 values that share one scale.
INT8_BLOCK = 32
#: The largest magnitude of an int8 value on the wire (symmetric: -127..127).
INT8_LEVELS = 127
#: Bytes of one int32 index (DEFT still all-reduces its union indices as int32).
INDEX_BYTES = 4
#: Bytes of one delta code of DGC's payload (uint16).
CODE_BYTES = 2
#: Positions a filler code (0) advances; also the largest gap a single entry code covers.
FILLER_SPAN = 65535


def sparse_nbytes(k: int, value_dtype: torch.dtype) -> int:
    """Bytes of ``k`` selected values with their indices, before any packing: what a tensor costs sent sparse."""
    return k * (INDEX_BYTES + value_dtype.itemsize)


def _fillers(span: int) -> int:
    """``F``: the filler slots a payload reserves for a bucket of ``span`` values."""
    return span // FILLER_SPAN


def payload_size(k_total: int, value_bytes: int, span: int) -> tuple[int, int]:
    """``(bytes, padding)`` of one rank's payload for ``k_total`` values of ``value_bytes`` bytes each,
    out of a bucket of ``span`` values (plain integers: the performance model uses it too).

    ``k_total * value_bytes + CODE_BYTES * (k_total + span // FILLER_SPAN)``, rounded up to a multiple
    of 4 bytes; the padding is that rounding (0 or 2; filler codes count as index bytes). ``(0, 0)``
    when ``k_total`` is 0 (nothing is exchanged, no codes are needed).
    """
    if k_total < 0 or k_total > span:
        raise ValueError(f"cannot select {k_total} values out of a bucket of {span} values (0 <= k <= span).")
    if k_total == 0:
        return 0, 0
    raw = _value_part(k_total, value_bytes) + CODE_BYTES * (k_total + _fillers(span))
    return raw + (-raw) % 4, (-raw) % 4


def _value_part(k: int, value_bytes: int) -> int:
    """Bytes ahead of the codes: the ``k`` values, with an int8 payload's scales and its even padding."""
    if value_bytes == 1:  # int8: the scales first, the codes at an even offset
        raw = SCALE_BYTES * _blocks(k) + k
        return raw + raw % 2
    return k * value_bytes


def _blocks(k: int) -> int:
    """The scales of ``k`` int8 values."""
    return -(-k // INT8_BLOCK)


def payload_nbytes(k_total: int, value_dtype: torch.dtype, span: int) -> int:
    """Bytes of one rank's payload (:func:`payload_size`) with values of ``value_dtype``."""
    return payload_size(k_total, value_dtype.itemsize, span)[0]


def payload_padding(k_total: int, value_dtype: torch.dtype, span: int) -> int:
    """The alignment bytes of :func:`payload_nbytes` (0 or 2)."""
    return payload_size(k_total, value_dtype.itemsize, span)[1]


def _as_int16(codes: Tensor) -> Tensor:
    """Codes in ``0..65535`` (any int dtype) as int16 with the same 16 bits (two's complement)."""
    return (codes - ((codes >> 15) << 16)).to(torch.int16)


def pack_into(
    payload: Tensor, indices: Tensor, values: Tensor, value_dtype: torch.dtype, span: int, check: bool = True
) -> None:
    """Write the selected ``indices`` and their ``values`` into ``payload`` (see the module docstring).

    Args:
        payload: a uint8 tensor of exactly ``payload_nbytes(K, value_dtype, span)`` bytes.
        indices: the ``K`` selected bucket-flat offsets, any int dtype, **sorted ascending, distinct
            and in** ``[0, span)``; ``values[i]`` goes with ``indices[i]``.
        values: ``K`` values, cast to ``value_dtype``.
        value_dtype: the wire dtype of the values.
        span: the bucket's numel (the same on every rank).

    The index contract is checked (``ValueError``) only for CPU tensors and with ``check``, where it
    costs no device synchronisation; on CUDA an index set that breaks it gives a wrong payload (or an
    out-of-bounds device error), so the caller must sort. Vectorised: no host synchronisation, no
    Python loop.
    """
    k = indices.numel()
    nbytes = payload_nbytes(k, value_dtype, span)
    if payload.dtype != torch.uint8 or payload.numel() != nbytes:
        raise ValueError(
            f"the payload must be {nbytes} uint8 bytes for {k} values out of {span} ({value_dtype}),"
            f" got {payload.numel()} {payload.dtype}; allocate it with payload_nbytes(k, value_dtype, span)."
        )
    if values.numel() != k:
        raise ValueError(f"pack_into got {k} indices but {values.numel()} values.")
    if k == 0:
        return
    idx = indices.reshape(-1).to(torch.int64)
    gaps = torch.diff(idx, prepend=idx.new_full((1,), -1))  # d_i >= 1 for a valid index set
    if check and idx.device.type == "cpu":
        if int(gaps.min()) < 1:
            raise ValueError("pack_into needs indices sorted ascending, distinct and >= 0 (sort them first).")
        if int(idx[-1]) >= span:
            raise ValueError(f"pack_into got index {int(idx[-1])} outside the bucket of {span} values.")
    vbytes = _value_part(k, value_dtype.itemsize)
    if value_dtype == torch.int8:
        _quantize_into(payload, values.reshape(-1))
    else:
        payload_values(payload, k, value_dtype).copy_(values.reshape(-1))
    slots = k + _fillers(span)
    codes = payload[vbytes : vbytes + CODE_BYTES * slots].view(torch.int16)
    if slots == k:  # span < 65535: every gap fits one code, no filler
        codes.copy_(_as_int16(gaps))
    else:
        fill = torch.div(gaps - 1, FILLER_SPAN, rounding_mode="floor")  # fillers before each entry
        where = torch.cumsum(fill + 1, 0).sub_(1)  # the slot of each entry's code
        codes.zero_()
        codes.index_put_((where,), _as_int16(gaps - FILLER_SPAN * fill))
    payload[vbytes + CODE_BYTES * slots :].zero_()


def _quantize_into(payload: Tensor, values: Tensor) -> None:
    """Write ``values`` as int8 levels, each block of ``INT8_BLOCK`` with its fp32 scale (``max |v| / 127``),
    the scales at the head of ``payload``."""
    k, blocks = values.numel(), _blocks(values.numel())
    padded = values.new_zeros(blocks * INT8_BLOCK, dtype=torch.float32)
    padded[:k] = values
    padded = padded.view(blocks, INT8_BLOCK)
    scale = padded.abs().amax(1).div_(INT8_LEVELS)  # a NaN or inf value: its block's scale, so its block, too
    step = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(1)  # a block of zeros decodes to 0
    head = SCALE_BYTES * blocks
    payload[:head].view(torch.float32).copy_(scale)
    levels = padded.div_(step).round_().clamp_(-INT8_LEVELS, INT8_LEVELS).nan_to_num_(0.0)
    payload[head : head + k].view(torch.int8).copy_(levels.view(-1)[:k])
    payload[head + k : _value_part(k, 1)].zero_()


def payload_values(payload: Tensor, k: int, value_dtype: torch.dtype) -> Tensor:
    """The values of a packed payload as the receiver decodes them (fp32 for int8; for fp32 and fp16 a view
    of its first ``k`` values, which may be written in place)."""
    return gathered_values(payload.view(1, -1), k, value_dtype)


def gathered_values(gathered: Tensor, k: int, value_dtype: torch.dtype) -> Tensor:
    """The values of a gathered ``(world, nbytes)`` uint8 tensor, ``(world * k,)``, as :func:`unpack` returns
    them, without decoding the indices (which costs about 30 bytes of temporaries per value); int8 rows
    come back multiplied by their scale, in fp32."""
    if value_dtype == torch.int8:
        head = SCALE_BYTES * _blocks(k)
        scales = gathered[:, :head].contiguous().view(torch.float32)  # (world, blocks)
        levels = gathered[:, head : head + k].view(torch.int8).float()
        return levels.mul_(scales.repeat_interleave(INT8_BLOCK, dim=1)[:, :k]).reshape(-1)
    return gathered[:, : k * value_dtype.itemsize].view(value_dtype).reshape(-1)  # rows: 4-byte multiples


def unpack(gathered: Tensor, k: int, value_dtype: torch.dtype, span: int) -> tuple[Tensor, Tensor]:
    """Decode a gathered ``(world, nbytes)`` uint8 tensor into flat indices (int64) and values.

    Returns ``(indices, values)`` of shape ``(world * k,)``, rank 0's ``k`` entries first, each rank's
    in the order it packed them. Vectorised over all rows (no Python loop, no host synchronisation).
    A row written by :func:`pack_into` decodes exactly. Any other row still decodes to ``k`` indices
    in ``[0, span)``, so a corrupt row can never index out of the bucket; in particular an all-zero
    code array (a rank that zeroes its payload and sends NaN values) decodes to ``k`` entries at 0.
    """
    world = gathered.shape[0]
    nbytes = payload_nbytes(k, value_dtype, span)
    if gathered.dtype != torch.uint8 or gathered.dim() != 2 or gathered.shape[1] != nbytes:
        raise ValueError(
            f"unpack expects a (world, {nbytes}) uint8 tensor for {k} values out of {span} ({value_dtype}),"
            f" got {tuple(gathered.shape)} {gathered.dtype}."
        )
    device = gathered.device
    if k == 0:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, torch.empty(0, dtype=torch.float32 if value_dtype == torch.int8 else value_dtype, device=device)
    gathered = gathered.contiguous()
    vbytes = _value_part(k, value_dtype.itemsize)
    slots = k + _fillers(span)
    values = gathered_values(gathered, k, value_dtype)
    codes = gathered[:, vbytes : vbytes + CODE_BYTES * slots].view(torch.int16).to(torch.int32)
    codes.bitwise_and_(0xFFFF)  # uint16 semantics
    if slots == k:  # no filler slot: every code is an entry
        indices = codes.cumsum(1, dtype=torch.int64).sub_(1).reshape(-1)
        return indices.clamp_(0, span - 1), values
    filler = codes == 0
    positions = codes.masked_fill_(filler, FILLER_SPAN).cumsum(1, dtype=torch.int64).sub_(1)
    # Where each slot's position goes in the output: an entry to ``row * k + (its rank in the row) - 1``,
    # a filler to the discard slot ``world * k``. (A row with more than k entries, which pack_into
    # never writes, piles the extra ones onto its own last slot.)
    target = (~filler).cumsum(1).clamp_(max=k)
    target.add_(torch.arange(-1, world * k - 1, k, device=device).unsqueeze(1))
    target.masked_fill_(filler, world * k)
    out = torch.zeros(world * k + 1, dtype=torch.int64, device=device)  # missing entries stay at 0
    out.scatter_(0, target.reshape(-1), positions.reshape(-1))
    return out[: world * k].clamp_(0, span - 1), values


# -- index codes on their own (DEFT's compact wire) ----------------------------------------------------------
def code_slots(count: int, span: int) -> int:
    """Delta codes that always hold ``count`` sorted distinct indices out of ``span``: ``count + F``
    (the module docstring's bound, which holds for any subset of the span)."""
    return count + _fillers(span)


def pack_codes(codes: Tensor, indices: Tensor) -> None:
    """Write sorted, distinct, non-negative ``indices`` as delta codes into ``codes`` (int16, at least
    ``code_slots(len(indices), span)`` slots, the same format as a payload's codes: see the module
    docstring); the slots after the last entry are fillers (0). Vectorised, no host synchronisation."""
    codes.zero_()
    if indices.numel() == 0:
        return
    idx = indices.reshape(-1).to(torch.int64)
    gaps = torch.diff(idx, prepend=idx.new_full((1,), -1))
    fill = torch.div(gaps - 1, FILLER_SPAN, rounding_mode="floor")  # fillers before each entry
    where = torch.cumsum(fill + 1, 0).sub_(1)  # the slot of each entry's code
    codes.index_put_((where,), _as_int16(gaps - FILLER_SPAN * fill))


def unpack_codes(rows: Tensor, counts: Tensor, width: int, span: int) -> Tensor:
    """Decode ``(world, slots)`` int16 code rows written by :func:`pack_codes`, row ``r`` holding
    ``counts[r]`` entries, into ``(world * width,)`` int64 indices: row ``r``'s entries at
    ``r * width, ...`` in order, the rest of its ``width`` slots 0. Entries beyond a row's count (a
    corrupt row) are dropped and every index is clamped into ``[0, span)``, so no row can index out of
    the bucket. Vectorised, no host synchronisation."""
    world = rows.shape[0]
    codes = rows.to(torch.int32).bitwise_and_(0xFFFF)  # uint16 semantics
    filler = codes == 0
    positions = codes.masked_fill_(filler, FILLER_SPAN).cumsum(1, dtype=torch.int64).sub_(1)
    number = (~filler).cumsum(1)  # at an entry: its number in the row, from 1
    keep = ~filler & (number <= counts.reshape(-1, 1))
    target = number.sub_(1).add_(torch.arange(0, world * width, width, device=rows.device).unsqueeze(1))
    target.masked_fill_(~keep, world * width)  # fillers and extra entries go to the discard slot
    out = torch.zeros(world * width + 1, dtype=torch.int64, device=rows.device)
    out.scatter_(0, target.reshape(-1), positions.reshape(-1))
    return out[: world * width].clamp_(0, span - 1)
