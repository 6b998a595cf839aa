"""Random-k with error feedback, written as a user would in their own module: the public API only.

Every rank sends the same ``k`` random positions of each tensor (drawn per tensor name and step, so a
resumed run draws what the straight run did), one all-reduce per bucket; what is not sent is held back
in the memory and added to the next step's gradient. ``Trainer(strategy="randomk")`` trains with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_dgc import (
    Algorithm,
    AlgorithmConfig,
    BucketPlan,
    BucketWork,
    Message,
    WireCost,
    register,
)


@dataclass
class RandomKConfig(AlgorithmConfig):
    """density: the fraction of each tensor's values sent per step, in (0, 1]; seed: of the draws."""

    density: float = 0.01
    seed: int = 0


@dataclass
class RandomKWork(BucketWork):
    residual: Tensor | None = None  # gradient + what was held back; what stays in it is held back again
    index: Tensor | None = None  # the bucket positions sent
    values: Tensor | None = None  # their values, summed over the ranks by the all-reduce


@register
class RandomK(Algorithm[RandomKConfig, BucketPlan, RandomKWork]):
    name = "randomk"
    config_class = RandomKConfig
    memory_kinds = ("error",)
    residual_kind = "error"

    def plan_key(self) -> tuple[float]:
        return (self.config.density,)

    def plan(self, layout, buffer):
        return BucketPlan(layout, buffer.numel() * buffer.element_size())

    def compensate(self, plan, grads, flat):
        return RandomKWork(grads, flat, residual=self.error_feedback(plan.layout, flat))

    def select(self, plan, work):
        device, picks = work.flat.device, []
        for s in plan.layout:  # the same positions on every rank: drawn per tensor name and step
            generator = self.state.tensor_generator(s.name, device)
            draw = torch.randperm(s.numel, generator=generator, device=device)
            picks.append(draw[: k(self.config, s.numel)] + s.offset)
        work.index = torch.cat(picks)
        work.values = work.residual[work.index] + work.poison  # poison: NaN on every rank if this one's is
        work.residual[work.index] = 0.0  # sent: no longer held back
        work.keep.append(work.index)  # made here, read by the decode (CUDA streams)

    def exchange(self, plan, work, collectives):
        return [collectives.all_reduce(work.values, "all-reduce of the random-k values")]

    def decode(self, plan, work):
        return work.flat.zero_().index_put_((work.index,), work.values / self.state.world_size)

    @classmethod
    def wire_cost(cls, config, layout, world_size, dense_bytes):
        sent = sum(k(config, s.numel) for s in layout)
        message = Message("all_reduce", sent * 4, "payload")  # fp32 values
        return WireCost((message,), dense_bytes, numel=sum(s.numel for s in layout), k=sent, values_sent=sent)


def k(config: RandomKConfig, numel: int) -> int:
    return min(numel, max(1, math.ceil(config.density * numel)))
