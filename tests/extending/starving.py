"""A deliberately broken random-k that never draws the first value of a tensor unless it sends every value: at
density 1 it is exact (the lossless check passes) and it conserves the gradient (the first value is held back in
its error-feedback memory, forever). ``check_algorithm``'s liveness check must catch it."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_dgc.algorithms import register
from tests.extending.holdback import HoldBackRandomK
from tests.extending.randomk import RandomK, RandomKConfig


@dataclass
class StarvingConfig(RandomKConfig):
    pass


@register
class StarvingRandomK(HoldBackRandomK):
    """``holdback_randomk`` below density 1 (position 0 never drawn), plain random-k (every value) at density 1."""

    name = "starving_randomk"
    config_class = StarvingConfig

    def select(self, plan, work):
        (RandomK if self.config.density >= 1.0 else HoldBackRandomK).select(self, plan, work)

    @classmethod
    def wire_cost(cls, config, layout, world_size, dense_bytes):
        parent = RandomK if config.density >= 1.0 else HoldBackRandomK
        return parent.wire_cost.__func__(cls, config, layout, world_size, dense_bytes)
