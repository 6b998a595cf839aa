"""DiLoCo's rounds, without Lightning or collectives: the outer settings (:class:`OuterSettings`), and Streaming
DiLoCo's schedule (Douillard et al., 2025, "Streaming DiLoCo with overlapping communication"): which parameters form
each *fragment*, when each fragment sends its pseudo-gradient, and when the answer is merged back.
:class:`lightning_dgc.local_steps.outer.OuterStep` runs them.

- **Fragments**: the trained tensors are split into ``fragments`` groups of about equal size (largest tensor first
  into the lightest group; ties to the lower index; each group in model order). A fragment is the unit of one outer
  exchange, so the largest message is about ``1 / fragments`` of the model instead of all of it.
- **Staggered rounds**: every fragment has a round of ``sync_every`` optimizer steps, and fragment ``p``'s first round
  ends after ``(p + 1) * sync_every // fragments`` steps, so the fragments send at evenly spread steps of the round
  (at most one a step) and the last one at ``sync_every``, ``2 * sync_every``, ... as plain DiLoCo does.
- **Overlap**: with ``overlap_steps = t > 0`` the exchange a fragment starts after step ``s`` is waited for after step
  ``s + t``; the ranks train on in between, and the answer (the new global weights of the fragment) is mixed into the
  local weights that moved on: ``local := mixing * local + (1 - mixing) * global``. With ``t = 0`` the local weights
  are replaced, as DiLoCo does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from torch import Tensor

from lightning_dgc.algorithms.checks import flag, real_number, whole_number


@dataclass
class OuterSettings:
    """DiLoCo's outer loop, validated on construction (a ``ValueError`` names the argument and the fix).

    Args:
        sync_every: optimizer steps of every rank between two outer steps (DiLoCo's ``H``; the paper uses 500).
        outer_lr: the outer SGD's learning rate (the paper: 0.7).
        outer_momentum: the outer SGD's momentum (the paper: 0.9).
        outer_nesterov: Nesterov momentum, with torch's SGD semantics (the paper: ``True``).
        offload: keep the global weights and the outer momentum in host memory (two model sizes in fp32 off the
            device), copied over at every outer step.
        fragments: Streaming DiLoCo's fragments (:mod:`lightning_dgc.streaming`): the trained tensors split into this
            many groups of about equal size, each with its own round of ``sync_every`` steps, staggered so that the
            fragments send at evenly spread steps; 1 (the default) is plain DiLoCo.
        overlap_steps: optimizer steps a fragment's exchange runs behind the inner steps before its answer is
            merged (0: at once, as DiLoCo); must be below ``sync_every``.
        mixing: with ``overlap_steps``, the merge ``local := mixing * local + (1 - mixing) * global`` (0: replace).
    """

    sync_every: int
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    offload: bool = False
    fragments: int = 1
    overlap_steps: int = 0
    mixing: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int | float):
            raise ValueError(
                f"`sync_every` is the number of optimizer steps between outer steps and must be a whole number >= 1,"
                f" got {self.sync_every!r}: pass e.g. sync_every=500 (DiLoCo's H)."
            )
        self.sync_every = whole_number(self.sync_every, "sync_every")
        if self.sync_every < 1:
            raise ValueError(
                f"`sync_every` must be >= 1 (optimizer steps between outer steps), got {self.sync_every}: pass e.g."
                " sync_every=500 (DiLoCo's H); sync_every=1 exchanges after every step."
            )
        self.outer_lr = real_number(self.outer_lr, "outer_lr")
        if not (math.isfinite(self.outer_lr) and self.outer_lr > 0.0):
            raise ValueError(f"`outer_lr` must be a finite number > 0, got {self.outer_lr!r}: DiLoCo uses 0.7.")
        self.outer_momentum = real_number(self.outer_momentum, "outer_momentum")
        if not (math.isfinite(self.outer_momentum) and 0.0 <= self.outer_momentum < 1.0):
            raise ValueError(
                f"`outer_momentum` must be a finite number in [0, 1), got {self.outer_momentum!r}: DiLoCo uses 0.9."
            )
        self.outer_nesterov = flag(self.outer_nesterov, "outer_nesterov")
        if self.outer_nesterov and self.outer_momentum == 0.0:
            raise ValueError("`outer_nesterov=True` needs an `outer_momentum` > 0: pass outer_nesterov=False.")
        self.offload = flag(self.offload, "offload")
        self.fragments = whole_number(self.fragments, "fragments")
        if not 1 <= self.fragments <= self.sync_every:
            raise ValueError(
                f"`fragments` must be between 1 and sync_every={self.sync_every} (each fragment sends at its own step"
                f" of the round), got {self.fragments}: pass e.g. fragments=4, or fragments=1 for plain DiLoCo."
            )
        self.overlap_steps = whole_number(self.overlap_steps, "overlap_steps")
        if not 0 <= self.overlap_steps < self.sync_every:
            raise ValueError(
                f"`overlap_steps` must be >= 0 and below sync_every={self.sync_every} (a fragment's answer is merged"
                f" before it sends again), got {self.overlap_steps}: pass e.g. overlap_steps=1, or 0 to wait at once."
            )
        self.mixing = real_number(self.mixing, "mixing")
        if not (math.isfinite(self.mixing) and 0.0 <= self.mixing < 1.0):
            raise ValueError(
                f"`mixing` must be a finite number in [0, 1) (the local weights' share in the merge), got"
                f" {self.mixing!r}: pass e.g. mixing=0.5, or 0 to replace the local weights by the global ones."
            )


#: The streaming settings and their plain-DiLoCo values, :class:`OuterSettings`'s defaults (a checkpoint written
#: before they existed had these).
STREAMING_DEFAULTS = {
    f.name: f.default for f in fields(OuterSettings) if f.name in ("fragments", "overlap_steps", "mixing")
}


def split_fragments(sizes: list[int], fragments: int) -> list[list[int]]:
    """The indices (into ``sizes``) of each fragment's tensors, in order; about equal sums, none empty."""
    if fragments > len(sizes):
        raise ValueError(
            f"`fragments={fragments}` splits the trained tensors into that many groups, but the model has"
            f" {len(sizes)}: pass fragments <= {len(sizes)}."
        )
    groups: list[list[int]] = [[] for _ in range(fragments)]
    load = [0] * fragments
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        lightest = min(range(fragments), key=lambda g: (load[g], g))
        groups[lightest].append(i)
        load[lightest] += sizes[i]
    return [sorted(g) for g in groups]


def first_round(fragment: int, fragments: int, sync_every: int) -> int:
    """Optimizer steps of ``fragment``'s first round (every later round has ``sync_every``)."""
    return (fragment + 1) * sync_every // fragments


@dataclass
class InFlight:
    """One fragment's outer exchange between its start and its merge.

    ``members``: the indices of its tensors (those of fragment ``fragment``; -1: every tensor, the last outer step
    of ``fit``); ``merge_in``: optimizer steps until the merge; ``handle``: what the exchange returned (``.wait()``
    gives the mean), ``None`` on a rank that exchanges nothing (a node's other ranks) and once the exchange is
    done; ``done``: the mean was received and the outer SGD stepped (or skipped);
    ``finite``: the verdict; ``sent`` / ``link``: this rank's bytes; ``replace``: the merge replaces the local weights
    (the last outer step of ``fit``) instead of mixing them."""

    members: list[int]
    merge_in: int
    fragment: int = -1
    handle: Any = None
    done: bool = False
    finite: bool = True
    sent: int = 0
    link: float = 0.0
    replace: bool = False
    flat: Tensor | None = field(default=None, repr=False)  # the pseudo-gradient, kept alive until the exchange ends

    def state_dict(self) -> dict[str, Any]:
        assert self.done, "an exchange is saved once it is done (OuterStep.settle)"
        return {
            "members": list(self.members), "merge_in": self.merge_in, "fragment": self.fragment,
            "finite": self.finite, "sent": self.sent, "link": self.link, "replace": self.replace,
        }  # fmt: skip

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> InFlight:
        return cls(
            list(state["members"]), int(state["merge_in"]), int(state["fragment"]), done=True,
            finite=bool(state["finite"]), sent=int(state["sent"]), link=float(state["link"]),
            replace=bool(state["replace"]),
        )  # fmt: skip
