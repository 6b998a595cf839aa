"""What an algorithm sees of the exchange it runs in: :class:`ExchangeContext`.

An algorithm gets it as ``self.state`` (the second argument of ``Algorithm.__init__``). The exchange's own
object (:class:`lightning_dgc.exchange.state.ExchangeState`) carries more (the plans, the statistics, the checkpoint
entry, the step boundary), but those belong to the hook and the front doors: an algorithm that uses only the
members below keeps working when they change. ``tests/test_algorithm_context.py`` checks that the package's own
algorithms and the documented examples use nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lightning_dgc.tensor_ops.memory import ResidualMemory


@dataclass(frozen=True)
class ParamSettings:
    """Optimizer settings the exchange applies to one parameter (taken over from SGD, or defaults)."""

    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0


@runtime_checkable
class ExchangeContext(Protocol):
    """The exchange as an algorithm sees it: who and where it is, its memory, its random draws, its settings.

    * **world**: ``world_size`` and ``rank`` of the ranks this algorithm exchanges with (across the nodes in
      a two-level exchange, where the bucket is this rank's shard);
    * **step**: ``step`` (optimizer steps finished, skipped ones included) and ``skipped_steps``;
    * **memory**: ``memory``, the :class:`~lightning_dgc.tensor_ops.memory.ResidualMemory` keyed by parameter name and
      kind (``Algorithm.memory_kinds``), checkpointed and redistributed for the algorithm;
    * **random draws**: ``generator`` (this rank's own), :meth:`draw_generator` (this step's, the same on
      every rank) and :meth:`tensor_generator` (this step's for one parameter, the same on every rank and in
      every bucket layout);
    * **settings**: :meth:`settings_for` (the momentum, Nesterov and weight decay to apply to a parameter),
      :meth:`continues` (the parameter's gradient adds to a step whose momentum an earlier backward pass
      applied), :meth:`param` (the parameter itself, or a piece of it in a two-level shard) and
      ``finish_writes_grads`` (the decode may wait for the step's end, see ``Algorithm.deferred_decode``);
    * **statistics**: ``measures_buildup`` (count the union of all ranks' selections this step),
      :meth:`add_union_values` (add to it) and ``last_selection_ms`` (this rank's selection time in the
      previous step).
    """

    world_size: int
    rank: int
    step: int
    skipped_steps: int
    memory: ResidualMemory
    generator: torch.Generator

    def draw_generator(self, device: torch.device) -> torch.Generator: ...

    def tensor_generator(self, name: str, device: torch.device) -> torch.Generator: ...

    def settings_for(self, name: str) -> ParamSettings: ...

    def continues(self, name: str) -> bool: ...

    def param(self, name: str) -> Tensor: ...

    @property
    def finish_writes_grads(self) -> bool: ...

    @property
    def measures_buildup(self) -> bool: ...

    def add_union_values(self, count: int) -> None: ...

    @property
    def last_selection_ms(self) -> float: ...
