"""Per-rank bodies of the exchange tests (run by :func:`tests.distributed.launch.run_ranks`)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_dgc import DGCConfig, DGCState, deft_hook, dgc_hook
from lightning_dgc.compression import topk_indices


def make_model(seed: int = 0, wide: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    if wide:  # several compressed layers of different sizes, one large enough to be split among ranks
        return nn.Sequential(
            nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(),
            nn.Linear(32, 4),
        )  # fmt: skip
    # 64x32 and 32x64 weights are compressed (>= 1024 values); the biases are averaged dense.
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 4))


def batch(rank: int, step: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 32, generator=g)
    y = (x[:, :4] * 2.0).tanh()  # a learnable target
    return x, y


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train(
    rank: int,
    world_size: int,
    *,
    steps: int,
    use_hook: bool,
    config: dict | None = None,
    sgd: dict | None = None,
    take_over: bool = False,
    bucket_cap_mb: float = 25.0,
    poison: tuple[int, int] | None = None,
    hook: str = "dgc",
    wide: bool = False,
) -> dict[str, Any]:
    """Train the toy model; optionally through the DGC hook. Returns per-step params and stats."""
    model = make_model(wide=wide)
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    sgd = dict(sgd or {"lr": 0.1})
    state = None
    if use_hook:
        state = DGCState(config=DGCConfig(**(config or {})))
        state.register_parameters(model.named_parameters())
        if take_over:  # what DGCStrategy does with an SGD optimizer
            from lightning_dgc.state import ParamSettings

            s = ParamSettings(
                sgd.pop("momentum", 0.0), sgd.pop("nesterov", False), sgd.pop("weight_decay", 0.0)
            )
            for name, _ in model.named_parameters():
                state.param_settings[name] = s
        ddp.register_comm_hook(state, {"dgc": dgc_hook, "deft": deft_hook}[hook])
    opt = torch.optim.SGD(model.parameters(), **sgd)
    params, losses, stats, finite, memory, plans_agree = [], [], [], [], [], []
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        if poison is not None and poison == (rank, step):
            loss = loss * float("inf")
        loss.backward()
        if state is not None:
            ok = state.finish_step()
            finite.append(ok)
            stats.append(state.compression_stats())
            memory.append(state.memory.state_dict())
            plans = state._last.plans if state._last is not None else []
            everyone: list[Any] = [None] * world_size
            dist.all_gather_object(everyone, plans)
            plans_agree.append(all(p == plans for p in everyone))
            if not ok:
                continue
        opt.step()
        params.append(flat_params(model))
        losses.append(loss.item())
    return {
        "params": params,
        "losses": losses,
        "stats": stats,
        "finite": finite,
        "memory": memory,
        "plans_agree": plans_agree,
    }


def train_many(rank: int, world_size: int, *, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Several :func:`train` runs in one process group (saves process start-ups)."""
    return [train(rank, world_size, **run) for run in runs]


def sparse_reference(rank: int, world_size: int, *, steps: int, density: float) -> dict[str, Any]:
    """Compare the hook's decoded gradient with an independent computation of DGC (exact top-k, no momentum).

    Every rank gathers all ranks' raw gradients, replays every rank's error feedback in plain tensor
    code, and checks that what DDP wrote into ``.grad`` is the average of the sparse selections.
    """
    model = make_model()
    ref_model = copy.deepcopy(model)
    ddp = DDP(model)
    state = DGCState(config=DGCConfig(density=density, selection="exact"))
    state.register_parameters(model.named_parameters())
    ddp.register_comm_hook(state, dgc_hook)
    residual = {n: torch.zeros(world_size, p.numel()) for n, p in model.named_parameters()}
    max_err = 0.0
    for step in range(steps):
        x, y = batch(rank, step)
        model.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        state.finish_step()
        ref_model.zero_grad()
        nn.functional.mse_loss(ref_model(x), y).backward()
        for (name, p), rp in zip(model.named_parameters(), ref_model.parameters(), strict=False):
            local = rp.grad.reshape(-1).contiguous()
            everyone = [torch.empty_like(local) for _ in range(world_size)]
            dist.all_gather(everyone, local)
            if p.dim() > 1 and p.numel() >= 1024:
                k = max(1, int(torch.tensor(density * p.numel()).ceil()))
                expected = torch.zeros_like(local)
                for r in range(world_size):
                    residual[name][r] += everyone[r]
                    idx = topk_indices(residual[name][r], k)
                    expected[idx] += residual[name][r][idx]
                    residual[name][r][idx] = 0.0
            else:
                expected = torch.stack(everyone).sum(0)
            expected /= world_size
            max_err = max(max_err, float((p.grad.reshape(-1) - expected).abs().max()))
        with torch.no_grad():  # same update on both models keeps the replay exact
            for p, rp in zip(model.parameters(), ref_model.parameters(), strict=False):
                p -= 0.1 * p.grad
                rp.copy_(p)
    return {"max_err": max_err, "stats": state.compression_stats()}


def clipped_grad_norms(rank: int, world_size: int, *, clip: float, density: float) -> list[float]:
    """Per-tensor norms of the averaged gradients DDP writes back, with DGC's local clipping on."""
    model = make_model()
    ddp = DDP(model)
    state = DGCState(config=DGCConfig(density=density, local_clip_norm=clip))
    state.register_parameters(model.named_parameters())
    ddp.register_comm_hook(state, dgc_hook)
    norms: list[float] = []
    for step in range(3):
        x, y = batch(rank, step)
        model.zero_grad()
        (100.0 * nn.functional.mse_loss(ddp(x), y)).backward()  # large gradients: clipping must bite
        state.finish_step()
        norms += [float(p.grad.norm()) for p in model.parameters()]
    return norms
