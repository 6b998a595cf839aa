"""Your own training loop with Fabric and DGC, on 2 CPU processes: ``python lightning_dgc_recipes/fabric_loop.py``."""

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_dgc  # noqa: F401  # registers "dgc", "deft" and "powersgd" with Fabric

fabric = L.Fabric(accelerator="cpu", devices=2, strategy="dgc")  # or FabricCompressionStrategy("dgc", {...})
fabric.launch()
fabric.seed_everything(0)
model = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # DGC applies the momentum
model, optimizer = fabric.setup(model, optimizer)
x = torch.randn(2048, 32)
loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, x[:, :8].sum(1, keepdim=True)), batch_size=32))
for epoch in range(4):
    for inputs, targets in loader:
        loss = nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        fabric.backward(loss)  # the exchange runs here, bucket by bucket
        optimizer.step()  # the exchange's memory commits, then SGD steps
    fabric.print(f"epoch {epoch}: loss {fabric.all_reduce(loss).item():.4f}")
    fabric.save("fabric_dgc.ckpt", {"model": model, "optimizer": optimizer, "epoch": epoch})  # every rank's memory
