"""``DiLoCoStrategy`` with a real ``Trainer`` on 2 CPU processes: against a hand-written DiLoCo, through compressed
outer exchanges, resumed mid-round; and its errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_dgc import DiLoCoStrategy
from tests.lightning.diloco_script import BATCH, INNER_LR, INNER_MOMENTUM, dataset, model
from tests.lightning.run import params, results, run_script, two_torchrun_agents

pytestmark = pytest.mark.slow

DGC_FULL = ("--algorithm", "dgc", "--options", json.dumps({"density": 1.0, "min_compress_numel": 16, "selection": "exact"}))


def _reference(
    init: torch.Tensor, steps: int, sync_every: int, samples: int, world: int = 2, momenta: list | None = None,
    per_node: int = 1,
) -> torch.Tensor:  # fmt: skip
    """DiLoCo by hand: each rank's shard (DistributedSampler, no shuffle), its own SGD with momentum kept across
    rounds, the mean pseudo-gradient, Nesterov SGD(lr=0.7, momentum=0.9) on the global weights, a last outer step
    at the end of a shorter round. ``per_node`` > 1: ``world`` nodes of ``per_node`` ranks, each node one DiLoCo
    worker whose gradient is the mean of its ranks' (DDP inside the node)."""
    x, y = dataset(samples).tensors
    ranks = world * per_node
    nets = [model() for _ in range(world)]
    glob = [p.detach().clone() for p in model().parameters()]
    torch.nn.utils.vector_to_parameters(init.clone(), glob)  # (it makes the tensors views of the vector given)
    for net in nets:
        torch.nn.utils.vector_to_parameters(init.clone(), net.parameters())
    inner = [torch.optim.SGD(net.parameters(), lr=INNER_LR, momentum=INNER_MOMENTUM) for net in nets]
    outer = torch.optim.SGD(glob, lr=0.7, momentum=0.9, nesterov=True)
    for opt, net in zip(inner, nets, strict=True) if momenta else ():  # the inner momentum a checkpoint brought
        for p, buffer in zip(net.parameters(), momenta, strict=True):
            opt.state[p]["momentum_buffer"] = buffer.clone()
    per_rank = samples // ranks
    batches = per_rank // BATCH

    def outer_step() -> None:
        for g, *ps in zip(glob, *(net.parameters() for net in nets), strict=True):
            g.grad = sum(g.detach() - p.detach() for p in ps) / world
        outer.step()
        for net in nets:
            torch.nn.utils.vector_to_parameters(torch.cat([g.detach().reshape(-1) for g in glob]), net.parameters())
            # (torch.cat makes a new vector for every net)

    for step in range(steps):
        b = step % batches
        for n, (net, opt) in enumerate(zip(nets, inner, strict=True)):
            opt.zero_grad()
            for r in range(n * per_node, (n + 1) * per_node):
                idx = [r + ranks * (b * BATCH + j) for j in range(BATCH)]
                (nn.functional.mse_loss(net(x[idx]), y[idx]) / per_node).backward()
            opt.step()
        if (step + 1) % sync_every == 0 or step + 1 == steps:
            outer_step()
    return torch.cat([p.detach().reshape(-1) for p in nets[0].parameters()])


def test_dense_equals_a_hand_written_diloco_and_dgc_at_density_one_equals_dense(tmp_path) -> None:
    dense, dgc = tmp_path / "dense", tmp_path / "dgc"
    run_script("diloco_script.py", dense, "--sync-every", "4", "--max-steps", "10", "--samples", "32")
    init = torch.load(f"{dense}.rank0.init.pt", weights_only=True)
    expected = _reference(init, steps=10, sync_every=4, samples=32)
    assert not torch.allclose(expected, init)
    for summary in results(dense):  # outer steps at 4 and 8, and at the end of fit (10)
        assert summary["outer_steps"] == 3 and summary["ddp_wrapped"] == "Module"
        stats = summary["stats"]
        assert stats["algorithm"] == "dense" and stats["bytes_sent"] == stats["dense_bytes"] == 4 * init.numel()
        assert stats["link_bytes_per_step"] == pytest.approx(3 * stats["link_bytes"] / 10)
    assert torch.equal(params(dense, 0), params(dense, 1))
    torch.testing.assert_close(params(dense, 0), expected, rtol=1e-5, atol=1e-6)

    run_script("diloco_script.py", dgc, "--sync-every", "4", "--max-steps", "10", "--samples", "32", *DGC_FULL)
    assert results(dgc)[0]["stats"]["algorithm"] == "dgc"
    assert torch.equal(params(dgc, 0), params(dgc, 1))
    torch.testing.assert_close(params(dgc, 0), params(dense, 0), rtol=1e-5, atol=1e-6)


def test_two_torchrun_agents_of_two_processes_run_ddp_inside_the_node_and_diloco_across(tmp_path) -> None:
    """Two nodes of two devices, one ``torchrun`` agent per node: ``hierarchical="auto"`` wraps the model in DDP over
    the node's ranks and runs DiLoCo across the nodes; all 4 ranks end on a hand-written DiLoCo of 2 workers whose
    gradient is the mean of their node's two ranks', and only the first rank of a node sends across."""
    out = tmp_path / "h"
    two_torchrun_agents("diloco_script.py", ["--out", str(out), "--devices", "2", "--num-nodes", "2", "--sync-every",
                                             "4", "--max-steps", "10", "--samples", "64"], tmp_path)  # fmt: skip
    check_two_nodes_of_two(out, "ddp_wrapped")


def check_two_nodes_of_two(out: Path, wrapped: str) -> None:
    """A run of 10 steps, ``sync_every=4``, 64 samples on two nodes of two ranks ended as the hand-written DiLoCo of 2
    workers whose gradient is their node's mean; the model was wrapped in DDP (the summary's ``wrapped`` entry)
    and only the first rank of a node sent across."""
    init = torch.load(f"{out}.rank0.init.pt", weights_only=True)
    expected = _reference(init, steps=10, sync_every=4, samples=64, world=2, per_node=2)
    for rank in range(4):
        torch.testing.assert_close(params(out, rank), expected, rtol=1e-5, atol=1e-6)
        assert torch.equal(params(out, rank), params(out, 0))
    summaries = results(out, world_size=4)
    assert [s[wrapped] for s in summaries] == ["DistributedDataParallel"] * 4
    assert [s["leader"] for s in summaries] == [True, False, True, False]
    assert [s["outer_steps"] for s in summaries] == [3] * 4
    assert [s["stats"]["outer_bytes_sent"] > 0 for s in summaries] == [True, False, True, False]


@pytest.mark.parametrize(
    "options",
    [
        ("dgc", {"density": 0.1, "min_compress_numel": 16}),
        ("powersgd", {"matrix_approximation_rank": 1, "start_iter": 2, "min_compression_rate": 1.0}),
    ],
)
def test_ranks_are_identical_after_fit_under_a_compressed_outer_exchange(tmp_path, options) -> None:
    algorithm, settings = options
    out = tmp_path / algorithm
    run_script("diloco_script.py", out, "--sync-every", "2", "--max-steps", "7", "--algorithm", algorithm,
               "--options", json.dumps(settings), *(("--offload",) if algorithm == "dgc" else ()))  # fmt: skip
    assert torch.equal(params(out, 0), params(out, 1))
    stats = results(out)[0]["stats"]
    assert stats["algorithm"] == algorithm and results(out)[0]["outer_steps"] == 4
    assert 0 < stats["bytes_sent"] < stats["dense_bytes"]


def test_a_resume_mid_round_equals_the_straight_run(tmp_path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    dgc = ("--algorithm", "dgc", "--options", json.dumps({"density": 0.2, "min_compress_numel": 16}))
    common = ("--sync-every", "4", "--samples", "16", *dgc)  # one step per epoch: a resume sees the same batches
    run_script("diloco_script.py", straight, *common, "--max-steps", "12", "--ckpt-every", "6")
    ckpt = f"{straight}.ckpts/epoch=5-step=6.ckpt"
    saved = torch.load(ckpt, weights_only=True)["lightning_dgc_diloco"]
    assert saved["outer"]["inner_steps"] == 2 and saved["world_size"] == 2  # mid-round
    run_script("diloco_script.py", resumed, *common, "--max-steps", "12", "--resume", ckpt)
    for rank in range(2):
        torch.testing.assert_close(params(resumed, rank), params(straight, rank), rtol=0, atol=0)


def test_streaming_a_resume_with_an_exchange_in_flight_equals_the_straight_run_and_fit_ends_on_identical_ranks(
    tmp_path,
) -> None:
    """Two fragments with one step of overlap: the checkpoint at step 6 holds fragment 0's exchange (sent at 6,
    merged at 7) in flight; the resumed run ends as the straight one, and both end with every rank on the same
    weights."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ("--sync-every", "4", "--samples", "16", "--fragments", "2", "--overlap-steps", "1")
    run_script("diloco_script.py", straight, *common, "--max-steps", "11", "--ckpt-every", "6")
    ckpt = f"{straight}.ckpts/epoch=5-step=6.ckpt"
    saved = torch.load(ckpt, weights_only=True)["lightning_dgc_diloco"]["outer"]
    assert [flight["merge_in"] for flight in saved["in_flight"]] == [1] and saved["until_send"] == [4, 2]
    run_script("diloco_script.py", resumed, *common, "--max-steps", "11", "--resume", ckpt)
    for rank in range(2):
        torch.testing.assert_close(params(resumed, rank), params(straight, rank), rtol=0, atol=0)
    assert torch.equal(params(straight, 0), params(straight, 1))
    assert all(summary["stats"]["fragments"] == 2 for summary in results(straight))


def test_a_plain_ddp_checkpoint_starts_a_round_from_its_weights(tmp_path) -> None:
    ddp, diloco = tmp_path / "ddp", tmp_path / "diloco"
    common = ("--sync-every", "2", "--samples", "16")
    run_script("diloco_script.py", ddp, *common, "--ddp", "--max-steps", "4", "--ckpt-every", "4")
    ckpt = f"{ddp}.ckpts/epoch=3-step=4.ckpt"
    saved = torch.load(ckpt, weights_only=True)
    assert "lightning_dgc_diloco" not in saved
    run_script("diloco_script.py", diloco, *common, "--max-steps", "7", "--resume", ckpt)
    init = torch.cat([t.reshape(-1) for t in saved["state_dict"].values()])
    momenta = [s["momentum_buffer"] for _, s in sorted(saved["optimizer_states"][0]["state"].items())]
    expected = _reference(init, steps=3, sync_every=2, samples=16, momenta=momenta)  # outer steps at 6 and 7
    assert all(summary["outer_steps"] == 2 for summary in results(diloco))
    assert torch.equal(params(diloco, 0), params(diloco, 1))
    torch.testing.assert_close(params(diloco, 0), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"sync_every": 0}, ValueError, "sync_every` must be >= 1"),
        ({"outer_lr": math.nan}, ValueError, "outer_lr` must be a finite number"),
        ({"outer_momentum": math.inf}, ValueError, "outer_momentum"),
        ({"algorithm": "nope"}, ValueError, "algorithm='dense'"),
        ({"density": 0.1}, TypeError, "no setting of algorithm='dense'"),
        ({"algorithm": "dgc", "static_graph": True}, TypeError, "does not wrap the model"),
        ({"hierarchical": "yes"}, ValueError, "hierarchical must be 'auto', True or False"),
        ({"algorithm": "dgc", "densty": 0.1}, TypeError, "did you mean `density`"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        DiLoCoStrategy(**kwargs)


def test_manual_optimization_is_refused(tmp_path) -> None:
    proc = run_script("diloco_script.py", tmp_path / "bad", "--devices", "1", "--manual", check=False)
    assert proc.returncode != 0 and "counts the optimizer steps Lightning takes" in proc.stderr
