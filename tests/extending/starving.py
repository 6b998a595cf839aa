"""A deliberately broken random-k that never draws the first value of a tensor unless it sends every value: at
density 1 it is exact (the lossless check passes) and it conserves the gradient (the first value is held back in
its error-feedback memory, forever). ``check_algorithm``'s liveness check must catch it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_dgc.algorithms import register
from tests.extending.randomk import RandomK, RandomKConfig, k


@dataclass
class StarvingConfig(RandomKConfig):
    pass


@register
class StarvingRandomK(RandomK):
    name = "starving_randomk"
    config_class = StarvingConfig

    def select(self, plan, work):
        picks = []
        for s in plan.layout:
            generator = self.state.tensor_generator(s.name, work.flat.device)
            count = k(self.config, s.numel)
            if count < s.numel:  # the bug: position 0 is never drawn
                draw = torch.randperm(s.numel - 1, generator=generator, device=work.flat.device) + 1
            else:
                draw = torch.arange(s.numel, device=work.flat.device)
            picks.append(draw[:count] + s.offset)
        work.index = torch.cat(picks)
        work.values = work.residual[work.index] + work.poison
        work.residual[work.index] = 0.0
        work.keep.append(work.index)
