"""Momentum correction, masking, clipping and the residual memory on single tensors."""

from __future__ import annotations

import pickle

import torch

from lightning_dgc.compression import sampled_topk
from lightning_dgc.memory import ResidualMemory, clip_by_norm_, momentum_correction


def _step(mem: ResidualMemory, g: torch.Tensor, m: float, nesterov: bool, k: int, masking: bool = True):
    buf = mem.get("w", g.numel(), g.device)
    momentum_correction(g, buf.momentum, buf.velocity, m, nesterov, buf.momentum_next, buf.velocity_next)
    idx = sampled_topk(buf.velocity_next, k, 0.01, torch.Generator().manual_seed(0))
    sent = buf.velocity_next[idx].clone()
    accumulated = buf.velocity_next.clone()
    mem.stage("w", idx, masking)
    mem.commit()
    return idx, sent, accumulated


def test_nothing_is_lost_sent_plus_residual_equals_accumulated() -> None:
    mem = ResidualMemory()
    g = torch.Generator().manual_seed(0)
    total_grad = torch.zeros(10_000)
    total_sent = torch.zeros(10_000)
    for _ in range(20):
        grad = torch.randn(10_000, generator=g)
        total_grad += grad
        idx, sent, accumulated = _step(mem, grad, 0.0, False, 10)
        residual = mem.buffers["w"].velocity
        rebuilt = residual.clone()
        rebuilt[idx] += sent
        torch.testing.assert_close(rebuilt, accumulated)
        total_sent.index_add_(0, idx, sent)
    # with plain error feedback, everything ever computed is either sent or still in the residual
    torch.testing.assert_close(total_sent + mem.buffers["w"].velocity, total_grad, rtol=1e-5, atol=1e-4)


def test_momentum_correction_formulas() -> None:
    u, v = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0])
    g = torch.tensor([0.1, 0.2])
    uo, vo = torch.empty(2), torch.empty(2)
    momentum_correction(g, u, v, 0.9, False, uo, vo)
    torch.testing.assert_close(uo, 0.9 * u + g)
    torch.testing.assert_close(vo, v + 0.9 * u + g)
    momentum_correction(g, u, v, 0.9, True, uo, vo)  # Nesterov: u' = m(u + g), v' = v + u' + g
    torch.testing.assert_close(uo, 0.9 * (u + g))
    torch.testing.assert_close(vo, v + 0.9 * (u + g) + g)
    momentum_correction(g, u, v, 0.0, False, uo, vo)  # plain error feedback
    torch.testing.assert_close(vo, v + g)
    assert torch.equal(u, torch.tensor([1.0, 2.0])) and torch.equal(v, torch.tensor([0.5, -1.0]))


def test_momentum_factor_masking_clears_sent_coordinates_only_when_on() -> None:
    for masking in (True, False):
        mem = ResidualMemory()
        grad = torch.arange(1.0, 101.0)
        idx, _, _ = _step(mem, grad, 0.9, False, 5, masking)
        buf = mem.buffers["w"]
        assert torch.all(buf.velocity[idx] == 0)
        assert bool(torch.all(buf.momentum[idx] == 0)) is masking
        rest = torch.ones(100, dtype=torch.bool)
        rest[idx] = False
        torch.testing.assert_close(buf.momentum[rest], grad[rest])


def test_discard_leaves_state_untouched() -> None:
    mem = ResidualMemory()
    _step(mem, torch.randn(100), 0.9, False, 3)
    before = pickle.loads(pickle.dumps(mem.state_dict()))
    buf = mem.get("w", 100, torch.device("cpu"))
    momentum_correction(torch.full((100,), float("inf")), buf.momentum, buf.velocity, 0.9, False,
                        buf.momentum_next, buf.velocity_next)  # fmt: skip
    mem.stage("w", torch.tensor([0]), True)
    mem.discard()
    after = mem.state_dict()
    for kind in ("momentum", "velocity"):
        assert torch.equal(before[kind]["w"], after[kind]["w"])


def test_state_dict_round_trip_weights_only(tmp_path) -> None:
    mem = ResidualMemory()
    _step(mem, torch.randn(100), 0.9, True, 3)
    path = tmp_path / "mem.pt"
    torch.save(mem.state_dict(), path)
    restored = ResidualMemory()
    restored.load_state_dict(torch.load(path, weights_only=True))
    for kind in ("momentum", "velocity"):
        assert torch.equal(getattr(restored.buffers["w"], kind), getattr(mem.buffers["w"], kind))


def test_clip_by_norm() -> None:
    g = torch.tensor([3.0, 4.0])
    clip_by_norm_(g, 1.0)
    torch.testing.assert_close(torch.linalg.vector_norm(g), torch.tensor(1.0), atol=1e-5, rtol=1e-5)
    small = torch.tensor([0.3, 0.4])
    clip_by_norm_(small, 1.0)
    torch.testing.assert_close(small, torch.tensor([0.3, 0.4]))
