"""Packaging: every package ships, the configs ship and resolve by name, one version, the declared license."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import lightning_dgc
from lightning_dgc_recipes.__main__ import builtin_configs, resolve_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CONFIGS = ROOT / "configs"


def test_every_package_directory_is_listed_for_the_wheel() -> None:
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("lightning_dgc", "lightning_dgc_recipes")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"
    assert {"lightning_dgc_recipes.configs", "lightning_dgc_recipes.configs.algo"} <= listed


def test_the_configs_are_package_data() -> None:
    setuptools = PYPROJECT["tool"]["setuptools"]
    assert setuptools["package-dir"]["lightning_dgc_recipes.configs"] == "configs"
    assert setuptools["package-data"]["lightning_dgc_recipes.configs"] == ["*.yaml"]
    assert setuptools["package-data"]["lightning_dgc_recipes.configs.algo"] == ["*.yaml"]
    assert {p.parent for p in CONFIGS.rglob("*.yaml")} == {CONFIGS, CONFIGS / "algo"}


def test_one_version_source_and_a_release_section_for_it() -> None:
    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lightning_dgc.__version__"}
    changelog = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[([^\]]+)\]", changelog, re.M)
    assert releases[:2] == ["Unreleased", lightning_dgc.__version__], releases


def test_the_license_file_matches_the_declared_license() -> None:
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text


def test_metadata_is_complete() -> None:
    project = PYPROJECT["project"]
    assert project["authors"] and project["keywords"] and project["classifiers"]
    assert any(c.startswith("License") or c.startswith("Programming Language") for c in project["classifiers"])
    assert {"lightning-dgc", "lightning-dgc-recipes"} <= set(project["scripts"])
    torch = next(d for d in project["dependencies"] if d.startswith("torch"))
    assert torch.startswith("torch>=") and "<2.12" not in torch  # not pinned to one minor release
    assert not any(d.startswith(("torchaudio", "torchvision")) for d in project["dependencies"])


def _pins(extra: str) -> dict[str, str]:
    """``{package: "==2.11.0"}`` of an extra's requirements on torch and torchaudio."""
    names = {d: re.split(r"[<>=!~]", d, maxsplit=1)[0] for d in PYPROJECT["project"]["optional-dependencies"][extra]}
    return {name: d[len(name):] for d, name in names.items() if name in ("torch", "torchaudio")}


def test_torchaudio_comes_with_a_torch_release_its_library_loads_beside() -> None:
    """torchaudio pins no torch. Its 2.11.1 library needs a symbol that torch 2.13 adds (2.11 and 2.12 lack it),
    and 2.11.0's CUDA 13.0 build refuses torch 2.15's CUDA 13.2: each extra that installs it says which torch."""
    assert _pins("speech") == {"torch": ">=2.13", "torchaudio": ">=2.11.1"}
    assert _pins("dev") == {"torch": "==2.11.0", "torchaudio": "==2.11.0"}  # the pinned stack's pair


def test_builtin_config_names_cover_every_config() -> None:
    expected = {p.relative_to(CONFIGS).with_suffix("").as_posix() for p in CONFIGS.rglob("*.yaml")}
    assert set(builtin_configs()) == expected
    assert {"cifar10_resnet20_cpu", "algo/dgc", "algo/deft", "algo/powersgd"} <= expected


@pytest.mark.parametrize(
    "value, expected",
    [
        ("cifar10_resnet20_cpu", "cifar10_resnet20_cpu.yaml"),
        ("cifar10_resnet20_cpu.yaml", "cifar10_resnet20_cpu.yaml"),
        ("configs/cifar10_resnet20_cpu.yaml", "cifar10_resnet20_cpu.yaml"),
        ("algo/dgc", "algo/dgc.yaml"),
        ("configs/algo/dgc.yaml", "algo/dgc.yaml"),
    ],
)
def test_builtin_names_resolve_from_any_folder(
    value: str, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # outside the checkout: no configs/ here
    assert Path(resolve_config(value)).resolve() == (CONFIGS / expected).resolve()


def test_an_existing_file_wins_and_inline_yaml_is_left_to_the_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "algo").mkdir()
    (tmp_path / "algo" / "dgc.yaml").write_text("trainer: {}\n")
    assert resolve_config("algo/dgc.yaml") == "algo/dgc.yaml"  # the user's own file
    assert resolve_config("trainer: {max_epochs: 1}") == "trainer: {max_epochs: 1}"  # inline YAML
    assert resolve_config("{}") == "{}"


@pytest.mark.parametrize(("value", "closest"), [("cifar10_resnet21", "cifar10_resnet20"), ("algo/dgcc", "algo/dgc")])
def test_an_unknown_config_name_lists_the_builtin_names(
    value: str, closest: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=f"no such file.*Did you mean `{closest}`") as error:
        resolve_config(value)
    assert all(f" {name}," in str(error.value) or f" {name}." in str(error.value) for name in builtin_configs())


def test_powersgd_config_is_exported() -> None:
    from lightning_dgc.algorithms.powersgd import PowerSGDConfig

    assert lightning_dgc.PowerSGDConfig is PowerSGDConfig and "PowerSGDConfig" in lightning_dgc.__all__


def test_a_renamed_config_still_resolves_with_a_warning_that_names_the_new_one() -> None:
    with pytest.warns(FutureWarning, match=r"`algo/dgc_adamw` is the previous name of `algo/dgc_1pct_int8`"):
        old = resolve_config("algo/dgc_adamw")
    new = resolve_config("algo/dgc_1pct_int8")
    import yaml

    assert yaml.safe_load(Path(old).read_text()) == yaml.safe_load(Path(new).read_text())  # the same settings
