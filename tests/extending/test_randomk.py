"""An algorithm written outside the package (``randomk.py``, the public API only): the authors' kit passes
it, and ``Trainer(strategy="randomk")`` trains with it whatever the import order."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lightning_dgc.kit import check_algorithm
from tests.extending.randomk import RandomKConfig
from tests.lightning.run import ROOT, _environment, params, results, run_script


def test_randomk_passes_check_algorithm() -> None:
    # draws keyed by tensor name and step: it resumes exactly even when the buckets come in another order
    check_algorithm(
        RandomKConfig(density=0.1), lossless=RandomKConfig(density=1.0), reorder_buckets_on_resume=True
    )


def test_check_algorithm_names_a_broken_contract() -> None:
    """An algorithm that forgets to hold back what it did not send fails the conservation check."""
    from tests.extending import leaky  # noqa: F401  (registers "leaky_randomk")

    with pytest.raises(AssertionError, match="conservation"):
        check_algorithm(leaky.LeakyConfig(density=0.1))


def test_check_algorithm_rejects_draws_that_depend_on_the_process() -> None:
    """Seeded with ``hash(name)``: simulated ranks (threads of one process) agree, separate processes do not."""
    from tests.extending import hashseeded

    config = hashseeded.HashSeededConfig(density=0.1)
    check_algorithm(config, separate_process=False)  # what the ranks of one process cannot see
    with pytest.raises(AssertionError, match=r"ranks identical: .*another process \(another PYTHONHASHSEED\)"):
        check_algorithm(config)


def test_check_algorithm_rejects_a_value_held_back_forever() -> None:
    """Never sending one value of each tensor conserves the gradient; the lossless setting (density 1 by default)
    shows it."""
    from tests.extending import holdback

    config = holdback.HoldBackConfig(density=0.1)
    check_algorithm(config, lossless=None, liveness_steps=None)  # conservation alone holds
    with pytest.raises(AssertionError, match=r"lossless: step 0: encoder.weight's update .*first: \[0\]"):
        check_algorithm(config)
    with pytest.raises(AssertionError, match=r"liveness: encoder.weight: 1 of 3072 values were never sent"):
        check_algorithm(config, lossless=None)  # and a steady gradient shows it without the lossless setting


def test_check_algorithm_names_a_value_the_memory_holds_at_the_lossless_setting() -> None:
    """An update that equals the mean while the memory keeps a copy of a value: held back, sent twice later."""
    from tests.extending import holdback

    with pytest.raises(AssertionError, match=r"lossless: step 0: the mean 'error' memory of .* holds back"):
        check_algorithm(
            holdback.KeepCopyConfig(density=0.1), conservation=False, lossless=holdback.KeepCopyConfig(density=1.0)
        )


def test_check_algorithm_needs_an_importable_algorithm_for_the_other_process(monkeypatch) -> None:
    from tests.extending import hashseeded

    monkeypatch.setattr(hashseeded.HashSeededConfig, "__module__", "__main__")  # as in a script
    with pytest.raises(ValueError, match="another process cannot import HashSeededConfig.*separate_process=False"):
        check_algorithm(hashseeded.HashSeededConfig(density=0.1))


@pytest.mark.parametrize("first", ["lightning.pytorch", "tests.extending.randomk"])
def test_strategy_name_registered_in_any_import_order(first: str) -> None:
    second = "tests.extending.randomk" if first == "lightning.pytorch" else "lightning.pytorch"
    code = (
        f"import {first}; import {second}\n"
        "from lightning.fabric.strategies import STRATEGY_REGISTRY\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "from lightning_dgc.front.registration import ddp_family\n"
        "names = [f'randomk{s}' for s in ddp_family('trainer')]\n"
        "missing = [n for n in names if n not in StrategyRegistry]\n"
        "missing += [f'Fabric: randomk{s}' for s in ddp_family('fabric') if f'randomk{s}' not in STRATEGY_REGISTRY]\n"
        "assert len(names) == 12 and 'randomk_notebook' in names and not missing, missing\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=_environment(), cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_trainer_fits_with_an_outside_algorithm(tmp_path) -> None:
    """Lightning imported first, then the user's module: ``Trainer(strategy="randomk")`` on 2 processes."""
    out = tmp_path / "randomk"
    run_script("randomk_script.py", out, "--max-steps", "6", launcher="popen")
    summaries = results(out)
    for summary in summaries:
        assert summary["strategy"] == "CompressionStrategy" and summary["hook_calls"] >= 6
        assert summary["stats"][-1]["algorithm"] == "randomk"
        assert 0 < summary["stats"][-1]["values_sent"] < summary["stats"][-1]["numel"]
        assert summary["residual_norm"] > 0  # what was not sent is held back
    assert torch.equal(params(out, 0), params(out, 1))


@pytest.mark.parametrize("steps", [4, 10])
def test_check_algorithm_names_a_value_that_starves(steps: int) -> None:
    """Never drawing one value at densities below 1: exact at density 1, and the gradient is conserved (held back
    forever); only a steady gradient over enough steps shows that the value is never sent."""
    from tests.extending import starving

    config = starving.StarvingConfig(density=0.1)
    check_algorithm(config, steps=steps, liveness_steps=None)  # every other check passes
    with pytest.raises(
        AssertionError,
        match=r"liveness: encoder.weight: 1 of 3072 values were never sent in \d+ steps of a steady gradient \(first:"
        r" value 0, at \(0, 0\); rank 0 holds \d+ steps of its gradient back\)",
    ):
        check_algorithm(config, steps=steps)


def test_the_liveness_check_asks_for_its_steps_where_the_algorithm_sends_little() -> None:
    with pytest.raises(ValueError, match=r"sends 0\.00\d+ of the values a step, .* Pass liveness_steps=\d+"):
        check_algorithm(RandomKConfig(density=0.001), lossless=None, separate_process=False)
