"""The exchange's random draws: generators the same on every rank, seeded from the configuration's seed and the
step (and, for draws that resume exactly, the parameter's name)."""

from __future__ import annotations

import zlib
from typing import Any

import torch


class RandomDraws:
    """The generators of :class:`~lightning_dgc.exchange.state.ExchangeState`, which sets ``config``, ``step`` and
    the two (empty) generator tables."""

    config: Any
    step: int
    _draw_generators: dict[torch.device, tuple[torch.Generator, int]]
    _tensor_generators: dict[torch.device, torch.Generator]

    def draw_generator(self, device: torch.device) -> torch.Generator:
        """A generator on ``device`` for this step's random draws, the same on every rank.

        Seeded from the configuration's seed and the step counter at the first draw of every step, and
        then drawn from bucket after bucket: it needs no state in checkpoints, but what a bucket draws
        depends on the buckets before it in the step. DDP's first step after a (re)start runs its
        initial bucket order, not the rebuilt one the straight run had reached, so a resumed run's first
        step can draw differently (every rank alike). For draws that resume exactly use
        :meth:`tensor_generator`.
        """
        generator, step = self._draw_generators.get(device, (None, -1))
        if generator is None:
            generator = torch.Generator(device=device)
        if step != self.step:
            generator.manual_seed(int(self.config.seed) * 1_000_003 + self.step)
            self._draw_generators[device] = (generator, self.step)
        return generator

    def tensor_generator(self, name: str, device: torch.device) -> torch.Generator:
        """A generator on ``device`` for parameter ``name``'s random draws in this step, the same on every rank.

        Seeded from the configuration's seed, the step counter and the parameter's name only: what a
        tensor draws does not depend on the bucket order, so a resumed run draws exactly what the straight
        run would, whatever order DDP's buckets are in. One generator per device is re-seeded at every
        call: draw from it before asking for the next tensor's.
        """
        generator = self._tensor_generators.get(device)
        if generator is None:
            generator = self._tensor_generators[device] = torch.Generator(device=device)
        key = zlib.crc32(name.encode()) * 1_000_003 + self.step * 7_919 + int(self.config.seed) * 104_729
        generator.manual_seed(key % (1 << 63))
        return generator
