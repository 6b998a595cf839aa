"""The torch and Lightning releases: what CI tests, what the README and the package say of them, and what changed
upstream that touches the code (renamed collectives, Lightning's DDP set-up)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
import re
import warnings
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

import lightning_dgc
from lightning_dgc import comm
from lightning_dgc.comm import collectives
from tests.distributed.launch import run_ranks
from tests.test_packaging import PYPROJECT

ROOT = Path(__file__).resolve().parents[1]
#: torch.distributed's names that torch 2.13 deprecates, and their successors.
RENAMED = {"all_gather_into_tensor": "all_gather_single", "reduce_scatter_tensor": "reduce_scatter_single"}


def _check_stack() -> ModuleType:
    """``.ci/check_stack.py``, which CI runs after installing each stack."""
    spec = importlib.util.spec_from_file_location("check_stack", ROOT / ".ci" / "check_stack.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def test_the_install_sections_name_the_stacks_ci_tests() -> None:
    check_stack = _check_stack()
    run = (ROOT / ".ci" / "run").read_text()
    # each stack is installed, then held to what the README names
    assert run.index('pip install -e ".[dev]"') < run.index("check_stack.py pinned") < run.index("pytest -q -m repeat")
    assert run.index("-r .ci/newest.txt") < run.index("check_stack.py newest")
    assert re.search(r"check_stack.py newest\n(.*\n)*python -m pytest -q\n", run), "the newest stack runs the suite"
    for page, end in (("README.md", "## Quickstart"), ("docs/getting-started.md", "## A first run")):
        text = " ".join((ROOT / page).read_text().split())
        install = text[text.index("## Install") : text.index(end)]
        assert check_stack.readme_sentence() in install, (
            f"{page}'s install section must say what CI tests, in these words: {check_stack.readme_sentence()}"
        )
    assert {p for p, _, _ in check_stack.stack("pinned")} == {"torch", "torchaudio", "lightning"}
    assert {p for p, _, _ in check_stack.stack("newest")} == {"torch", "torchvision", "torchaudio", "lightning"}


def test_the_supported_torch_ends_with_the_newest_release_ci_tests() -> None:
    """pyproject.toml admits no torch minor release past the one CI's newest stack runs, and the pinned one is its
    floor; the error that names the range quotes pyproject.toml."""
    newest = dict((p, v) for p, _, v in _check_stack().stack("newest"))
    pinned = dict((p, v) for p, _, v in _check_stack().stack("pinned"))
    torch_requirement = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))
    floor, ceiling = re.fullmatch(r"torch>=([\d.]+),<([\d.]+)", torch_requirement).groups()
    major, minor = _release(newest["torch"])[:2]
    assert _release(ceiling) == (major, minor + 1), f"pyproject.toml admits {torch_requirement}; CI tests {newest}"
    assert _release(floor) == _release(pinned["torch"])[:2]
    assert collectives.SUPPORTED_TORCH == torch_requirement


def test_the_collectives_use_the_names_this_torch_has() -> None:
    for before, name in RENAMED.items():
        chosen = getattr(collectives, f"_{name}")
        assert chosen is (getattr(dist, name) if hasattr(dist, name) else getattr(dist, before)), name


def test_nothing_calls_the_collectives_torch_renamed() -> None:
    """Only ``lightning_dgc.comm`` calls torch.distributed, by the name the installed torch has; nothing in the
    package, the benchmarks or the tests calls a name that torch 2.13 and 2.14 deprecate."""
    calls = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for folder in ("lightning_dgc", "lightning_dgc_recipes", "benchmarks", "tests")
        for path in (ROOT / folder).rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in RENAMED
    ]
    assert not calls, f"call lightning_dgc.comm's collectives (which pick the name torch has) instead: {calls}"


def _collectives_warnings(rank: int, world_size: int) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """In a real 2-rank gloo group: an all-gather and a reduce-scatter of the exchange, and every warning they raise."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ops = comm.TorchCollectives()
        gathered = ops.all_gather(torch.full((3,), float(rank)), torch.empty(3 * world_size), "all-gather").wait()
        scattered = ops.reduce_scatter(torch.arange(4.0) + rank, "reduce-scatter").wait()
    return [f"{w.category.__name__}: {w.message}" for w in caught], gathered, scattered


def test_the_collectives_raise_no_deprecation_warning_on_this_torch() -> None:
    """torch 2.13 and 2.14 warn (``FutureWarning``) on ``all_gather_into_tensor`` and ``reduce_scatter_tensor``."""
    for rank, (caught, gathered, scattered) in enumerate(run_ranks(_collectives_warnings, 2)):
        assert gathered.tolist() == [0.0] * 3 + [1.0] * 3
        assert scattered.tolist() == ([1.0, 3.0] if rank == 0 else [5.0, 7.0])
        deprecations = [w for w in caught if w.startswith(("FutureWarning", "DeprecationWarning"))]
        assert not deprecations, f"torch {torch.__version__}: {deprecations}"


def _package_modules() -> list[str]:
    return [m.name for m in pkgutil.walk_packages(lightning_dgc.__path__, "lightning_dgc.")]


def test_no_strategy_replaces_how_lightning_builds_ddp() -> None:
    """Lightning 2.6 builds DDP in ``DDPStrategy._setup_model`` (on which CUDA stream depends on its release): the
    strategies inherit it, so that they follow Lightning's. An override must be checked against Lightning's."""
    from lightning.pytorch.strategies import DDPStrategy

    for name in _package_modules():
        importlib.import_module(name)
    found, queue = [], [DDPStrategy]
    while queue:
        cls = queue.pop()
        queue.extend(cls.__subclasses__())
        if cls.__module__.startswith("lightning_dgc"):
            found.append(cls)
            assert "_setup_model" not in vars(cls), (
                f"{cls.__qualname__} overrides DDPStrategy._setup_model: build DDP as Lightning's does (the default"
                " stream; a side stream only while a CUDA graph is captured), or call super()._setup_model"
            )
    assert {"DGCStrategy", "DiLoCoStrategy"} <= {cls.__name__ for cls in found}


def _default_backend(rank: int, world_size: int) -> str:
    return type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__


def test_the_torchcomms_switch_without_its_package_leaves_torchs_own_gloo() -> None:
    """*Getting started*, Install: torch's opt-in torchcomms backend (``TORCH_DISTRIBUTED_USE_TORCHCOMMS=1``) needs
    the ``torchcomms`` package, which PyPI does not serve (its placeholder raises on import); without it torch keeps
    its own process groups, and the exchange runs as it does without the switch."""
    config = getattr(dist, "config", None)
    if not hasattr(config, "use_torchcomms"):
        pytest.skip(f"torch {torch.__version__} has no torchcomms switch")
    try:
        import torchcomms  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torchcomms is installed: run the exchange tests with TORCH_DISTRIBUTED_USE_TORCHCOMMS=1")
    with config.patch(use_torchcomms=True):  # the forked ranks inherit it, as they would the variable
        assert run_ranks(_default_backend, 2) == ["ProcessGroupGloo"] * 2


def test_every_page_that_quotes_the_torch_range_quotes_pyproject() -> None:
    requirement = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
    quoted = {
        f"{page.relative_to(ROOT)}: {found}"
        for page in pages
        for found in re.findall(r"torch>=[\d.]+,<[\d.]+", page.read_text())
        if found != requirement
    }
    assert not quoted, f"pyproject.toml requires {requirement}; these pages say otherwise: {sorted(quoted)}"
