"""A deliberately broken random-k that never sends the first value of any tensor, at any density (it holds it
back in its error-feedback memory forever, so conservation holds): ``check_algorithm`` must catch it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_dgc.algorithms import Message, WireCost, register
from tests.extending.randomk import RandomK, RandomKConfig, k


@dataclass
class HoldBackConfig(RandomKConfig):
    pass


def sent(config: RandomKConfig, numel: int) -> int:
    return min(k(config, numel), numel - 1)  # the bug: position 0 is never among them


@register
class HoldBackRandomK(RandomK):
    name = "holdback_randomk"
    config_class = HoldBackConfig

    def select(self, plan, work):
        picks = []
        for s in plan.layout:
            generator = self.state.tensor_generator(s.name, work.flat.device)
            draw = torch.randperm(s.numel - 1, generator=generator, device=work.flat.device) + 1
            picks.append(draw[: sent(self.config, s.numel)] + s.offset)
        work.index = torch.cat(picks)
        work.values = work.residual[work.index] + work.poison
        work.residual[work.index] = 0.0
        work.keep.append(work.index)

    @classmethod
    def wire_cost(cls, config, layout, world_size, dense_bytes):
        count = sum(sent(config, s.numel) for s in layout)
        return WireCost((Message("all_reduce", count * 4, "payload"),), dense_bytes,
                        numel=sum(s.numel for s in layout), k=count, values_sent=count)  # fmt: skip


@dataclass
class KeepCopyConfig(RandomKConfig):
    pass


@register
class KeepCopyRandomK(RandomK):
    """Another bug: it sends every value it picks, but keeps the first one in its memory as well."""

    name = "keepcopy_randomk"
    config_class = KeepCopyConfig

    def select(self, plan, work):
        super().select(plan, work)
        work.residual[work.index[:1]] = work.values[:1]
