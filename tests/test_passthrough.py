"""DDP's own step at density 1 (:mod:`lightning_dgc.exchange.passthrough`), on simulated ranks.

Once a step at density 1 sent every rank's residual whole, the ranks' momenta enter the update only through
their mean: the state makes them one, and from then on the hook all-reduces the bucket as DDP's default hook
does, with SGD's weight decay and momentum applied to the average at ``finish_step()``. It must give what the
algorithm's own dense step gives, on every rank alike, and keep the algorithm's guarantees (a step that is not
finite on some rank is skipped on every rank, with the momentum left as it was).
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dgc import algorithms, comm
from lightning_dgc.exchange import hook
from lightning_dgc.exchange.passthrough import enter_passthrough
from lightning_dgc.exchange.state import ExchangeState
from tests.extending.randomk import RandomKConfig
from tests.test_deferred_update import _model  # the same small MLP, its weights drawn from a fixed seed

CASES = [
    ("dgc", {"momentum": 0.9}),
    ("dgc", {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
    ("dgc", {"momentum": 0.0, "weight_decay": 1e-3}),
    ("deft", {"momentum_correction": True, "momentum": 0.9, "nesterov": True}),
]
COMPRESSED_STEPS, STEPS = 3, 8  # compressed steps first (the ranks' momenta and residuals differ), then dense


def _train(name: str, options: dict, passthrough: bool, world: int = 3, nan_at: tuple[int, int] | None = None,
           grad_scale: float = 1.0):  # fmt: skip
    config = algorithms.get(name).config_class(density=0.05, **options)

    def rank_run(collectives: comm.Collectives) -> dict:
        model = _model()
        state = ExchangeState(config, collectives=collectives, finish_writes_grads=True, grad_scale=grad_scale)
        state.register_parameters(model.named_parameters())
        params = list(model.parameters())
        numel = sum(p.numel() for p in params)
        updates, entered, verdicts, bytes_ = [], [], [], []
        for step in range(STEPS):
            if step == COMPRESSED_STEPS:
                state.density = 1.0
            local = torch.randn(numel, generator=torch.Generator().manual_seed(100 * step + collectives.rank))
            local.mul_(grad_scale)
            if nan_at == (step, collectives.rank):
                local[3] = math.nan
            returned = hook.exchange(state, params, local).wait()
            for p, g in zip(params, returned.split([p.numel() for p in params]), strict=True):
                p.grad = g.view_as(p).clone()  # what DDP copies into .grad from the future's value
            verdicts.append(state.finish_step())
            updates.append(torch.cat([p.grad.reshape(-1) for p in params]))
            bytes_.append(state.compression_stats()["bytes_sent"])
            with torch.no_grad():  # an optimizer step, so that weight decay sees moving weights
                for p in params:
                    p.sub_(0.1 * p.grad / grad_scale)
            if passthrough and step >= COMPRESSED_STEPS and not state.passthrough:
                entered.append((step, enter_passthrough(state, collectives)))
        momenta = {n: t.clone() for n, t in state.memory.committed.get("momentum", {}).items()}
        return {"updates": updates, "entered": entered, "verdicts": verdicts, "passthrough": state.passthrough,
                "residual": state.residual_norm(), "momenta": momenta, "bytes": bytes_, "dense": numel * 4}  # fmt: skip

    return comm.simulate(world, rank_run)


@pytest.mark.parametrize(("name", "options"), CASES)
def test_ddps_step_equals_the_algorithms_dense_step_on_every_rank(name: str, options: dict) -> None:
    reference = _train(name, options, passthrough=False)
    ranks = _train(name, options, passthrough=True)
    for rank, (got, want) in enumerate(zip(ranks, reference, strict=True)):
        assert got["entered"] == [(COMPRESSED_STEPS, True)], "entered after the first step at density 1"
        assert got["passthrough"] and got["residual"] == 0.0
        for step, (a, b) in enumerate(zip(got["updates"], want["updates"], strict=True)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"rank {rank}, step {step}")
        assert got["bytes"][-1] == got["dense"], "DDP's bytes: the bucket, all-reduced"
    for got in ranks[1:]:
        for a, b in zip(got["updates"][COMPRESSED_STEPS:], ranks[0]["updates"][COMPRESSED_STEPS:], strict=True):
            assert torch.equal(a, b), "every rank applies the same update"
        assert all(torch.equal(got["momenta"][n], ranks[0]["momenta"][n]) for n in got["momenta"])


def test_the_loss_scale_stays_out_of_the_momentum() -> None:
    options = {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}
    scaled = _train("dgc", options, passthrough=True, grad_scale=1024.0)
    plain = _train("dgc", options, passthrough=True)
    for got, want in zip(scaled, plain, strict=True):
        for a, b in zip(got["updates"], want["updates"], strict=True):
            torch.testing.assert_close(a / 1024.0, b, rtol=1e-5, atol=1e-6)


def test_a_skipped_dense_step_keeps_the_residual_and_passthrough_waits_for_the_next() -> None:
    """A step at density 1 that is not finite on one rank is skipped on every rank: its residuals stay, so no
    rank enters DDP's step after it; every rank enters after the next (finite) one."""
    ranks = _train("dgc", {"momentum": 0.9}, passthrough=True, nan_at=(COMPRESSED_STEPS, 1))
    for got in ranks:
        assert got["verdicts"][COMPRESSED_STEPS] is False
        assert got["entered"] == [(COMPRESSED_STEPS, False), (COMPRESSED_STEPS + 1, True)]


def test_a_non_finite_step_in_ddps_step_is_skipped_on_every_rank_with_the_momentum_kept() -> None:
    at = COMPRESSED_STEPS + 2
    ranks = _train("dgc", {"momentum": 0.9}, passthrough=True, nan_at=(at, 0))
    clean = _train("dgc", {"momentum": 0.9}, passthrough=True)
    for got, want in zip(ranks, clean, strict=True):
        assert got["verdicts"][at] is False and all(got["verdicts"][at + 1 :])
        assert got["passthrough"], "a skipped step does not leave DDP's step"
        # the step after the skipped one moves the momentum from where it was before it
        torch.testing.assert_close(got["updates"][at - 1], want["updates"][at - 1])


def test_only_a_flat_fp32_exchange_of_a_density_algorithm_passes_through() -> None:
    def run(collectives: comm.Collectives) -> list[bool]:
        out = []
        for config, dtype in [
            (algorithms.get("dgc").config_class(density=1.0), torch.float32),
            (algorithms.get("dgc").config_class(density=0.01), torch.float32),  # not dense
            (algorithms.get("dgc").config_class(density=1.0, local_clip_norm=1.0), torch.float32),
            (algorithms.get("dgc").config_class(density=1.0), torch.bfloat16),
            (algorithms.get("powersgd").config_class(), torch.float32),  # no density
            (RandomKConfig(density=1.0), torch.float32),  # an outside algorithm: its dense step is its own
        ]:
            state = ExchangeState(config, collectives=collectives)
            state.register_parameters(_model().to(dtype).named_parameters())
            out.append(enter_passthrough(state, collectives))
        return out

    assert comm.simulate(2, run) == [[True, False, False, False, False, False]] * 2


def test_a_new_density_leaves_ddps_step() -> None:
    def run(collectives: comm.Collectives) -> tuple[bool, bool]:
        state = ExchangeState(algorithms.get("dgc").config_class(density=1.0), collectives=collectives)
        state.register_parameters(_model().named_parameters())
        entered = enter_passthrough(state, collectives)
        state.density = 0.01
        return entered, state.passthrough

    assert comm.simulate(2, run) == [(True, False)] * 2
