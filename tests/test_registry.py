"""Every strategy has the names Lightning gives DDP, in the Trainer's and Fabric's registries, and each name builds
the strategy with the DDP arguments of its ``ddp`` twin (start method, ``find_unused_parameters``): what a user who
types ``"ddp_notebook"`` or ``"ddp_find_unused_parameters_true"`` types with the strategy's name instead."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.pytorch.plugins import TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

import lightning_dgc
from lightning_dgc import algorithms
from lightning_dgc.front.registration import ddp_family

#: What follows "ddp" in the names Lightning 2.6 registers for DDPStrategy (the Trainer's) and Fabric's.
TRAINER_FAMILY = (
    "", "_spawn", "_fork", "_notebook", "_find_unused_parameters_false", "_find_unused_parameters_true",
    "_spawn_find_unused_parameters_false", "_spawn_find_unused_parameters_true",
    "_fork_find_unused_parameters_false", "_fork_find_unused_parameters_true",
    "_notebook_find_unused_parameters_false", "_notebook_find_unused_parameters_true",
)  # fmt: skip
FABRIC_FAMILY = ("", "_spawn", "_fork", "_notebook", "_find_unused_parameters_true")
#: The class each name builds in the Trainer's registry (any other algorithm: CompressionStrategy).
TRAINER_CLASSES = {"dgc": lightning_dgc.DGCStrategy, "deft": lightning_dgc.DEFTStrategy,
                   "diloco": lightning_dgc.DiLoCoStrategy}  # fmt: skip
NAMES = ("dgc", "deft", "powersgd", "diloco")


def _quiet_trainer(strategy: str) -> L.Trainer:
    return L.Trainer(strategy=strategy, accelerator="cpu", logger=False, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False)  # fmt: skip


def _expected_ddp_kwargs(name: str, twin: dict[str, Any]) -> dict[str, Any]:
    """The DDP wrapper's arguments a name gives, from its ``ddp`` twin's: the compression strategies ask DDP for
    ``gradient_as_bucket_view=True`` (their ``.grad`` live in DDP's bucket, see ``CompressionStrategy``); DiLoCo
    passes ``find_unused_parameters`` always (to the DDP inside each node of a hierarchical run)."""
    if name == "diloco":
        return {"find_unused_parameters": False, **twin}
    return {**twin, "gradient_as_bucket_view": True}


def test_the_family_is_lightnings_ddp_family() -> None:
    """The names registered for every strategy are those Lightning registers for its own DDPStrategy."""
    assert tuple(ddp_family("trainer")) == TRAINER_FAMILY
    assert tuple(ddp_family("fabric")) == FABRIC_FAMILY
    trainer_ddp = {name for name, entry in StrategyRegistry.items() if entry["strategy"] is DDPStrategy}
    fabric_ddp = {name for name, entry in STRATEGY_REGISTRY.items() if entry["strategy"] is FabricDDPStrategy}
    assert trainer_ddp == {f"ddp{suffix}" for suffix in TRAINER_FAMILY}
    assert fabric_ddp == {f"ddp{suffix}" for suffix in FABRIC_FAMILY}


@pytest.mark.parametrize("name", [*algorithms.registered(), "diloco"])
def test_every_algorithm_and_diloco_have_the_whole_family_in_both_registries(name: str) -> None:
    """Lightning's ``test_ddp_find_unused_parameters_strategy_registry``: the registry's class and arguments of each
    name are its ``ddp`` twin's arguments, with the algorithm's name where the class takes it."""
    fixed = {"algorithm": name} if name not in TRAINER_CLASSES else {}
    trainer_class = TRAINER_CLASSES.get(name, lightning_dgc.CompressionStrategy)
    for suffix in TRAINER_FAMILY:
        entry = StrategyRegistry[f"{name}{suffix}"]
        assert entry["strategy"] is trainer_class
        assert entry["init_params"] == {**fixed, **StrategyRegistry[f"ddp{suffix}"]["init_params"]}
    fabric_class = lightning_dgc.FabricDiLoCoStrategy if name == "diloco" else lightning_dgc.FabricCompressionStrategy
    fixed = {"algorithm": name} if name != "diloco" else {}
    for suffix in FABRIC_FAMILY:
        entry = STRATEGY_REGISTRY[f"{name}{suffix}"]
        assert entry["strategy"] is fabric_class
        assert entry["init_params"] == {**fixed, **STRATEGY_REGISTRY[f"ddp{suffix}"]["init_params"]}


@pytest.mark.parametrize("suffix", TRAINER_FAMILY)
@pytest.mark.parametrize("name", NAMES)
def test_each_trainer_name_builds_its_ddp_twins_arguments(name: str, suffix: str) -> None:
    """Lightning's ``test_ddp_kwargs_from_registry``: ``Trainer(strategy=...)`` gets the start method, the launcher
    and the DDP arguments of ``"ddp<suffix>"`` (``gradient_as_bucket_view=True`` besides, on purpose)."""
    strategy, twin = _quiet_trainer(f"{name}{suffix}").strategy, _quiet_trainer(f"ddp{suffix}").strategy
    assert isinstance(strategy, TRAINER_CLASSES.get(name, lightning_dgc.CompressionStrategy))
    if name != "diloco":
        assert strategy.algorithm == name
    assert strategy._start_method == twin._start_method
    assert type(strategy.launcher) is type(twin.launcher)
    assert getattr(strategy.launcher, "_start_method", None) == getattr(twin.launcher, "_start_method", None)
    assert strategy._ddp_kwargs == _expected_ddp_kwargs(name, twin._ddp_kwargs)


@pytest.mark.parametrize("suffix", FABRIC_FAMILY)
@pytest.mark.parametrize("name", NAMES)
def test_each_fabric_name_builds_its_ddp_twins_arguments(name: str, suffix: str) -> None:
    strategy = L.Fabric(strategy=f"{name}{suffix}", accelerator="cpu", devices=2).strategy
    twin = L.Fabric(strategy=f"ddp{suffix}", accelerator="cpu", devices=2).strategy
    expected = lightning_dgc.FabricDiLoCoStrategy if name == "diloco" else lightning_dgc.FabricCompressionStrategy
    assert isinstance(strategy, expected)
    if name != "diloco":
        assert strategy.algorithm == name
    assert strategy._start_method == twin._start_method
    assert type(strategy.launcher) is type(twin.launcher)
    assert getattr(strategy.launcher, "_start_method", None) == getattr(twin.launcher, "_start_method", None)
    assert strategy._ddp_kwargs == _expected_ddp_kwargs(name, twin._ddp_kwargs)


def test_a_name_and_its_ddp_twin_differ_only_by_the_strategy() -> None:
    """The DDP arguments the strategies add: DDP's ``gradient_as_bucket_view`` is True under the compression
    strategies (docs: Migrating from DDP); every other argument is the twin's."""
    assert _quiet_trainer("ddp").strategy._ddp_kwargs == {}
    assert _quiet_trainer("dgc").strategy._ddp_kwargs == {"gradient_as_bucket_view": True}
    assert _quiet_trainer("powersgd_spawn_find_unused_parameters_true").strategy._ddp_kwargs == {
        "find_unused_parameters": True, "gradient_as_bucket_view": True,
    }  # fmt: skip
    assert _quiet_trainer("diloco_notebook").strategy._ddp_kwargs == {"find_unused_parameters": False}


@pytest.mark.parametrize(
    ("strategy_class", "fixed"),
    [(lightning_dgc.DGCStrategy, {"density": 1.0}), (lightning_dgc.CompressionStrategy, {"algorithm": "powersgd"}),
     (lightning_dgc.DiLoCoStrategy, {"sync_every": 4})],
)  # fmt: skip
def test_a_name_the_user_registers_builds_the_strategy_with_its_arguments(strategy_class: type, fixed: dict) -> None:
    """Lightning's ``test_custom_registered_strategy_to_strategy_flag``: a name registered by the user for one of the
    strategies, with a checkpoint plugin, builds that strategy with that plugin."""
    checkpoint_io = TorchCheckpointIO()
    name = f"custom_{strategy_class.__name__.lower()}"
    StrategyRegistry.register(name, strategy_class, description="a user's own", checkpoint_io=checkpoint_io, **fixed)
    try:
        strategy = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False).strategy
    finally:
        StrategyRegistry.remove(name)
    assert isinstance(strategy, strategy_class)
    assert strategy.checkpoint_io is checkpoint_io
