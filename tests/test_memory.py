"""Momentum correction, masking, clipping and the residual memory on single tensors."""

from __future__ import annotations

import pickle

import torch

from lightning_dgc.tensor_ops.memory import ResidualMemory
from lightning_dgc.tensor_ops.momentum import clip_by_norm_, momentum_correction
from lightning_dgc.tensor_ops.selection import sampled_topk


def _compensate(
    mem: ResidualMemory, g: torch.Tensor, m: float, nesterov: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """DGC's momentum correction of ``g`` into the scratch buffers of parameter "w"; returns (u', v')."""
    u, v = (mem.buffer(kind, "w", g.numel(), g.device) for kind in ("momentum", "velocity"))
    u_next, v_next = mem.scratch("momentum", "w"), mem.scratch("velocity", "w")
    momentum_correction(g, u, v, m, nesterov, u_next, v_next)
    mem.stage("momentum", "w")
    mem.stage("velocity", "w")
    return u_next, v_next


def _step(mem: ResidualMemory, g: torch.Tensor, m: float, nesterov: bool, k: int, masking: bool = True):
    u_next, v_next = _compensate(mem, g, m, nesterov)
    idx = sampled_topk(v_next, k, 0.01, torch.Generator().manual_seed(0))
    sent = v_next[idx].clone()
    accumulated = v_next.clone()
    v_next[idx] = 0.0  # sent: cleared, as DGC's select does
    if masking:
        u_next[idx] = 0.0
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
        residual = mem.committed["velocity"]["w"]
        rebuilt = residual.clone()
        rebuilt[idx] += sent
        torch.testing.assert_close(rebuilt, accumulated)
        total_sent.index_add_(0, idx, sent)
    # with plain error feedback, everything ever computed is either sent or still in the residual
    torch.testing.assert_close(total_sent + mem.committed["velocity"]["w"], total_grad, rtol=1e-5, atol=1e-4)


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
        velocity, momentum = mem.committed["velocity"]["w"], mem.committed["momentum"]["w"]
        assert torch.all(velocity[idx] == 0)
        assert bool(torch.all(momentum[idx] == 0)) is masking
        rest = torch.ones(100, dtype=torch.bool)
        rest[idx] = False
        torch.testing.assert_close(momentum[rest], grad[rest])


def test_discard_leaves_state_untouched() -> None:
    mem = ResidualMemory()
    _step(mem, torch.randn(100), 0.9, False, 3)
    before = pickle.loads(pickle.dumps(mem.state_dict()))
    _compensate(mem, torch.full((100,), float("inf")), 0.9, False)
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
        assert torch.equal(restored.committed[kind]["w"], mem.committed[kind]["w"])


def test_clip_by_norm() -> None:
    g = torch.tensor([3.0, 4.0])
    clip_by_norm_(g, 1.0)
    torch.testing.assert_close(torch.linalg.vector_norm(g), torch.tensor(1.0), atol=1e-5, rtol=1e-5)
    small = torch.tensor([0.3, 0.4])
    clip_by_norm_(small, 1.0)
    torch.testing.assert_close(small, torch.tensor([0.3, 0.4]))


def test_a_kind_that_is_never_written_is_never_allocated() -> None:
    """Plain error feedback (momentum 0) keeps a velocity only: no momentum buffers (2 model sizes saved)."""
    mem = ResidualMemory()
    v = mem.buffer("velocity", "w", 10, torch.device("cpu"))
    mem.scratch("velocity", "w").copy_(v + 1)
    mem.stage("velocity", "w")
    assert mem.finish_step() and set(mem.committed) == {"velocity"} and set(mem.state_dict()) == {"velocity"}
    assert torch.equal(mem.committed["velocity"]["w"], torch.ones(10))


def test_finish_step_commits_only_finite_steps_and_drops_unused_parameters() -> None:
    mem = ResidualMemory()
    for name in ("used", "unused"):
        mem.buffer("velocity", name, 3, torch.device("cpu"))
        mem.scratch("velocity", name).fill_(1.0)
        mem.stage("velocity", name)
    mem.note_finite(torch.tensor(True))
    assert mem.finish_step(unused=lambda name: name == "unused")
    assert mem.committed["velocity"]["used"].tolist() == [1.0] * 3
    assert mem.committed["velocity"]["unused"].tolist() == [0.0] * 3
    mem.scratch("velocity", "used").fill_(2.0)
    mem.stage("velocity", "used")
    mem.note_finite(torch.tensor(False))
    assert not mem.finish_step()
    assert mem.committed["velocity"]["used"].tolist() == [1.0] * 3
