"""bf16 matrix products on a CPU without bf16 instructions, as fp32 GEMMs of the same bf16 operands.

On a CPU without avx512_bf16 or AMX, PyTorch (2.11) computes a bf16 matrix product in a scalar fallback.
On one core of an AVX2-only AMD EPYC, the PTB transformer's tied output projection took 360 ms in bf16
against 7 ms in fp32 (its backward ``[175, 10000] @ [10000, 128]``), and a whole training step under bf16
autocast 633 ms against 85 ms in fp32. :class:`Fp32Bf16Matmul` computes those products as fp32 GEMMs of
the bf16 operands, rounded back to bf16: the rounding points of a bf16 GEMM (bf16 inputs, fp32
accumulation, a bf16 result), so only the order of the fp32 sums differs. There, 0.04% of the outputs
differ by one bf16 unit in the last place from PyTorch's own bf16 product; the step took 104 ms.

:mod:`benchmarks.parity` turns it on for a bf16 task on such a CPU through the environment variable
:data:`ENV`, so a run's command, and therefore its ``--reuse`` key, does not change;
:class:`benchmarks.common.RunRecorder` enters it in every process and writes into the run's record how
many products it computed (``bf16_matmuls_as_fp32``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ENV", "MATMULS", "Fp32Bf16Matmul", "from_environment", "has_bf16_instructions"]

#: Set to ``1`` in a training process's environment to compute its bf16 CPU matrix products in fp32.
ENV = "BENCH_BF16_MATMUL_AS_FP32"

_aten = torch.ops.aten
#: The matrix products this mode computes in fp32 (what ``nn.Linear``, ``matmul`` and attention call).
MATMULS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default})


def has_bf16_instructions() -> bool | None:
    """Whether this CPU has bf16 instructions (avx512_bf16 or AMX), or ``None`` when torch cannot tell."""
    probes = [getattr(torch.cpu, n, None) for n in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if None in probes:
        return None
    return any(probe() for probe in probes)


def _cpu_bf16(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16 and value.device.type == "cpu"


class Fp32Bf16Matmul(TorchDispatchMode):
    """Within this mode, a CPU matrix product with bf16 operands is computed as an fp32 product of those
    operands, rounded to bf16; every other operation runs as it would. Autograd's backward is covered
    (the mode is thread-local state that the engine carries into the backward pass).

    ``calls`` counts the products computed this way.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in MATMULS and any(_cpu_bf16(a) for a in args):
            self.calls += 1
            fp32_args = [a.float() if _cpu_bf16(a) else a for a in args]
            return func(*fp32_args, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


def from_environment() -> Fp32Bf16Matmul | None:
    """The mode when :data:`ENV` is ``1`` in this process's environment, else ``None``."""
    return Fp32Bf16Matmul() if os.environ.get(ENV) == "1" else None
