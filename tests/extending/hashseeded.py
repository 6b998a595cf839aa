"""A deliberately broken random-k that seeds its draws with Python's ``hash()`` of the tensor's name: ``hash`` of
a ``str`` is salted per process (``PYTHONHASHSEED``), so ranks in one process agree and real ranks, separate
processes, draw other positions and diverge. ``check_algorithm`` and the strategies' rank check must catch it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_dgc.algorithms import register
from tests.extending.randomk import RandomK, RandomKConfig, k


@dataclass
class HashSeededConfig(RandomKConfig):
    pass


@register
class HashSeededRandomK(RandomK):
    name = "hashseeded_randomk"
    config_class = HashSeededConfig

    def select(self, plan, work):
        picks = []
        for s in plan.layout:
            # the bug: hash(str) differs from process to process
            generator = torch.Generator(device=work.flat.device).manual_seed(hash(s.name) % (1 << 62) + self.state.step)
            draw = torch.randperm(s.numel, generator=generator, device=work.flat.device)
            picks.append(draw[: k(self.config, s.numel)] + s.offset)
        work.index = torch.cat(picks)
        work.values = work.residual[work.index] + work.poison
        work.residual[work.index] = 0.0
        work.keep.append(work.index)
