"""The authors' kit: :func:`check_algorithm` tests any compression algorithm, the package's and yours.

Run it in your own tests, on the CPU (the ranks are simulated by :func:`lightning_dgc.comm.simulate`, one
thread each; the replay in another process starts one Python interpreter on the first call, about 2 s, and
reuses it; a call takes well under a second after that)::

    from lightning_dgc.kit import check_algorithm

    def test_randomk() -> None:
        check_algorithm(RandomKConfig(density=0.1), lossless=RandomKConfig(density=1.0))

It drives the generic hook (:func:`lightning_dgc.exchange.hook.exchange`) over a few small tensors in two
buckets and a few steps, with different gradients on every rank, and checks:

1. **ranks identical**: every rank decodes bit-identical updates, and so does the same run replayed in
   another process, started with another ``PYTHONHASHSEED`` (``separate_process=True``): real ranks are
   separate processes, and an algorithm whose decisions depend on the process (Python's ``hash()`` of a
   ``str``, object ids) agrees with itself on simulated ranks, which are threads of one process, but
   diverges on real ones;
2. **lossless** (the algorithm at its lossless setting, ``lossless=``; by default ``density=1`` for a
   configuration with a ``density`` field, checked with ``conservation``): the update equals the mean of
   the ranks' gradients in every step and nothing is held back after it: no value may stay unsent for a
   step (an algorithm that never sends some value holds it back forever, which conservation alone allows);
3. **conservation** (for an algorithm with ``residual_kind``): what came in is what went out plus
   what is held back, ``sum_t update_t + mean_r residual_r == mean_r sum_t grad_r,t``, per tensor
   (error feedback loses nothing; it holds for settings without momentum or weight decay in the
   exchange: pass ``conservation=False`` otherwise);
4. **resume**: a run saved after some steps (through ``torch.save`` and ``torch.load(weights_only=True)``)
   and loaded into fresh states decodes what the straight run does, bit for bit (with
   ``reorder_buckets_on_resume=True`` the resumed run also gets its buckets in the other order, as DDP's
   first step after a restart may: only draws keyed by tensor, ``state.tensor_generator``, pass that);
5. **non-finite step**: a NaN in one rank's gradient makes every rank skip the step
   (``finish_step()`` is ``False``) with the memory exactly as it was, and the next step is fine;
6. **wire cost**: the bytes the algorithm's :meth:`~lightning_dgc.algorithms.Algorithm.wire_cost` says
   (``compression_stats()["bytes_sent"]``) are the bytes it handed to the collectives;
7. **liveness**: under a steady gradient (the same on every step, of one sign on every rank, nowhere zero),
   every value is sent within a bounded number of steps: an algorithm that never sends some value starves it
   (its residual grows without bound and the model never learns it), which conservation allows and the
   lossless setting need not show. The bound is the steps in which a fair draw of the fraction ``f`` of the
   values that the algorithm sends a step misses one of ``n`` values with odds below ``e**-12``:
   ``(ln n + 12) / f`` (top-k with error feedback sends each value every ``1/f`` steps or so).

A failed check raises an ``AssertionError`` that names it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Literal

import torch
from torch import Tensor

from lightning_dgc.algorithms import AlgorithmConfig
from lightning_dgc.algorithms.base import algorithm_for
from lightning_dgc.kit.replay import _replay_elsewhere
from lightning_dgc.kit.run import DEFAULT_SHAPES, CountingCollectives, _gradients, _run, _steady_gradients

__all__ = ["DEFAULT_SHAPES", "CountingCollectives", "check_algorithm"]

def _check_liveness(
    config: AlgorithmConfig, world_size: int, shapes: dict[str, tuple[int, ...]], buckets: Sequence[Sequence[str]],
    seed: int, liveness_steps: int | Literal["auto"],
) -> None:  # fmt: skip
    """Check 7 (see the module docstring): every value's update is non-zero within the bound under a steady
    gradient; ``"auto"`` measures the fraction sent over 8 steps and sets the bound (at most 2,000 steps)."""
    n = sum(math.prod(shape) for shape in shapes.values())
    if liveness_steps == "auto":
        probe, _, _ = _run(config, world_size, shapes, buckets, range(8), seed, steady=True)
        sent = sum(int((u != 0).sum()) for step in probe[0] for u in step.updates.values()) / (8 * n)
        horizon = math.ceil((math.log(n) + 12) / max(sent, 1e-9))
        if horizon > 2000:
            raise ValueError(
                f"check_algorithm({type(config).__name__}): it sends {sent:.3g} of the values a step, so the liveness"
                f" check needs {horizon} steps to tell a value starved from one not drawn yet. Pass"
                f" liveness_steps={horizon} (a few ms a step), check a denser setting, or liveness_steps=None to"
                " skip the check."
            )
    else:
        horizon = liveness_steps
    run, memories, _ = _run(config, world_size, shapes, buckets, range(horizon), seed, steady=True)
    kind = algorithm_for(config).residual_kind
    for name in shapes:  # the updates are the same on every rank (check 1)
        ever = torch.stack([step.updates[name] != 0 for step in run[0]]).any(0)
        if bool(ever.all()):
            continue
        first = int((~ever).nonzero()[0])
        residual = memories[0][-1].get(kind or "", {}).get(name, torch.zeros(ever.shape)).reshape(-1)[first]
        steps = float(residual / _steady_gradients(shapes, seed, 0)[name].reshape(-1)[first])
        at = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), shapes[name]))
        raise _fail(
            config, "liveness",
            f"{name}: {int((~ever).sum())} of {ever.numel()} values were never sent in {horizon} steps of a steady"
            f" gradient (first: value {first}, at {at}" + (f"; rank 0 holds {steps:.0f} steps of its gradient back"
            if kind else "") + "). Every value must be sent within a bounded number of steps, or its error feedback"
            " grows without bound and the model never learns it.",
        )  # fmt: skip


def _fail(config: AlgorithmConfig, check: str, detail: str) -> AssertionError:
    return AssertionError(f"check_algorithm({type(config).__name__}): {check}: {detail}")


def _same_updates(a: dict[str, Tensor], b: dict[str, Tensor]) -> list[str]:
    """The tensors whose updates are not bit-identical (NaN equal to NaN)."""
    return [name for name in a if not torch.equal(a[name].nan_to_num(7.0), b[name].nan_to_num(7.0))]


def check_algorithm(
    config: AlgorithmConfig,
    *,
    lossless: AlgorithmConfig | Literal["auto"] | None = "auto",
    world_size: int = 2,
    steps: int = 4,
    shapes: dict[str, tuple[int, ...]] | None = None,
    buckets: Sequence[Sequence[str]] | None = None,
    conservation: bool = True,
    conservation_rtol: float = 1e-4,
    reorder_buckets_on_resume: bool = False,
    seed: int = 0,
    separate_process: bool = True,
    liveness_steps: int | Literal["auto"] | None = "auto",
) -> None:
    """Check an algorithm's contract on ``world_size`` simulated ranks (see the module docstring).

    Args:
        config: the algorithm's configuration (the registered algorithm that takes its class runs);
            it must compress from the first step (e.g. PowerSGD's ``start_iter`` below ``steps``).
        lossless: the same algorithm at a setting that must give exactly the mean and hold nothing back
            (``None``: not checked; ``"auto"``: ``config`` with ``density=1.0`` if it has a ``density`` field
            and ``conservation`` is checked, else not checked).
        world_size: simulated ranks (at least 2).
        steps: steps per run (at least 2: the resumed run loads the state saved halfway).
        shapes: the tensors by name (default :data:`DEFAULT_SHAPES`).
        buckets: the names of each bucket, in hook order (default: two buckets, the tensors in reverse
            order, as DDP lays them out).
        conservation: check that error feedback conserves the gradient (needs ``residual_kind``, and
            neither momentum nor weight decay in the exchange).
        conservation_rtol: its tolerance, relative to the largest mean gradient (values sent in fp16
            lose their rounding error: about 1e-3).
        reorder_buckets_on_resume: the resumed run gets the buckets in reverse order.
        seed: of the parameters and gradients.
        separate_process: also replay the run in another Python process, with another ``PYTHONHASHSEED``,
            and require the same updates (the configuration's class must be importable there).
        liveness_steps: the steps of the liveness check (``"auto"``: the bound of the module docstring, from the
            fraction of values the algorithm sends a step, at most 2,000 steps, else a ``ValueError`` that gives
            the steps needed; ``None``: not checked).


    Raises:
        AssertionError: naming the first check that failed.
    """
    if world_size < 2:
        raise ValueError(f"check_algorithm needs world_size >= 2 simulated ranks, got {world_size}.")
    if steps < 2:
        raise ValueError(f"check_algorithm needs steps >= 2 (the resume check saves halfway), got {steps}.")
    shapes = dict(shapes if shapes is not None else DEFAULT_SHAPES)
    if buckets is None:
        names = list(shapes)[::-1]
        half = (len(names) + 1) // 2
        buckets = [names[:half], names[half:]]
    buckets = [list(b) for b in buckets]
    if sorted(n for b in buckets for n in b) != sorted(shapes):
        raise ValueError("check_algorithm: `buckets` must hold every name of `shapes` exactly once.")
    config = replace(config)

    kind = algorithm_for(config).residual_kind
    if lossless == "auto":
        has_density = any(f.name == "density" for f in fields(config)) and config.density is not None
        lossless = replace(config, density=1.0) if has_density and conservation else None  # type: ignore[call-arg]

    # 1, 3, 6: the straight run (and the same run in another process).
    straight, memories, saved = _run(
        config, world_size, shapes, buckets, range(steps), seed, save_after=steps // 2 - 1
    )
    if separate_process:
        elsewhere = _replay_elsewhere(config, (config, world_size, shapes, buckets, range(steps), seed))
        for t in range(steps):
            for rank in range(world_size):
                differ = _same_updates(straight[rank][t].updates, elsewhere[rank][t])
                if differ:
                    raise _fail(
                        config, "ranks identical",
                        f"step {t}, rank {rank}: the same run in another process (another PYTHONHASHSEED) decoded"
                        f" other updates for {differ}. Real ranks are separate processes: they would diverge."
                        " Draw from state.tensor_generator(name, device) or state.draw_generator(device); never"
                        " seed or decide with Python's hash() of a str (salted per process), id() or set order.",
                    )  # fmt: skip
    for t in range(steps):
        for rank in range(1, world_size):
            differ = _same_updates(straight[0][t].updates, straight[rank][t].updates)
            if differ:
                raise _fail(
                    config,
                    "ranks identical",
                    f"step {t}: rank {rank} decoded other updates than rank 0 for {differ}",
                )
        for rank in range(world_size):
            result = straight[rank][t]
            if not result.finite:
                raise _fail(
                    config, "ranks identical", f"step {t} was skipped on rank {rank} with finite gradients"
                )
            if result.bytes_handed != result.bytes_costed:
                raise _fail(
                    config, "wire cost",
                    f"step {t}, rank {rank}: wire_cost() says {result.bytes_costed} bytes, the collectives got"
                    f" {result.bytes_handed}",
                )  # fmt: skip

    if conservation and kind is not None:
        for name, shape in shapes.items():
            came_in = sum(
                _gradients(shapes, seed, rank, t)[name].reshape(-1) for rank in range(world_size) for t in range(steps)
            ) / world_size  # fmt: skip
            went_out = sum(straight[0][t].updates[name] for t in range(steps))
            held = sum(
                memories[rank][-1].get(kind, {}).get(name, torch.zeros(shape)).reshape(-1)
                for rank in range(world_size)
            ) / world_size  # fmt: skip
            assert isinstance(came_in, Tensor) and isinstance(went_out, Tensor)
            error = (went_out + held - came_in).abs().max().item()
            if error > conservation_rtol * (1.0 + came_in.abs().max().item()):
                raise _fail(
                    config, "conservation",
                    f"{name}: the updates plus the mean {kind!r} memory differ from the mean gradient by up to"
                    f" {error:.3g} (error feedback must hold back exactly what it did not send)",
                )  # fmt: skip

    # 2: the lossless setting.
    if lossless is not None:
        exact, exact_memories, _ = _run(replace(lossless), world_size, shapes, buckets, range(steps), seed)
        lossless_kind = algorithm_for(lossless).residual_kind
        for t in range(steps):
            grads = [_gradients(shapes, seed, rank, t) for rank in range(world_size)]
            for name in shapes:
                mean = torch.stack([g[name].reshape(-1) for g in grads]).mean(0)
                wrong = ~torch.isclose(exact[0][t].updates[name], mean, rtol=1e-5, atol=1e-6)
                if bool(wrong.any()):
                    where = wrong.nonzero().flatten()
                    raise _fail(
                        config, "lossless",
                        f"step {t}: {name}'s update is not the mean of the gradients at {where.numel()} of"
                        f" {mean.numel()} positions (first: {where[:5].tolist()}); at the lossless setting every"
                        " value must be sent in every step",
                    )  # fmt: skip
            # nothing may stay unsent: what the ranks hold back after the step is, on the mean, (numerically) 0
            kept = [exact_memories[rank][t].get(lossless_kind or "", {}) for rank in range(world_size)]
            for name in kept[0]:
                held = torch.stack([by_name[name] for by_name in kept]).mean(0)
                scale = (
                    1e-5 * (1.0 + max(float(g[name].abs().max()) for g in grads)) if name in shapes else 1e-5
                )
                if float(held.abs().max()) > scale:
                    where = (held.abs() > scale).nonzero().flatten()
                    raise _fail(
                        config, "lossless",
                        f"step {t}: the mean {lossless_kind!r} memory of {name} holds back values at"
                        f" {where.numel()} positions (first: {where[:5].tolist()}); at the lossless setting no"
                        " value may stay unsent for a step",
                    )  # fmt: skip

    # 4: resume halfway, from states that went through torch.save / torch.load(weights_only=True).
    rest = range(steps // 2, steps)
    order = [b for b in reversed(buckets)] if reorder_buckets_on_resume else buckets
    resumed, _, _ = _run(config, world_size, shapes, order, rest, seed, saved=saved)
    for i, t in enumerate(rest):
        for rank in range(world_size):
            differ = _same_updates(straight[rank][t].updates, resumed[rank][i].updates)
            if differ:
                raise _fail(
                    config,
                    "resume",
                    f"step {t}, rank {rank}: the resumed run decoded other updates for {differ}",
                )

    # 5: a NaN on one rank: the step is skipped everywhere, the memory intact, the next step fine.
    bad = steps // 2
    poisoned, poisoned_memories, _ = _run(
        config, world_size, shapes, buckets, range(bad + 2), seed, poison=(bad, world_size - 1)
    )
    for rank in range(world_size):
        if poisoned[rank][bad].finite:
            raise _fail(
                config,
                "non-finite step",
                f"rank {rank} did not skip step {bad} (rank {world_size - 1} had a NaN)",
            )
        before, after = poisoned_memories[rank][bad - 1], poisoned_memories[rank][bad]
        changed = [
            f"{k}/{n}" for k, by_name in after.items() for n, t in by_name.items()
            if not torch.equal(t, before.get(k, {}).get(n, torch.zeros_like(t)))
        ]  # fmt: skip
        if changed:
            raise _fail(
                config, "non-finite step", f"rank {rank}: the skipped step changed the memory of {changed}"
            )
        nxt = poisoned[rank][bad + 1]
        if not nxt.finite or not all(bool(u.isfinite().all()) for u in nxt.updates.values()):
            raise _fail(
                config, "non-finite step", f"rank {rank}: the step after the skipped one is not finite"
            )
    for rank in range(1, world_size):
        differ = _same_updates(poisoned[0][bad + 1].updates, poisoned[rank][bad + 1].updates)
        if differ:
            raise _fail(
                config,
                "non-finite step",
                f"after the skipped step rank {rank} decoded other updates for {differ}",
            )

    # 7: every value is sent within a bounded number of steps.
    if liveness_steps is not None:
        _check_liveness(config, world_size, shapes, buckets, seed, liveness_steps)
