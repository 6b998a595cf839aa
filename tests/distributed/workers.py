"""Per-rank bodies of the exchange tests (run by :func:`tests.distributed.launch.run_ranks`)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_dgc import DGCConfig, ExchangeState, algorithms, exchange_hook
from lightning_dgc.exchange.state import ParamSettings
from lightning_dgc.tensor_ops.selection import topk_indices


class ConvNet(nn.Module):
    """A small conv net plus an MLP: compressed 4-D weights (1152 and 2304 values) and a compressed matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(2, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        )  # fmt: skip
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(256, 64), nn.Tanh(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.reshape(-1, 2, 4, 4)))


class Branchy(nn.Module):
    """A trunk used every step and a compressed branch used only when ``use_branch`` (even steps)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
        self.branch = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        out = self.trunk(x)
        return out + self.branch(x) if use_branch else out


def make_model(seed: int = 0, kind: str = "mlp") -> nn.Module:
    torch.manual_seed(seed)
    if kind == "wide":  # several compressed layers of different sizes, one large enough to be split
        return nn.Sequential(
            nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(),
            nn.Linear(32, 4),
        )  # fmt: skip
    if kind == "conv":
        return ConvNet()
    if kind == "branch":
        return Branchy()
    # 64x32 and 32x64 weights are compressed (>= 1024 values); the biases are averaged dense.
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 4))


def batch(rank: int, step: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 32, generator=g)
    y = (x[:, :4] * 2.0).tanh()  # a learnable target
    return x, y


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


def take_over_sgd(
    state: ExchangeState, model: nn.Module, momentum: float, nesterov: bool, weight_decay: float
) -> None:
    """What ``DGCStrategy`` does with an SGD optimizer: the exchange applies its momentum and weight decay."""
    settings = ParamSettings(momentum, nesterov, weight_decay)
    for name, _ in model.named_parameters():
        state.param_settings[name] = settings


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
    model_kind: str = "mlp",
    channels_last: bool = False,
    device: str = "cpu",
    same_data: bool = False,
    param_dtype: str | None = None,
) -> dict[str, Any]:
    """Train a toy model; optionally through the DGC hook. Returns per-step params and stats.

    ``model_kind``: ``"mlp"``, ``"wide"``, ``"conv"`` (conv net + MLP; ``channels_last`` puts it in that
    memory format) or ``"branch"`` (a branch used on even steps only: DDP runs with
    ``find_unused_parameters``). ``same_data``: every rank trains on rank 0's batches, so that their
    memory, not only their parameters, must agree. ``param_dtype``: e.g. ``"bfloat16"``, parameters
    (and so DDP's buckets) in that dtype, as Lightning's ``"bf16-true"`` makes them.
    """
    dtype = getattr(torch, param_dtype) if param_dtype is not None else torch.float32
    model = make_model(kind=model_kind).to(device, dtype)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, find_unused_parameters=model_kind == "branch")
    sgd = dict(sgd or {"lr": 0.1})
    state = None
    if use_hook:
        state = ExchangeState(algorithms.get(hook).config_class(**(config or {})), measure_buildup=True)
        state.register_parameters(model.named_parameters())
        if take_over:
            take_over_sgd(
                state,
                model,
                sgd.pop("momentum", 0.0),
                sgd.pop("nesterov", False),
                sgd.pop("weight_decay", 0.0),
            )
        ddp.register_comm_hook(state, exchange_hook)
    opt = torch.optim.SGD(model.parameters(), **sgd)
    params, losses, stats, finite, memory, plans_agree = [], [], [], [], [], []
    for step in range(steps):
        x, y = (t.to(device, dtype) for t in batch(0 if same_data else rank, step))
        opt.zero_grad()
        out = ddp(x, use_branch=step % 2 == 0) if model_kind == "branch" else ddp(x)
        loss = nn.functional.mse_loss(out, y)
        if poison is not None and poison == (rank, step):
            loss = loss * float("inf")
        loss.backward()
        if state is not None:
            ok = state.finish_step()
            finite.append(ok)
            stats.append(state.compression_stats())
            memory.append(state.memory.state_dict())
            plans = state.stats.last.plans if state.stats.last is not None else []
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


def sparse_reference(
    rank: int,
    world_size: int,
    *,
    steps: int,
    density: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    masking: bool = True,
) -> dict[str, Any]:
    """Compare the hook's decoded gradient with an independent computation of DGC (exact top-k).

    Every rank gathers all ranks' raw gradients and replays, in plain tensor code, each rank's DGC as Lin et
    al. write it: weight decay added to the local gradient, momentum correction (``u <- m u + g``, ``v <- v + u``),
    the top-k of ``v`` sent and cleared from it (and from ``u`` with momentum factor masking); small tensors
    averaged dense, SGD's momentum and weight decay applied to the average. ``momentum`` and ``weight_decay`` are
    taken over from SGD, as ``DGCStrategy`` does. It checks that what DDP wrote into ``.grad`` is that update.
    """
    model = make_model(kind="wide")
    ref_model = copy.deepcopy(model)
    ddp = DDP(model)
    state = ExchangeState(config=DGCConfig(density=density, selection="exact", momentum_masking=masking))
    state.register_parameters(model.named_parameters())
    if momentum or weight_decay:
        take_over_sgd(state, model, momentum, False, weight_decay)
    ddp.register_comm_hook(state, exchange_hook)
    u, v = ({n: torch.zeros(world_size, p.numel()) for n, p in model.named_parameters()} for _ in range(2))
    sgd_buffer = {n: torch.zeros(p.numel()) for n, p in model.named_parameters()}
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
            decay = weight_decay * rp.detach().reshape(-1)
            if p.dim() > 1 and p.numel() >= 1024:
                k = max(1, int(torch.tensor(density * p.numel()).ceil()))
                expected = torch.zeros_like(local)
                for r in range(world_size):
                    u[name][r] = momentum * u[name][r] + everyone[r] + decay
                    v[name][r] += u[name][r]
                    idx = topk_indices(v[name][r], k)
                    expected[idx] += v[name][r][idx]
                    v[name][r][idx] = 0.0
                    if masking:
                        u[name][r][idx] = 0.0
                expected /= world_size
            else:
                sgd_buffer[name] = momentum * sgd_buffer[name] + torch.stack(everyone).mean(0) + decay
                expected = sgd_buffer[name]
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
    state = ExchangeState(config=DGCConfig(density=density, local_clip_norm=clip))
    state.register_parameters(model.named_parameters())
    ddp.register_comm_hook(state, exchange_hook)
    norms: list[float] = []
    for step in range(3):
        x, y = batch(rank, step)
        model.zero_grad()
        (100.0 * nn.functional.mse_loss(ddp(x), y)).backward()  # large gradients: clipping must bite
        state.finish_step()
        norms += [float(p.grad.norm()) for p in model.parameters()]
    return norms


def sparse_embedding_error(rank: int, world_size: int) -> str:
    """The error the hook raises for a bucket of sparse gradients (``nn.Embedding(sparse=True)``)."""
    model = nn.Sequential(nn.Embedding(100, 16, sparse=True), nn.Flatten(), nn.Linear(32, 1))
    ddp = DDP(model)
    state = ExchangeState(config=DGCConfig(density=0.01))
    state.register_parameters(model.named_parameters())
    ddp.register_comm_hook(state, exchange_hook)
    try:
        ddp(torch.tensor([[1, 2], [3, 4]])).sum().backward()
    except Exception as error:  # DDP re-raises the hook's error from backward()
        return str(error)
    return ""


def powersgd_against_torch(rank: int, world_size: int, *, steps: int, config: dict) -> dict[str, Any]:
    """The same model and data through torch's ``powerSGD_hook`` and through ``algorithm="powersgd"``:
    every step's parameters of both, and the last step's statistics of ours.

    One bucket: with several, torch's hook hangs on gloo (it starts the P and Q all-reduces from
    future callbacks, in backend threads, and waits there, so ranks can start collectives in different
    orders). Ours starts every collective from the hook's thread; its several-bucket runs are tested
    elsewhere.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    from lightning_dgc.algorithms.powersgd import PowerSGDConfig

    ours = PowerSGDConfig(**config)
    runs: dict[str, Any] = {}
    for name in ("torch", "ours"):
        model = make_model(kind="conv")
        ddp = DDP(model)
        if name == "torch":
            state: Any = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=ours.matrix_approximation_rank,
                start_powerSGD_iter=ours.start_iter, use_error_feedback=ours.use_error_feedback,
                warm_start=ours.warm_start, random_seed=ours.seed,
            )  # fmt: skip
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        else:
            state = ExchangeState(ours)
            state.register_parameters(model.named_parameters())
            ddp.register_comm_hook(state, exchange_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        params = []
        for step in range(steps):
            x, y = batch(rank, step)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            if name == "ours":
                state.finish_step()
            opt.step()
            params.append(flat_params(model))
        runs[name] = params
        if name == "ours":
            runs["stats"] = state.compression_stats()
            runs["memory"] = state.memory.state_dict()
    return runs
