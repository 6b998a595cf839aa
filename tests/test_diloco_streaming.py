"""Streaming DiLoCo (:mod:`lightning_dgc.local_steps.rounds`, ``OuterStep`` with ``fragments`` / ``overlap_steps``) on simulated
ranks: the fragments and their staggered rounds, the math against a hand-written reference with and without an
overlap, the last outer step of ``fit``, the bytes, an exact resume with an exchange in flight, bad settings."""

from __future__ import annotations

import io

import pytest
import torch

from lightning_dgc import comm
from lightning_dgc.algorithms.dgc import DGCConfig
from lightning_dgc.local_steps.outer import OuterSettings, OuterStep
from lightning_dgc.local_steps.rounds import first_round, split_fragments
from tests.test_diloco_outer import _drift, _flat, _model

LR, MU = 0.7, 0.9


def test_fragments_are_balanced_by_size_and_keep_model_order() -> None:
    assert split_fragments([100, 10, 50, 40, 5], 2) == [[0, 4], [1, 2, 3]]
    assert split_fragments([3, 3, 3], 3) == [[0], [1], [2]]
    assert split_fragments([7], 1) == [[0]]
    with pytest.raises(ValueError, match="pass fragments <= 3"):
        split_fragments([1, 2, 3], 4)
    # the rounds end at evenly spread steps, the last fragment's at sync_every as in plain DiLoCo
    assert [first_round(f, 4, 8) for f in range(4)] == [2, 4, 6, 8]
    assert [first_round(f, 3, 10) for f in range(3)] == [3, 6, 10]


def _streamed(settings: OuterSettings, steps: int, world: int = 2, config=None, finish: bool = False):
    def rank_fn(collectives):
        model = _model()
        outer = OuterStep(settings, config, model.named_parameters(), collectives=collectives)
        sent = []
        for r in range(steps):
            _drift(model, collectives.rank, r)
            outer.after_optimizer_step()
            sent.append(outer.compression_stats()["bytes_sent"])
        last = outer.step() if finish else None
        return model, outer, sent, last

    return comm.simulate(world, rank_fn)


def _reference(steps: int, sync_every: int, fragments: int, overlap: int, mixing: float, world: int = 2):
    """Streaming DiLoCo by hand: per fragment a staggered round, the mean pseudo-gradient of its tensors, torch's
    Nesterov SGD on them, and local := global (after ``overlap`` more steps: mixed with the local weights)."""
    models = [_model() for _ in range(world)]
    glob = [p.detach().clone() for p in _model().parameters()]
    buffers: list[torch.Tensor | None] = [None] * len(glob)
    members = split_fragments([g.numel() for g in glob], fragments)
    until = [first_round(f, fragments, sync_every) for f in range(fragments)]
    pending: list[tuple[int, list[int]]] = []
    for r in range(steps):
        for rank, model in enumerate(models):
            _drift(model, rank, r)
        step = r + 1
        for at, tensors in [p for p in pending if p[0] == step]:
            pending.remove((at, tensors))
            with torch.no_grad():
                for model in models:
                    params = list(model.parameters())
                    for i in tensors:
                        params[i].copy_(mixing * params[i] + (1 - mixing) * glob[i])
        for f in range(fragments):
            until[f] -= 1
            if until[f]:
                continue
            until[f] = sync_every
            with torch.no_grad():
                for i in members[f]:
                    delta = sum(glob[i] - list(m.parameters())[i] for m in models) / world
                    buffers[i] = delta.clone() if buffers[i] is None else MU * buffers[i] + delta
                    glob[i] -= LR * (delta + MU * buffers[i])
                    if not overlap:
                        for model in models:
                            list(model.parameters())[i].copy_(glob[i])
            if overlap:
                pending.append((step + overlap, members[f]))
    return models, glob


@pytest.mark.parametrize(
    ("fragments", "overlap"), [(2, 0), (2, 2), (4, 3)], ids=["replace", "overlap", "several_in_flight"]
)
def test_streamed_rounds_equal_a_hand_written_streaming_diloco(fragments, overlap) -> None:
    settings = OuterSettings(sync_every=4, fragments=fragments, overlap_steps=overlap, mixing=0.5)
    out = _streamed(settings, steps=11)
    models, _ = _reference(11, 4, fragments, overlap, 0.5)
    # fragment f first sends after first_round(f) steps, then every 4; each exchange counted on the step that merges it
    sends = sorted(s for f in range(fragments) for s in range(first_round(f, fragments, 4), 12, 4))
    for rank, (model, outer, sent, _) in enumerate(out):
        torch.testing.assert_close(_flat(model), _flat(models[rank]), rtol=1e-5, atol=1e-6)
        merged = [i + 1 for i, b in enumerate(sent) if b]
        assert merged == [s + overlap for s in sends if s + overlap <= 11], merged
        assert outer.outer_steps == len(merged)


@pytest.mark.parametrize("steps", [7, 10], ids=["merged_at_the_last_step", "sent_at_the_last_step"])
def test_the_last_outer_step_merges_what_is_in_flight_and_leaves_every_rank_on_the_global_weights(steps) -> None:
    """Fragment 0 sends at 6 and 10 (merged a step later): at 7 its merge has mixed the local weights, at 10 its
    exchange is still in flight when ``fit`` ends; either way every rank ends on the global weights."""
    settings = OuterSettings(sync_every=4, fragments=2, overlap_steps=1)
    out = _streamed(settings, steps=steps, finish=True)
    (m0, o0, _, last), (m1, _, _, _) = out
    assert last is True and torch.equal(_flat(m0), _flat(m1))
    assert torch.equal(torch.cat([g.reshape(-1) for g in o0.global_params]), _flat(m0))
    assert not o0.in_flight and o0.step() is None, "a second call has nothing left to do"


def test_a_streamed_round_sends_the_model_once_in_smaller_messages() -> None:
    plain = _streamed(OuterSettings(sync_every=4), steps=8)[0][1]
    streamed = _streamed(OuterSettings(sync_every=4, fragments=2), steps=8)
    outer, sent = streamed[0][1], streamed[0][2]
    assert outer.link_bytes_total == pytest.approx(plain.link_bytes_total)  # the same bytes over whole rounds
    assert 0 < max(sent) < outer.dense_bytes and sum(sent) == 2 * outer.dense_bytes


@pytest.mark.parametrize("config", [None, DGCConfig(density=0.1, min_compress_numel=16)], ids=["dense", "dgc"])
def test_a_resume_with_an_exchange_in_flight_equals_the_straight_run(config) -> None:
    """Saved after step 5: fragment 1's exchange (sent at 4, merged at 6) is in flight; the resumed run merges it
    at 6 and ends as the run that never stopped."""
    settings = OuterSettings(sync_every=4, fragments=2, overlap_steps=2)
    straight = _streamed(settings, steps=10, config=config)

    def rank_fn(collectives):
        model = _model()
        outer = OuterStep(settings, config, model.named_parameters(), collectives=collectives)
        for r in range(5):
            _drift(model, collectives.rank, r)
            outer.after_optimizer_step()
        assert outer.in_flight
        outer.settle()
        buffer = io.BytesIO()
        torch.save(outer.state_dict(), buffer)
        buffer.seek(0)
        local = [p.detach().clone() for p in model.parameters()]
        memory = outer.exchange_state.state_dict() if outer.exchange_state is not None else None
        fresh_model = _model()
        fresh = OuterStep(settings, config, fresh_model.named_parameters(), collectives=collectives)
        fresh.load_state_dict(torch.load(buffer, weights_only=True))
        with torch.no_grad():
            for p, saved in zip(fresh_model.parameters(), local, strict=True):
                p.copy_(saved)
        if memory is not None:
            fresh.exchange_state.restore_rank_state(memory, torch.device("cpu"))
        for r in range(5, 10):
            _drift(fresh_model, collectives.rank, r)
            fresh.after_optimizer_step()
        return fresh_model

    resumed = comm.simulate(2, rank_fn)
    for rank in range(2):
        assert torch.equal(_flat(resumed[rank]), _flat(straight[rank][0])), rank


def test_a_checkpoint_of_other_fragments_is_refused_with_the_fix() -> None:
    (_, outer, _, _), _ = _streamed(OuterSettings(sync_every=4, fragments=2), steps=3)
    fresh = OuterStep(OuterSettings(sync_every=4), None, _model().named_parameters())
    with pytest.raises(ValueError, match="resume with the same fragments"):
        fresh.load_state_dict(outer.state_dict())


def test_more_fragments_than_trained_tensors_is_refused_at_set_up() -> None:
    with pytest.raises(ValueError, match="pass fragments <= 4"):
        OuterStep(OuterSettings(sync_every=8, fragments=5), None, _model().named_parameters())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sync_every": 4, "fragments": 0}, "fragments` must be between 1 and sync_every=4"),
        ({"sync_every": 4, "fragments": 5}, "fragments` must be between 1 and sync_every=4"),
        ({"sync_every": 4, "fragments": 2.0}, "fragments` must be an integer"),
        ({"sync_every": 4, "overlap_steps": 4}, "overlap_steps` must be >= 0 and below sync_every=4"),
        ({"sync_every": 4, "overlap_steps": -1}, "overlap_steps"),
        ({"sync_every": 4, "mixing": 1.0}, r"mixing` must be a finite number in \[0, 1\)"),
        ({"sync_every": 4, "mixing": float("nan")}, "mixing"),
    ],
)
def test_bad_streaming_settings_are_refused_with_the_fix(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        OuterSettings(**kwargs)


def test_hierarchical_streaming_ends_every_rank_of_a_node_as_the_flat_run() -> None:
    """2 nodes x 2 ranks (the ranks of a node hold the same local weights): each fragment's exchange, in flight
    for a step, ends on all 4 ranks as in a flat run of one rank per node."""
    settings = OuterSettings(sync_every=4, fragments=2, overlap_steps=1)
    flat = _streamed(settings, steps=9)

    def rank_fn(topology):
        model = _model()
        outer = OuterStep(settings, None, model.named_parameters(), collectives=topology.across, node=topology.node)
        for r in range(9):
            _drift(model, topology.node_rank, r)
            outer.after_optimizer_step()
        return model

    out = comm.simulate_nodes(2, 2, rank_fn)
    for rank, model in enumerate(out):
        assert torch.equal(_flat(model), _flat(flat[rank // 2][0])), rank
