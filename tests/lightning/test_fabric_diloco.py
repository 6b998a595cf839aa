"""``Fabric(strategy="diloco" | FabricDiLoCoStrategy(...))``: on 2 CPU processes the same loop as under the Trainer
gives the same weights, and a resume mid-round equals the straight run; its errors are the Trainer strategy's."""

from __future__ import annotations

import json
import math
from contextlib import nullcontext

import lightning as L
import pytest
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY
from torch import nn

import lightning_dgc
from lightning_dgc import DiLoCoStrategy, FabricDiLoCoStrategy
from lightning_dgc.local_steps.core import DILOCO_KEY
from tests.lightning.run import params, results, run_script, two_torchrun_agents
from tests.lightning.test_diloco import check_two_nodes_of_two


@pytest.mark.slow
@pytest.mark.parametrize("streaming", [(), ("--fragments", "2", "--overlap-steps", "1")], ids=["plain", "streaming"])
def test_the_same_loop_under_fabric_and_the_trainer_gives_the_same_weights(tmp_path, streaming) -> None:
    trainer, fabric = tmp_path / "trainer", tmp_path / "fabric"
    # plain: outer steps at 4, 8 and 10; streaming: 2 fragments, 6 (merged at 3, 5, 7, 9, then two at the end)
    common = ("--sync-every", "4", "--max-steps", "10", "--samples", "32", *streaming)
    run_script("diloco_script.py", trainer, *common)
    run_script("fabric_diloco_script.py", fabric, *common)
    assert torch.equal(torch.load(f"{fabric}.rank0.init.pt"), torch.load(f"{trainer}.rank0.init.pt"))
    for rank in range(2):
        torch.testing.assert_close(params(fabric, rank), params(trainer, rank), rtol=0, atol=0)
    assert not torch.equal(params(fabric, 0), torch.load(f"{fabric}.rank0.init.pt"))
    assert torch.equal(params(fabric, 0), params(fabric, 1)), "the end of the loop leaves every rank on the same weights"
    for by_fabric, by_trainer in zip(results(fabric), results(trainer), strict=True):
        assert by_fabric["wrapped"] == "Sequential", "no DDP wrapper"
        assert by_fabric["outer_steps"] == by_trainer["outer_steps"] == (6 if streaming else 3)
        assert by_fabric["stats"]["link_bytes_per_step"] == by_trainer["stats"]["link_bytes_per_step"] > 0


@pytest.mark.slow
def test_a_fabric_resume_mid_round_equals_the_straight_run(tmp_path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    dgc = ("--algorithm", "dgc", "--options", json.dumps({"density": 0.2, "min_compress_numel": 16}))
    common = ("--sync-every", "4", "--samples", "16", "--max-steps", "12", *dgc)
    run_script("fabric_diloco_script.py", straight, *common, "--save-at", "6")
    ckpt = torch.load(f"{straight}.ckpt", weights_only=True)
    entry = ckpt[DILOCO_KEY]
    assert entry["outer"]["inner_steps"] == 2 and entry["world_size"] == 2 and ckpt["step"] == 6  # mid-round
    # the model's (fp32) state is the global weights, held once: the resume below reads them back from it
    assert entry["outer"]["global"] == {} and set(ckpt["model"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    run_script("fabric_diloco_script.py", resumed, *common, "--resume", f"{straight}.ckpt")
    for rank in range(2):
        torch.testing.assert_close(params(resumed, rank), params(straight, rank), rtol=0, atol=0)
    assert results(resumed)[0]["stats"]["algorithm"] == "dgc"


@pytest.mark.slow
def test_two_torchrun_agents_under_fabric_run_ddp_inside_the_node_and_diloco_across(tmp_path) -> None:
    """The Trainer's two-node test under Fabric: ``hierarchical="auto"``, two torchrun agents of two processes; all
    4 ranks end on the hand-written DiLoCo of 2 workers whose gradient is their node's mean."""
    out = tmp_path / "h"
    two_torchrun_agents("fabric_diloco_script.py", ["--out", str(out), "--devices", "2", "--num-nodes", "2",
                                                    "--sync-every", "4", "--max-steps", "10", "--samples", "64"],
                        tmp_path)  # fmt: skip
    check_two_nodes_of_two(out, "wrapped")


def test_diloco_is_in_fabrics_registry() -> None:
    assert STRATEGY_REGISTRY["diloco"]["strategy"] is FabricDiLoCoStrategy


@pytest.mark.parametrize(
    "kwargs",
    [
        {"sync_every": 0},
        {"outer_lr": math.nan},
        {"outer_momentum": math.inf},
        {"algorithm": "nope"},
        {"density": 0.1},
        {"algorithm": "dgc", "static_graph": True},
        {"algorithm": "dgc", "densty": 0.1},
        {"max_consecutive_skips": -1},
    ],
)
def test_bad_arguments_give_the_trainers_error(kwargs) -> None:
    with pytest.raises((ValueError, TypeError)) as trainer:
        DiLoCoStrategy(**kwargs)
    with pytest.raises(trainer.type) as fabric:
        FabricDiLoCoStrategy(**kwargs)
    expected = str(trainer.value).replace("DiLoCoStrategy", "FabricDiLoCoStrategy")
    assert str(fabric.value) == expected


def test_the_registered_name_takes_the_same_arguments() -> None:
    with pytest.raises(ValueError, match="sync_every` must be >= 1"):
        L.Fabric(accelerator="cpu", devices=1, strategy=FabricDiLoCoStrategy(sync_every=0))
    registered = STRATEGY_REGISTRY["diloco"]
    strategy = registered["strategy"](**registered["init_params"], sync_every=3, algorithm="dgc", density=0.01)
    assert strategy.settings.sync_every == 3 and strategy._config.density == 0.01


def test_one_rank_counts_the_wrapped_optimizers_steps_and_finish_ends_the_round() -> None:
    strategy = FabricDiLoCoStrategy(sync_every=2)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    try:
        model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        assert fabric.strategy._backward_sync_control.no_backward_sync(model, True).__class__ is nullcontext
        for _ in range(5):
            optimizer.zero_grad()
            fabric.backward(model(torch.randn(8, 4)).square().mean())
            optimizer.step()
        assert (strategy.outer.outer_steps, strategy.outer.inner_steps) == (2, 1)
        stats = strategy.compression_stats()
        assert stats["bytes_sent"] == 0 and stats["outer_bytes_sent"] == stats["dense_bytes"] == 4 * 10
        strategy.finish()
        assert (strategy.outer.outer_steps, strategy.outer.inner_steps) == (3, 0)
        strategy.finish()  # nothing left to end
        assert strategy.outer.outer_steps == 3
        for g, p in zip(strategy.outer.global_params, net.parameters(), strict=True):
            assert torch.equal(g, p.detach())
    finally:
        lightning_dgc.destroy_process_group()


def test_the_optimizer_needs_the_model_first_and_one_model_only() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=FabricDiLoCoStrategy(sync_every=2))
    fabric.launch()
    net = nn.Linear(4, 4)
    try:
        with pytest.raises(RuntimeError, match="must know the model before its optimizer"):
            fabric.setup_optimizers(torch.optim.SGD(net.parameters(), lr=0.1))
        with pytest.raises(RuntimeError, match="before `fabric.setup\\(model, ...\\)` has set up the model"):
            fabric.strategy.outer  # noqa: B018
        fabric.setup(net)
        with pytest.raises(ValueError, match="one model"):
            fabric.setup(nn.Linear(4, 4))
    finally:
        lightning_dgc.destroy_process_group()
