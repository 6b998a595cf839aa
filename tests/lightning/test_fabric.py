"""``Fabric(strategy="dgc" | "deft" | "powersgd" | FabricCompressionStrategy(...))``.

The 2-process checks share one launch of ``fabric_script.py`` (about 15 s on 2 cores); the error checks run
in this process with one device, beside the Trainer's, so that both give the same message.
"""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import weakref
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY
from torch import nn

import lightning_dgc
from lightning_dgc import DEFTStrategy, DGCStrategy, FabricCompressionStrategy
from lightning_dgc.algorithms.dgc import DGCConfig
from lightning_dgc.checkpoint.exchange import inline_exchange_state
from tests.lightning.run import ROOT, _environment, run_script
from tests.lightning.test_optimizers import _fit


@pytest.fixture(scope="module")
def fabric_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("fabric") / "run"
    run_script("fabric_script.py", out, timeout=300, launcher="popen")
    return out, [torch.load(f"{out}.rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.slow
def test_density_one_equals_fabric_with_plain_ddp(fabric_run) -> None:
    _, ranks = fabric_run
    run = ranks[0]
    torch.testing.assert_close(run["dgc_density_1"]["params"], run["ddp"]["params"], rtol=1e-5, atol=1e-6)
    assert run["dgc_density_1"]["hook_calls"] > 0 and run["ddp"]["hook_calls"] == 0
    # the take-over: SGD applies neither momentum nor weight decay while the exchange does
    assert run["dgc_density_1"]["group_during"] == (0.0, False, 0.0)
    assert run["ddp"]["group_during"] == (0.9, False, 1e-4)
    # release_optimizers() hands SGD its values and the exchange's momentum back, as DDP's SGD holds them
    assert run["dgc_density_1"]["group_after"] == (0.9, False, 1e-4)
    torch.testing.assert_close(
        run["dgc_density_1"]["momentum_buffer"], run["ddp"]["momentum_buffer"], rtol=1e-5, atol=1e-6
    )


@pytest.mark.slow
def test_accumulation_with_no_backward_sync_exchanges_once_per_step_and_matches_ddp(fabric_run) -> None:
    _, ranks = fabric_run
    run = ranks[0]
    ddp, dgc = run["ddp_accumulate_3"], run["dgc_density_1_accumulate_3"]
    torch.testing.assert_close(dgc["params"], ddp["params"], rtol=1e-5, atol=1e-6)
    assert dgc["hook_calls"] == 4, "one exchange per optimizer step (the model is one bucket)"


@pytest.mark.slow
def test_ranks_are_identical_under_every_algorithm(fabric_run) -> None:
    _, (zero, one) = fabric_run
    for phase in ("dgc", "dgc_resumed", "deft", "powersgd"):
        assert zero[phase]["hook_calls"] > 0, phase  # registered on CPU, through the registry's names too
        assert torch.equal(zero[phase]["params"], one[phase]["params"]), phase
    assert not torch.allclose(zero["dgc"]["params"], zero["ddp"]["params"]), "density 0.05 compresses"


@pytest.mark.slow
def test_save_at_five_and_load_to_ten_equals_a_straight_ten(fabric_run) -> None:
    out, ranks = fabric_run
    for run in ranks:
        assert torch.equal(run["dgc_resumed"]["params"], run["dgc"]["params"])
    ckpt = torch.load(f"{out}.dgc.ckpt", weights_only=True)
    manifest = ckpt[lightning_dgc.front.strategy.CHECKPOINT_KEY]  # rank 0's file names a file per rank, beside it
    assert manifest["format"] == 3 and [f["name"][:10] for f in manifest["files"]] == ["rank-00000", "rank-00001"]
    assert sorted(p.name for p in Path(f"{out}.dgc.ckpt.exchange").iterdir()) == [f["name"] for f in manifest["files"]]
    entry = inline_exchange_state(f"{out}.dgc.ckpt")[lightning_dgc.front.strategy.CHECKPOINT_KEY]
    assert entry["algorithm"] == "dgc" and entry["world_size"] == 2 and len(entry["ranks"]) == 2
    assert entry["ranks"][0]["memory"]["momentum"], "every rank's momentum is in the checkpoint"
    assert not torch.equal(
        next(iter(entry["ranks"][0]["memory"]["velocity"].values())),
        next(iter(entry["ranks"][1]["memory"]["velocity"].values())),
    ), "the ranks' residuals differ: each rank's own is saved"
    group = ckpt["optimizer"]["param_groups"][0]
    assert (group["momentum"], group["weight_decay"]) == (0.9, 1e-4), "the user's values, not the take-over's 0"
    assert "momentum_buffer" in ckpt["optimizer"]["state"][0]


@pytest.mark.slow
def test_a_dgc_checkpoint_resumes_under_plain_ddp_with_its_momentum(fabric_run) -> None:
    """Saved at step 5 at density 1, resumed by Fabric's plain DDP to 10: equals DDP's straight 10."""
    _, ranks = fabric_run
    run = ranks[0]
    torch.testing.assert_close(
        run["ddp_resumed_from_dgc_density_1"]["params"], run["ddp"]["params"], rtol=1e-5, atol=1e-6
    )


def test_every_algorithm_is_in_fabrics_registry() -> None:
    for name in ("dgc", "deft", "powersgd", "dgc_spawn", "deft_spawn", "powersgd_spawn"):
        assert STRATEGY_REGISTRY[name]["strategy"] is FabricCompressionStrategy, name
    assert STRATEGY_REGISTRY["powersgd"]["init_params"]["algorithm"] == "powersgd"


def test_a_wrong_density_gives_the_trainers_error() -> None:
    for density in (0.0, 1.5):
        with pytest.raises(ValueError) as trainer:
            DGCStrategy(density=density)
        with pytest.raises(ValueError) as fabric:
            FabricCompressionStrategy("dgc", {"density": density})
        assert str(fabric.value) == str(trainer.value)
        assert "density" in str(fabric.value)


def test_the_algorithms_settings_are_keyword_arguments_through_both_doors() -> None:
    """``density=0.01`` works as the Trainer's ``DGCStrategy(density=0.01)`` does, through the class Fabric
    registers too; the ``options`` dict and a configuration object still work, and give the same settings."""
    registered = STRATEGY_REGISTRY["deft"]
    deft = registered["strategy"](**registered["init_params"], density=0.01, rotation=False)
    assert deft.config == DEFTStrategy(density=0.01, rotation=False).config
    assert deft.config == FabricCompressionStrategy("deft", {"density": 0.01, "rotation": False}).config
    dgc = FabricCompressionStrategy(density=0.01, momentum=0.9, find_unused_parameters=True)
    assert dgc.config == DGCStrategy(density=0.01, momentum=0.9).config == DGCConfig(density=0.01, momentum=0.9)
    assert dgc._ddp_kwargs == {"gradient_as_bucket_view": True, "find_unused_parameters": True}
    assert FabricCompressionStrategy(DGCConfig(density=0.5), seed=3).config == DGCConfig(density=0.5, seed=3)
    powersgd = lightning_dgc.CompressionStrategy("powersgd", matrix_approximation_rank=2)
    assert powersgd.config == FabricCompressionStrategy("powersgd", matrix_approximation_rank=2).config
    assert powersgd.config.matrix_approximation_rank == 2
    # a setting is checked as the Trainer's strategy checks it
    with pytest.raises(ValueError) as trainer:
        DGCStrategy(density=1.5)
    with pytest.raises(ValueError) as fabric:
        FabricCompressionStrategy(density=1.5)
    assert str(fabric.value) == str(trainer.value)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: FabricCompressionStrategy(densty=0.01), "FabricCompressionStrategy('dgc', density=...)"),
        (lambda: STRATEGY_REGISTRY["dgc"]["strategy"](**STRATEGY_REGISTRY["dgc"]["init_params"], densty=0.01),
         "FabricCompressionStrategy('dgc', density=...)"),
        (lambda: DGCStrategy(densty=0.01), "DGCStrategy(..., density=...)"),
        (lambda: lightning_dgc.CompressionStrategy("dgc", densty=0.01), "CompressionStrategy('dgc', density=...)"),
    ],
    ids=["fabric", "fabric-registered", "trainer-dgc", "trainer"],
)
def test_a_misspelt_setting_names_the_right_one_and_the_form(make, message: str) -> None:
    with pytest.raises(TypeError, match="unknown argument `densty` \\(did you mean `density`\\?\\)") as error:
        make()
    assert "neither a setting of DGCConfig (density, sample_ratio," in str(error.value)
    assert str(error.value).endswith(f"Pass the algorithm's settings as keyword arguments: {message}.")


def test_a_setting_given_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="`density` given both as a keyword argument and in `options`"):
        FabricCompressionStrategy("dgc", {"density": 0.1}, density=0.2)


def test_fabric_trains_with_a_setting_given_as_a_keyword_argument() -> None:
    strategy = FabricCompressionStrategy(density=0.01, min_compress_numel=64)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
    try:
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        optimizer.zero_grad()
        fabric.backward(model(torch.randn(8, 32)).square().mean())
        optimizer.step()
        stats = strategy.compression_stats()
        assert strategy.hook_calls == 1 and stats["density"] == 0.01
        assert 20 < stats["k"] < 30, "1% of the 2048 + 256 weights (0.1%, the default, sends 4)"
    finally:
        lightning_dgc.destroy_process_group()


def _fabric_setup(strategy: FabricCompressionStrategy, optimizer) -> None:  # type: ignore[no-untyped-def]
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
    try:
        fabric.setup(model, optimizer(model.parameters()))
    finally:
        lightning_dgc.destroy_process_group()


@pytest.mark.parametrize(
    ("trainer_strategy", "algorithm", "optimizer"),
    [
        (DGCStrategy, "dgc", lambda p: torch.optim.RMSprop(p, lr=0.1, momentum=0.9)),
        (DGCStrategy, "dgc", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1)),
        (lambda: DGCStrategy(momentum=0.9), DGCConfig(momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
        (lambda: DGCStrategy(momentum=0.9), DGCConfig(momentum=0.9), lambda p: torch.optim.Adam(p, lr=0.1)),
        (lambda: DEFTStrategy(momentum_correction=True), "deft_mc", lambda p: torch.optim.RMSprop(p, momentum=0.5)),
    ],
    ids=["rmsprop-momentum", "sgd-dampening", "momentum-twice", "adam-with-correction", "deft-correction"],
)
def test_a_wrong_optimizer_gives_the_trainers_error(trainer_strategy, algorithm, optimizer) -> None:
    from lightning_dgc.algorithms.deft import DEFTConfig

    with pytest.raises(ValueError) as trainer:
        _fit(trainer_strategy(), optimizer, steps=1)
    lightning_dgc.destroy_process_group()
    config = DEFTConfig(momentum_correction=True) if algorithm == "deft_mc" else algorithm
    with pytest.raises(ValueError) as fabric:
        _fabric_setup(FabricCompressionStrategy(config), optimizer)
    owner, name = type(trainer_strategy()).__name__, "FabricCompressionStrategy"
    algorithm = "deft" if algorithm == "deft_mc" else "dgc"
    # the same message, with the fix spelled for Fabric's strategy, which names the algorithm
    expected = re.sub(rf"{owner}\(momentum=([^)]*)\)", rf"{name}('{algorithm}', momentum=\1)", str(trainer.value))
    assert str(fabric.value) == expected.replace(owner, name)


def test_the_optimizer_needs_the_model_first() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=FabricCompressionStrategy("dgc"))
    fabric.launch()
    model = nn.Linear(4, 4)
    try:
        with pytest.raises(RuntimeError, match="must know the model before its optimizer"):
            fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    finally:
        lightning_dgc.destroy_process_group()


def test_gradients_are_views_into_ddps_bucket_unless_asked_otherwise() -> None:
    """``gradient_as_bucket_view`` defaults to True (one model size less); ``False`` still gives separate grads."""
    for kwargs, storages in (({}, 1), ({"gradient_as_bucket_view": False}, 4)):
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy=FabricCompressionStrategy("dgc", **kwargs))
        fabric.launch()
        model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
        try:
            model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
            for _ in range(2):  # DDP rebuilds its buckets in the second step
                optimizer.zero_grad()
                fabric.backward(model(torch.randn(8, 32)).square().mean())
                optimizer.step()
            assert len({p.grad.untyped_storage().data_ptr() for p in model.parameters()}) == storages, kwargs
        finally:
            lightning_dgc.destroy_process_group()


def _train_and_forget(strategy: FabricCompressionStrategy) -> tuple[weakref.ref, weakref.ref]:
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    model = nn.Linear(32, 4)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for _ in range(2):
        optimizer.zero_grad()
        fabric.backward(model(torch.randn(8, 32)).square().mean())
        optimizer.step()
    assert strategy.hook_calls == 2
    return weakref.ref(strategy.exchange_state), weakref.ref(model.module)


def test_a_finished_loop_frees_its_model_and_exchange_memory() -> None:
    """DDP's reducer holds the hook in C++, out of the garbage collector's sight: the hook must not keep
    the strategy (and with it the model, the optimizer's state and the exchange's memory) alive."""
    try:
        state, module = _train_and_forget(FabricCompressionStrategy("dgc", {"density": 0.5}))
        gc.collect()  # frees the DDP wrapper, whose reducer (C++) held the exchange state
        gc.collect()  # frees the exchange state, now unreachable
        assert state() is None and module() is None, "a second loop in this process would hold both runs"
    finally:
        lightning_dgc.destroy_process_group()


def test_a_hook_of_ones_own_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="`ddp_comm_hook` cannot be combined"):
        FabricCompressionStrategy("dgc", ddp_comm_hook=lambda state, bucket: None)


@pytest.mark.slow
def test_the_readme_loop_trains_and_saves_every_ranks_memory(tmp_path) -> None:
    """``lightning_dgc_recipes/fabric_loop.py``, the README's Fabric loop, run as users run it."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "lightning_dgc_recipes" / "fabric_loop.py")],
        env=_environment(), cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
    losses = [float(line.rsplit(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    assert len(losses) == 4 and losses[-1] < losses[0], proc.stdout
    ckpt = inline_exchange_state(tmp_path / "fabric_dgc.ckpt")
    assert ckpt["epoch"] == 3 and len(ckpt["lightning_dgc"]["ranks"]) == 2
