"""``benchmarks.bf16_cpu``: bf16 CPU matrix products as fp32 GEMMs with a bf16 GEMM's rounding."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch
from torch import nn

from benchmarks import bf16_cpu
from benchmarks.common import RunRecorder


def _bf16_product(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """What a bf16 GEMM computes: bf16 operands, fp32 products and sums, one rounding of the result."""
    as_bf16 = [t.detach().bfloat16().float() for t in (layer.bias, x, layer.weight)]
    return torch.addmm(as_bf16[0], as_bf16[1], as_bf16[2].t()).bfloat16()


def test_bf16_products_are_fp32_products_of_the_bf16_operands_rounded_once() -> None:
    torch.manual_seed(0)
    layer, x = nn.Linear(64, 32), torch.randn(16, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        native = layer(x)
    native.float().sum().backward()
    native_grads = [t.grad.clone() for t in (x, layer.weight)]
    x.grad = layer.weight.grad = layer.bias.grad = None

    mode = bf16_cpu.Fp32Bf16Matmul()
    with mode:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x)
        out.float().sum().backward()
        fp32 = layer.weight.detach() @ torch.ones(64, 4)  # an fp32 product: not the mode's business
    assert mode.calls == 3  # the forward addmm and the backward's two products (input, weight)
    assert out.dtype == torch.bfloat16 and torch.equal(out, _bf16_product(x, layer))
    assert fp32.dtype == torch.float32
    for grad, reference in zip((x.grad, layer.weight.grad), native_grads, strict=True):
        # the same rounding points as PyTorch's bf16 product; the fp32 sums may run in another order
        torch.testing.assert_close(grad, reference, rtol=2**-7, atol=1e-3)


def test_the_recorder_computes_bf16_products_in_fp32_when_asked(tmp_path: Path, monkeypatch) -> None:
    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(8, 1)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.layer(batch[0]).float(), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(12, 8), torch.randn(12, 1))
    records = {}
    for asked in (False, True):
        if asked:
            monkeypatch.setenv(bf16_cpu.ENV, "1")
        path = tmp_path / f"run_{asked}.json"
        trainer = L.Trainer(
            accelerator="cpu", devices=1, precision="bf16-mixed", max_steps=3, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[RunRecorder(str(path))], default_root_dir=tmp_path,
        )  # fmt: skip
        trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
        records[asked] = json.loads(path.read_text())
    assert "bf16_matmuls_as_fp32" not in records[False]
    # 3 steps: a forward addmm and the weight gradient's product each (the input needs no gradient)
    assert records[True]["bf16_matmuls_as_fp32"] == 6
    assert records[True]["finished"] and records[True]["global_step"] == 3
