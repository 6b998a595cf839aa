"""Every strategy pickles (the sharded ones too), as Lightning's spawn launcher needs (it pickles the Trainer, with its strategy, into each
process it starts), ``Trainer(strategy="dgc_spawn")`` fits with 2 CPU processes, and so does DiLoCo with forked ones.

The fits run ``spawn_script.py`` as a subprocess of the test, which Lightning's launcher starts the ranks from (under
pytest, its launchers would start them from pytest's own command line). They carry over Lightning's tests of a
``"ddp_spawn"`` fit: ``test_ddp_cpu``, ``test_memory_sharing_disabled``, ``test_fit_twice_raises``,
``test_ddp_spawn_add_get_queue`` and the restored global state of ``test_multiprocessing_launcher_restore_globals``.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch

import lightning_dgc
from lightning_dgc import PowerSGDConfig
from lightning_dgc.front.hsdp import HSDPCompressionStrategy
from lightning_dgc.front.hsdp_fabric import FabricHSDPCompressionStrategy
from tests.lightning.run import params, results, run_script
from tests.lightning.spawn_script import SEED

#: One strategy of each class, with settings off their defaults, so that a copy that lost one shows.
STRATEGIES: dict[str, Callable[[], Any]] = {
    "DGCStrategy": lambda: lightning_dgc.DGCStrategy(density=0.01, momentum=0.9, start_method="spawn"),
    "DEFTStrategy": lambda: lightning_dgc.DEFTStrategy(density=0.02, momentum_correction=True),
    "CompressionStrategy": lambda: lightning_dgc.CompressionStrategy(
        PowerSGDConfig(matrix_approximation_rank=2), find_unused_parameters=True
    ),
    "DiLoCoStrategy": lambda: lightning_dgc.DiLoCoStrategy(sync_every=3, algorithm="dgc", density=0.01),
    "FabricCompressionStrategy": lambda: lightning_dgc.FabricCompressionStrategy("deft", density=0.02),
    "FabricDiLoCoStrategy": lambda: lightning_dgc.FabricDiLoCoStrategy(sync_every=3, outer_lr=0.5),
    "HSDPCompressionStrategy": lambda: HSDPCompressionStrategy("powersgd", matrix_approximation_rank=2),
    "FabricHSDPCompressionStrategy": lambda: FabricHSDPCompressionStrategy(
        "dgc", density=0.01, sharded_modules={torch.nn.Linear}
    ),
}


def _settings(strategy: Any) -> dict[str, Any]:
    """What a strategy was built with: the algorithm's configuration or DiLoCo's settings, and DDP's arguments (the
    sharded strategies have none)."""
    settings = {
        "config": strategy._config,
        "ddp": getattr(strategy, "_ddp_kwargs", None),
        "start_method": getattr(strategy, "_start_method", None),
    }
    if hasattr(strategy, "settings"):
        settings["outer"] = strategy.settings
    if hasattr(strategy, "_taken_over"):
        settings["fix"] = strategy._taken_over.spell("momentum", "0")
    return settings


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_pickles_with_its_settings(name: str) -> None:
    strategy = STRATEGIES[name]()
    copy = pickle.loads(pickle.dumps(strategy))
    assert type(copy) is type(strategy)
    assert _settings(copy) == _settings(strategy)


def test_the_optimizer_take_overs_fix_names_the_strategy_after_pickling() -> None:
    """The fix a refused optimizer's message suggests is spelled for each door, also by a copy."""
    trainer, fabric = (pickle.loads(pickle.dumps(STRATEGIES[n]())) for n in ("DGCStrategy", "FabricCompressionStrategy"))
    assert trainer._taken_over.spell("momentum", "0") == "DGCStrategy(momentum=0)"
    assert fabric._taken_over.spell("momentum", "0") == "FabricCompressionStrategy('deft', momentum=0)"


@pytest.mark.parametrize("name", ["dgc", "deft", "powersgd", "diloco"])
def test_a_trainer_and_a_fabric_with_a_spawn_name_pickle_as_the_launcher_pickles_them(name: str) -> None:
    trainer = L.Trainer(strategy=f"{name}_spawn", accelerator="cpu", devices=2, logger=False)
    fabric = L.Fabric(strategy=f"{name}_spawn", accelerator="cpu", devices=2)
    for original in (trainer.strategy, fabric.strategy):
        assert original.launcher._start_method == "spawn"
    copies = pickle.loads(pickle.dumps((trainer, fabric)))
    for original, copy in zip((trainer.strategy, fabric.strategy), (copies[0].strategy, copies[1].strategy), strict=True):
        assert type(copy) is type(original)
        assert _settings(copy) == _settings(original)
        assert copy.launcher._start_method == "spawn"


@pytest.mark.slow
def test_dgc_spawn_fits_tests_and_refuses_a_second_fit(tmp_path) -> None:
    out = tmp_path / "spawn"
    run_script("spawn_script.py", out, "--mode", "name", launcher="popen")
    main = json.loads((tmp_path / "spawn.main.json").read_text())
    assert main["strategy"] == "DGCStrategy" and main["root_device"] == "cpu"
    assert (main["launcher"], main["start_method"]) == ("_MultiProcessingLauncher", "spawn")
    workers = results(out)
    for rank, worker in enumerate(workers):
        assert worker["rank"] == rank and worker["strategy"] == "DGCStrategy" and worker["device"] == "cpu"
        assert worker["shared"] == [False, False, False] and worker["tied"], "the launcher's memory sharing is off"
        assert worker["initial_seed"] == SEED, "the main process's random state reaches the workers"
        assert worker["steps"] == 4 and worker["compression_ratio"] > 2, "each worker ran the compressed exchange"
        assert worker["copy_strategy"] == "DGCStrategy" and worker["copy_state_equal"], "the trained strategy pickles"
    assert torch.equal(params(out, 0), params(out, 1))
    main_params = torch.load(tmp_path / "spawn.main.params.pt", weights_only=True)
    assert main["weights_changed"] and main["tied"] and torch.equal(main_params, params(out, 0))
    assert main["val_marker"] == 1.0, "the workers' callback metrics reach the main process"
    assert main["test_results"] == [{}]
    assert "twice on the same Trainer instance using a spawn-based strategy is not supported" in main["second_fit"]


@pytest.mark.slow
def test_a_strategy_subclass_with_its_own_launcher_forks_and_sends_extra_results(tmp_path) -> None:
    """DiLoCo with forked processes (as ``"diloco_notebook"``), through a subclass whose launcher sends the worker's
    outer steps back."""
    out = tmp_path / "extras"
    run_script("spawn_script.py", out, "--mode", "extras", launcher="popen")
    main = json.loads((tmp_path / "extras.main.json").read_text())
    assert (main["strategy"], main["launcher"], main["start_method"]) == ("DiLoCoWithExtras", "ExtrasLauncher", "fork")
    assert main["outer_steps_in_worker"] == 2 and main["val_marker"] == 1.0
    for worker in results(out):
        assert worker["steps"] == 2 and worker["copy_state_equal"], "each worker ran two rounds; the strategy pickles"
    assert torch.equal(params(out, 0), params(out, 1)), "DiLoCo's ranks hold the same model once fit ends"
    assert torch.equal(torch.load(tmp_path / "extras.main.params.pt", weights_only=True), params(out, 0))
