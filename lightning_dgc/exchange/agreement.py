"""Checks that every rank runs the same training: the same options at setup, the same settings in every step,
the same parameters every ``check_ranks_every`` optimizer steps. A rank that differs would otherwise make the
others block in a collective until the process group's timeout, or train on silently with other weights."""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from typing import Any

import torch

from lightning_dgc import comm
from lightning_dgc.algorithms.checks import whole_number
from lightning_dgc.exchange.state import ExchangeState

#: Optimizer steps between two comparisons of the ranks' parameters once the run is past its first steps (a checksum
#: each, see :func:`check_parameters_agree` and :func:`rank_check_due`): one check reads the parameters once, 2.3 ms
#: for ResNet-20 on one CPU thread, 0.3% of its 836 ms step (batch 128); every 100 steps, 0.003% of the run.
DEFAULT_CHECK_RANKS_EVERY = 100


def rank_check_due(step: int, every: int) -> bool:
    """Whether the ranks' parameters are compared after optimizer step ``step`` (counted from this process's start,
    so a resumed run is checked early too): at the powers of two below ``every`` (1, 2, 4, ..., 64 for 100), where a
    divergence shows within steps of its cause and costs the least training, then every ``every`` steps; never when
    ``every`` is 0. Seven checks more than ``every`` alone over a run, each one small gather."""
    if not every or step < 1:
        return False
    return step % every == 0 or (step < every and step & (step - 1) == 0)


def check_ranks_every_value(value: int | None) -> int:
    """``check_ranks_every`` validated: a whole number >= 0 (``None`` or 0: no parameter check)."""
    if value is not None and whole_number(value, "check_ranks_every") < 0:
        raise ValueError(f"`check_ranks_every` must be >= 0 (0 or None: no check), got {value}.")
    return int(value or 0)


def check_same_on_every_rank(name: str, value: Any, owner: str, everyone: Sequence[Any] | None = None) -> None:
    """Raise a ``ValueError`` on every rank, naming ``name`` and each rank's value, when the ranks were given
    different values (blocking: every rank calls it; ``everyone``: the gathered values, for a test)."""
    if everyone is None:
        everyone = comm.all_gather_object(value)
    if any(repr(v) != repr(everyone[0]) for v in everyone):
        per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(everyone))
        raise ValueError(
            f"{owner}: `{name}` differs between ranks ({per_rank}). Every rank must construct the strategy with the"
            f" same `{name}` (check per-rank config files, environment variables or code that depends on the rank)."
        )


def _settings(state: ExchangeState) -> torch.Tensor:
    """What must agree in every step: a checksum of the settings but ``density``, and ``density`` (NaN: none)."""
    density = state.density
    return torch.tensor(
        [float(zlib.crc32(state.config.fingerprint().encode())), math.nan if density is None else density],
        dtype=torch.float64,
    )


def check_settings_agree(state: ExchangeState, owner: str, group: Any = None) -> None:
    """Before a step's first exchange: raise on every rank if the ranks' settings differ (one changed ``density``
    alone, e.g. in a callback that runs on one rank). Costs one all-gather of 16 bytes per rank on the host.

    The ranks would otherwise plan payloads of different sizes and block in the exchange until the timeout.
    """
    everyone = [t.tolist() for t in comm.all_gather_host(_settings(state), group)]
    if all(v[0] == everyone[0][0] and repr(v[1]) == repr(everyone[0][1]) for v in everyone):
        return
    if any(repr(v[1]) != repr(everyone[0][1]) for v in everyone):
        per_rank = ", ".join(f"rank {r}: {v[1]:g}" for r, v in enumerate(everyone))
        raise RuntimeError(
            f"{owner}: `density` differs between ranks at step {state.step} ({per_rank}): it was set on some ranks"
            " only. Set `strategy.density` on every rank (a callback's hooks run on every rank: not under"
            " `rank_zero_only` or `if trainer.is_global_zero`); the ranks would otherwise block in the exchange."
        )
    configs = comm.all_gather_object(asdict(state.config))  # every rank saw the difference: every rank gathers
    fields = [k for k in configs[0] if any(c.get(k) != configs[0][k] for c in configs)]  # type: ignore[union-attr]
    detail = "; ".join(f"`{k}`: " + ", ".join(f"rank {r}: {c[k]!r}" for r, c in enumerate(configs)) for k in fields)  # type: ignore[index]
    raise RuntimeError(
        f"{owner}: the {state.algorithm.name} settings differ between ranks at step {state.step} ({detail}): a"
        " setting was changed on some ranks only. Change settings on every rank alike."
    )


def parameter_checksum(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """``[sum, sum of absolute values]`` of every value of ``params``, in float64, on the CPU."""
    values = [p.detach() for p in params]
    if not values:
        return torch.zeros(2, dtype=torch.float64)
    sums = torch.stack([v.sum(dtype=torch.float64) for v in values]).sum()
    norms = torch.stack([torch.linalg.vector_norm(v, 1, dtype=torch.float64) for v in values]).sum()
    return torch.stack([sums, norms]).cpu()


def _differing(everyone: Sequence[Sequence[float]]) -> list[int]:
    """The ranks whose checksum pair ``[sum, absolute sum]`` differs from rank 0's by more than 1e-12 of the
    largest absolute sum (float64 rounding in another summation order is far below it; a float32 parameter off by
    one unit in its last place in a model of a million parameters of size 1 is about 1e-13 of it, what a
    divergence of any cause grows past within steps)."""
    scale = max(v[1] for v in everyone)
    return [r for r, v in enumerate(everyone) if abs(v[0] - everyone[0][0]) > 1e-12 * scale
            or abs(v[1] - everyone[0][1]) > 1e-12 * scale]  # fmt: skip


def check_parameters_agree(
    named_params: Iterable[tuple[str, torch.Tensor]], owner: str, step: int, group: Any = None
) -> None:
    """Raise on every rank if the ranks' parameters differ (every rank calls it at the same step), naming the
    parameters that differ.

    The checksum of each rank (:func:`parameter_checksum`) is gathered (16 bytes per rank), and compared as
    :func:`_differing` says; only when ranks differ, a second gather of one checksum per parameter names them.
    """
    named = list(named_params)
    params = [p for _, p in named]
    label = "all-gather of the parameter checksums"
    everyone = [t.tolist() for t in comm.all_gather_host(parameter_checksum(params), group, label)]
    differ = _differing(everyone)
    if not differ:
        return
    per_parameter = comm.all_gather_host(torch.stack([parameter_checksum([p]) for p in params]), group, label)
    names = [n for i, (n, _) in enumerate(named) if _differing([t[i].tolist() for t in per_parameter])]
    shown = ", ".join(f"`{n}`" for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    lines = "; ".join(
        f"rank {r}: sum {v[0]:.17g} ({v[0] - everyone[0][0]:+.3g} from rank 0's), absolute sum {v[1]:.17g}"
        f" ({v[1] - everyone[0][1]:+.3g})"
        for r, v in enumerate(everyone)
    )
    raise RuntimeError(
        f"{owner}: the ranks' parameters differ after optimizer step {step}: ranks {differ} differ from rank 0 in"
        f" {len(names)} of {len(named)} parameters ({shown}; {lines}). Data-parallel ranks must hold identical"
        " parameters. Likely causes: an algorithm whose"
        " decisions depend on the process (Python's hash() of a str, id(), set order; test it with"
        " lightning_dgc.kit.check_algorithm), a setting or a parameter changed on some ranks only (e.g. in"
        " code under `rank_zero_only`), or kernels that compute differently on different machines."
        " `check_ranks_every=None` turns this check off."
    )
