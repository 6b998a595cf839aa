"""Lightning's own CPU tests of its ``DDPStrategy`` and of the launchers it uses, with the strategies in its place.

Lightning 2.6's ``tests_pytorch/strategies/test_ddp.py``, ``test_ddp_integration.py``, ``test_registry.py`` and
``launchers/test_multiprocessing.py`` hold them. Each test here names the one it carries over; the names' tests are in
``tests/test_registry.py``, the fits with a spawn and a fork launcher in ``tests/lightning/test_spawn.py``, and
``docs/migrating-from-ddp.md`` lists those not carried over, with why. The strategies: DGC at density 1 (a DDP job's
first run under the package), DEFT, PowerSGD and DiLoCo at their defaults, and Fabric's doors where Fabric has the
method.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import types
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any
from unittest import mock

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments import ClusterEnvironment, LightningEnvironment
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn.parallel import DistributedDataParallel

import lightning_dgc

#: The Trainer's strategies, built with extra arguments (as the tests build ``DDPStrategy(...)``).
TRAINER: dict[str, Callable[..., Any]] = {
    "dgc": lambda **kwargs: lightning_dgc.DGCStrategy(density=1.0, **kwargs),
    "deft": lambda **kwargs: lightning_dgc.DEFTStrategy(**kwargs),
    "powersgd": lambda **kwargs: lightning_dgc.CompressionStrategy("powersgd", **kwargs),
    "diloco": lambda **kwargs: lightning_dgc.DiLoCoStrategy(**kwargs),
}
FABRIC: dict[str, Callable[..., Any]] = {
    "fabric dgc": lambda **kwargs: lightning_dgc.FabricCompressionStrategy("dgc", density=1.0, **kwargs),
    "fabric diloco": lambda **kwargs: lightning_dgc.FabricDiLoCoStrategy(**kwargs),
}
COMPRESSING = ("dgc", "deft", "powersgd")


def _trainer(strategy: Any, **kwargs: Any) -> L.Trainer:
    return L.Trainer(strategy=strategy, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     enable_checkpointing=False, **kwargs)  # fmt: skip


@pytest.fixture
def threads_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's launchers set ``OMP_NUM_THREADS`` (and torch's threads) when it is unset: keep both as they are."""
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads())))


@pytest.fixture
def no_process_group() -> Iterator[None]:
    """No process group before the test (a one-device fit of an earlier test in this process keeps its own, as a
    Trainer does) and none after it (the test may set up a real one of one rank)."""
    lightning_dgc.destroy_process_group()
    try:
        yield
    finally:
        lightning_dgc.destroy_process_group()


# -- test_ddp.py -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("backend", "device", "expected"),
    [("foo", "cpu", "foo"), ("foo", "cuda:0", "foo"), (None, "cuda:0", "nccl"), (None, "cpu", "gloo")],
)
@pytest.mark.parametrize("name", [*TRAINER, *FABRIC])
def test_process_group_backend(name: str, backend: str | None, device: str, expected: str) -> None:
    """``test_ddp_process_group_backend``: the backend asked for, else the device's (no GPU needed to name one)."""
    strategy = {**TRAINER, **FABRIC}[name](process_group_backend=backend, parallel_devices=[torch.device(device)])
    assert strategy._get_process_group_backend() == expected


@pytest.mark.parametrize("timeout", [timedelta(seconds=30), None])
@pytest.mark.parametrize("name", list(TRAINER))
def test_the_process_group_gets_the_timeout_and_no_device_on_cpu(
    name: str, timeout: timedelta | None, no_process_group: None
) -> None:
    """``test_set_timeout`` and ``test_device_id_passed_for_cuda_devices_pytorch``: ``init_process_group`` is called
    with the strategy's timeout (Lightning's default when none is given) and no ``device_id`` on the CPU."""
    strategy = TRAINER[name](**({"timeout": timeout} if timeout else {}))
    trainer = _trainer(strategy, max_epochs=1, accelerator="cpu")
    trainer.strategy.connect(BoringModel())
    trainer.lightning_module.trainer = trainer
    with mock.patch("torch.distributed.init_process_group") as init_process_group:
        trainer.strategy.setup_environment()
    init_process_group.assert_called_with(
        "gloo", rank=0, world_size=1, timeout=timeout or default_pg_timeout, device_id=None
    )


@pytest.mark.parametrize("fn", [TrainerFn.FITTING, TrainerFn.VALIDATING])
@pytest.mark.parametrize("name", list(TRAINER))
def test_the_model_is_wrapped_when_fitting_only(name: str, fn: TrainerFn, no_process_group: None) -> None:
    """``test_ddp_configure_ddp``: set up for ``fit`` the model is wrapped in DDP with the exchange's state on its
    parameters; for anything else it is left as it is and no exchange is set up. DiLoCo wraps nothing (flat): its outer
    state is what ``fit`` sets up."""
    model = BoringModel()
    trainer = _trainer(TRAINER[name](), max_epochs=1, accelerator="cpu")
    trainer.state.fn = fn
    trainer.strategy.connect(model)
    trainer.lightning_module.trainer = trainer
    trainer.strategy.setup_environment()
    assert isinstance(trainer.model, L.LightningModule)
    trainer.strategy.setup(trainer)
    fitting = fn == TrainerFn.FITTING
    if name == "diloco":
        assert isinstance(trainer.model, L.LightningModule)
        assert (trainer.strategy._outer is not None) == fitting
        return
    assert isinstance(trainer.model, DistributedDataParallel) == fitting
    assert isinstance(trainer.model, L.LightningModule) != fitting
    if fitting:
        names = [n for n, _ in model.named_parameters()]
        assert list(trainer.strategy.exchange_state.param_names.values()) == names
    else:
        assert trainer.strategy._state is None


# -- test_ddp_integration.py -----------------------------------------------------------------------------------------
class _ExternalProcesses(ClusterEnvironment):
    """One process, created by someone else (as under torchrun or SLURM)."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        return 8080

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return 1

    def set_world_size(self, size: int) -> None:
        pass

    def global_rank(self) -> int:
        return 0

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return 0


@pytest.mark.parametrize("name", list(TRAINER))
def test_processes_created_outside_run_the_function_and_start_none(name: str, threads_as_they_are: None) -> None:
    """``test_configure_launcher_create_processes_externally``."""
    strategy = TRAINER[name](cluster_environment=_ExternalProcesses(), parallel_devices=[torch.device("cpu")])
    assert strategy.launcher is None
    strategy._configure_launcher()
    assert isinstance(strategy.launcher, _SubprocessScriptLauncher)
    assert strategy.launcher.launch(lambda x: x + 1, 41) == 42
    assert strategy.launcher.procs == []


class _LaunchesOnEveryRank(LightningEnvironment):
    @property
    def creates_processes_externally(self) -> bool:
        return False  # whatever LOCAL_RANK says: a rank > 0 would launch processes too


@pytest.mark.parametrize("name", list(TRAINER))
def test_a_rank_above_zero_that_would_launch_processes_is_refused(
    name: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``test_incorrect_ddp_script_spawning``, through the registered name."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    trainer = L.Trainer(default_root_dir=tmp_path, strategy=name, accelerator="cpu", devices=2,
                        plugins=[_LaunchesOnEveryRank()], barebones=True)  # fmt: skip
    with pytest.raises(RuntimeError, match="Lightning attempted to launch new distributed processes with `local_rank > 0`"):
        trainer.fit(BoringModel())


# -- launchers/test_multiprocessing.py -------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", ["_fork", "_notebook"])
@pytest.mark.parametrize("name", list(TRAINER))
def test_a_forking_name_is_refused_where_fork_is_not_available(name: str, suffix: str) -> None:
    """``test_multiprocessing_launcher_forking_on_unsupported_platform``: on a platform without ``fork`` (Windows),
    the forking names fail when the Trainer is built."""
    with (
        mock.patch("lightning.pytorch.strategies.launchers.multiprocessing.mp.get_all_start_methods", return_value=[]),
        pytest.raises(ValueError, match="The start method 'fork' is not available on this platform"),
    ):
        _trainer(f"{name}{suffix}")


def _spawning(name: str, tmp_path: Any, **kwargs: Any) -> tuple[Any, L.Trainer]:
    """A strategy with the spawn launcher, in its Trainer."""
    strategy = TRAINER[name](start_method="spawn", **kwargs)
    trainer = L.Trainer(accelerator="cpu", default_root_dir=tmp_path, strategy=strategy, logger=False)
    assert isinstance(strategy.launcher, _MultiProcessingLauncher)
    return strategy, trainer


class _Ranks(ClusterEnvironment):
    """Four processes on two nodes; this one is ``node_rank``, ``local_rank``."""

    def __init__(self, node_rank: int, local_rank: int) -> None:
        self._node_rank, self._local_rank = node_rank, local_rank

    @property
    def creates_processes_externally(self) -> bool:
        return False

    @property
    def main_address(self) -> str:
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        return 8080

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return 4

    def set_world_size(self, size: int) -> None:
        pass

    def global_rank(self) -> int:
        return 2 * self._node_rank + self._local_rank

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return self._local_rank

    def node_rank(self) -> int:
        return self._node_rank


@pytest.mark.parametrize("fn", [TrainerFn.FITTING, TrainerFn.VALIDATING])
@pytest.mark.parametrize(("node_rank", "local_rank"), [(0, 0), (0, 1), (1, 0), (1, 1)])
@pytest.mark.parametrize("name", list(TRAINER))
def test_the_first_process_of_each_node_sends_the_weights_back(
    name: str, node_rank: int, local_rank: int, fn: TrainerFn, tmp_path
) -> None:
    """``test_collect_rank_zero_results``: after ``fit``, the first process of each node writes the model's weights
    to a temporary file for the main process; after anything else, no weights; other processes send nothing."""
    strategy, trainer = _spawning(name, tmp_path, cluster_environment=_Ranks(node_rank, local_rank))
    assert (strategy.node_rank, strategy.local_rank, strategy.global_rank) == (
        node_rank, local_rank, 2 * node_rank + local_rank,
    )  # fmt: skip
    model = BoringModel()
    trainer.strategy.connect(model)
    trainer.state.fn = fn
    output = strategy.launcher._collect_rank_zero_results(trainer, {})
    if local_rank != 0:
        assert output is None
    elif fn != TrainerFn.FITTING:
        assert output.weights_path is None
    else:
        assert output.weights_path.endswith(".temp.ckpt")
        saved = torch.load(output.weights_path, weights_only=True)
        assert saved.keys() == model.state_dict().keys()
        assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("fn", [TrainerFn.FITTING, TrainerFn.VALIDATING])
@pytest.mark.parametrize("name", list(TRAINER))
def test_the_main_process_loads_the_weights_sent_back(name: str, fn: TrainerFn, tmp_path) -> None:
    """``test_transfer_weights``: the main process loads what a fit's worker sent, and removes the file."""
    strategy, trainer = _spawning(name, tmp_path)
    model = BoringModel()
    trainer.strategy.connect(model)
    trainer.state.fn = fn
    sent = {k: v.clone() for k, v in model.state_dict().items()}
    output = strategy.launcher._collect_rank_zero_results(trainer, {})
    with torch.no_grad():
        model.layer.weight.zero_()  # what the main process holds, unlike what the worker sent
    strategy.launcher._recover_results_in_main_process(output, trainer)
    fitting = fn == TrainerFn.FITTING
    assert torch.equal(model.layer.weight, sent["layer.weight"]) == fitting
    assert (output.weights_path is not None) == fitting
    assert output.weights_path is None or not os.path.exists(output.weights_path)


@pytest.mark.parametrize("name", list(TRAINER))
def test_weights_sent_back_load_into_a_model_that_changed(name: str, tmp_path) -> None:
    """``test_non_strict_loading``: the main process's model may have layers the worker's had not."""
    strategy, trainer = _spawning(name, tmp_path)
    model = BoringModel()
    trainer.strategy.connect(model)
    trainer.state.fn = TrainerFn.FITTING
    sent = model.layer.weight.detach().clone()
    output = strategy.launcher._collect_rank_zero_results(trainer, {})
    model.extra = torch.nn.Linear(2, 2)  # not in the weights sent
    with torch.no_grad():
        model.layer.weight.zero_()
    strategy.launcher._recover_results_in_main_process(output, trainer)
    assert torch.equal(model.layer.weight, sent)


@pytest.mark.parametrize("name", list(TRAINER))
def test_the_launcher_passes_a_signal_on_to_its_processes(name: str, tmp_path) -> None:
    """``test_kill``: what Lightning's signal handling calls on the main process reaches every process started."""
    strategy, _ = _spawning(name, tmp_path)
    processes = [multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,)) for _ in range(2)]
    for process in processes:
        process.start()
    try:
        strategy.launcher.procs = processes
        strategy.launcher.kill(signal.SIGTERM)
        for process in processes:
            process.join(timeout=30)
        assert [process.exitcode for process in processes] == [-signal.SIGTERM, -signal.SIGTERM]
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()


@pytest.mark.parametrize("name", list(TRAINER))
def test_a_script_without_a_main_guard_is_refused(name: str, tmp_path) -> None:
    """``test_check_for_missing_main_guard``: a process that is importing its main module (as a spawned process
    does with a script that has no ``if __name__ == "__main__":``) is told to add one, and starts nothing."""
    strategy, _ = _spawning(name, tmp_path)
    importing_main = types.SimpleNamespace(_inheriting=True)
    with (
        mock.patch("lightning.pytorch.strategies.launchers.multiprocessing.mp.current_process", return_value=importing_main),
        pytest.raises(RuntimeError, match="requires that your script guards the main"),
    ):
        strategy.launcher.launch(function=lambda: None)
    assert strategy.launcher.procs == []
