"""The simulated run behind :func:`~lightning_dgc.kit.check.check_algorithm` and its replay: ranks as threads,
their collectives counted, every step's updates and memories recorded."""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_dgc import comm
from lightning_dgc.algorithms import AlgorithmConfig
from lightning_dgc.comm import Collectives, LocalCollectives, Pending
from lightning_dgc.exchange import hook
from lightning_dgc.exchange.state import ExchangeState

__all__ = ["DEFAULT_SHAPES", "CountingCollectives"]

#: The tensors :func:`check_algorithm` exchanges by default: matrices large enough to be compressed by
#: every algorithm of the package, and the small and 1-D ones that are usually averaged dense.
DEFAULT_SHAPES: dict[str, tuple[int, ...]] = {
    "encoder.weight": (48, 64),
    "encoder.bias": (48,),
    "hidden.weight": (32, 48),
    "head.weight": (10, 32),
    "head.bias": (10,),
}


class CountingCollectives(LocalCollectives):
    """A simulated rank that counts the bytes handed to each collective (what a process group would send)."""

    def __init__(self, inner: LocalCollectives) -> None:
        super().__init__(inner.group, inner.rank)
        self.nbytes = 0

    def all_reduce(self, tensor: Tensor, what: str) -> Pending:
        self.nbytes += tensor.numel() * tensor.element_size()
        return super().all_reduce(tensor, what)

    def all_gather(self, tensor: Tensor, out: Tensor, what: str) -> Pending:
        self.nbytes += tensor.numel() * tensor.element_size()
        return super().all_gather(tensor, out, what)


@dataclass
class _Step:
    """One rank's result of one step."""

    updates: dict[str, Tensor]  # per tensor, flat
    finite: bool
    bytes_handed: int
    bytes_costed: int


class _Rank:
    """One simulated rank: its parameters and its exchange state."""

    def __init__(self, config: AlgorithmConfig, shapes: dict[str, tuple[int, ...]], seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.params = {
            name: torch.nn.Parameter(torch.randn(shape, generator=generator))
            for name, shape in shapes.items()
        }
        self.config = config

    def make_state(self, collectives: Collectives) -> ExchangeState:
        state = ExchangeState(self.config, collectives=collectives)
        state.register_parameters(self.params.items())
        return state

    def step(
        self, state: ExchangeState, counting: CountingCollectives, grads: dict[str, Tensor],
        buckets: Sequence[Sequence[str]],
    ) -> _Step:  # fmt: skip
        for name, param in self.params.items():
            param.grad = grads[name].clone()
        before = counting.nbytes
        futures = []
        for bucket in buckets:
            params = [self.params[name] for name in bucket]
            buffer = torch.cat([grads[name].reshape(-1) for name in bucket])
            futures.append((bucket, hook.exchange(state, params, buffer)))
        updates: dict[str, Tensor] = {}
        for bucket, future in futures:
            flat = future.wait()
            parts = flat.split([self.params[name].numel() for name in bucket])
            updates.update({name: part.clone() for name, part in zip(bucket, parts, strict=True)})
        finite = state.finish_step()
        sent = int(state.compression_stats().get("bytes_sent", 0))
        return _Step(updates, finite, counting.nbytes - before, sent)


def _gradients(shapes: dict[str, tuple[int, ...]], seed: int, rank: int, step: int) -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7_919 + step)
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def _steady_gradients(shapes: dict[str, tuple[int, ...]], seed: int, rank: int) -> dict[str, Tensor]:
    """A gradient nowhere near zero: one sign per value on every rank, a magnitude in [0.5, 1) per rank."""
    signs = _gradients(shapes, seed, 0, -1)
    sizes = _gradients(shapes, seed, rank + 1, -1)
    return {n: signs[n].sign() * (0.5 + 0.5 * torch.special.ndtr(sizes[n])) for n in shapes}


def _run(
    config: AlgorithmConfig,
    world_size: int,
    shapes: dict[str, tuple[int, ...]],
    buckets: Sequence[Sequence[str]],
    steps: range,
    seed: int,
    saved: list[bytes] | None = None,
    save_after: int | None = None,
    poison: tuple[int, int] | None = None,
    steady: bool = False,
) -> tuple[list[list[_Step]], list[dict[str, dict[str, Tensor]]], list[bytes]]:
    """Run ``steps`` on simulated ranks (from ``saved`` states if given); per rank: the steps, the
    committed memory after each step, and the states saved after step ``save_after``. ``steady``: every step's
    gradient is :func:`_steady_gradients`'."""

    def rank_fn(collectives: Collectives) -> tuple[list[_Step], list[dict[str, dict[str, Tensor]]], bytes]:
        assert isinstance(collectives, LocalCollectives)
        rank = collectives.rank
        counting = CountingCollectives(collectives)
        member = _Rank(config, shapes, seed)
        state = member.make_state(counting)
        if saved is not None:
            state.load_state_dict(torch.load(io.BytesIO(saved[rank]), weights_only=True))
        results, memories, blob = [], [], b""
        for step in steps:
            grads = _steady_gradients(shapes, seed, rank) if steady else _gradients(shapes, seed, rank, step)
            if poison is not None and (step, rank) == poison:
                grads[next(iter(grads))].view(-1)[0] = float("nan")
            results.append(member.step(state, counting, grads, buckets))
            memories.append(
                {
                    kind: {n: t.clone() for n, t in by_name.items()}
                    for kind, by_name in state.memory.committed.items()
                }
            )
            if save_after is not None and step == save_after:
                buffer = io.BytesIO()
                torch.save(state.state_dict(), buffer)
                blob = buffer.getvalue()
        return results, memories, blob

    out = comm.simulate(world_size, rank_fn)
    return [r[0] for r in out], [r[1] for r in out], [r[2] for r in out]
