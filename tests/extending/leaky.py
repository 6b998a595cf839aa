"""A deliberately broken random-k (sends k values, forgets the rest): check_algorithm must catch it."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_dgc.algorithms import register
from tests.extending.randomk import RandomK, RandomKConfig


@dataclass
class LeakyConfig(RandomKConfig):
    pass


@register
class LeakyRandomK(RandomK):
    name = "leaky_randomk"
    config_class = LeakyConfig

    def compensate(self, plan, grads, flat):
        work = super().compensate(plan, grads, flat)
        work.residual.copy_(flat)  # the bug: what was held back is dropped instead of added
        return work
