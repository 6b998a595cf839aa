"""A peer that dies or hangs: every surviving rank fails loudly, never trains on alone.

The ranks are started as separate processes, as torchrun or srun start them, so that a dead rank
is not noticed by Lightning's launcher but only through the collectives.
"""

from __future__ import annotations

import re
import time

import pytest

from tests.lightning.run import launch_ranks

pytestmark = pytest.mark.slow

TIMEOUT_S = 10
MAX_STEPS = 120
FAULT_STEP = 12


@pytest.mark.parametrize("fault", ["stop", "kill"])
@pytest.mark.parametrize("strategy", ["dgc", "deft"])
def test_survivor_raises_naming_the_collective(tmp_path, strategy: str, fault: str) -> None:
    """Rank 1 is SIGSTOPped (hung) or SIGKILLed (dead) at step 12; rank 0 must exit non-zero at once
    (within the process group's timeout of 10 s for a hung peer), with an error naming the collective."""
    out = tmp_path / f"{strategy}_{fault}"
    ranks = launch_ranks(
        "fit_script.py", out, "--strategy", strategy, "--timeout", str(TIMEOUT_S), "--max-steps", str(MAX_STEPS),
        "--log-steps", f"--{fault}", f"1:{FAULT_STEP}",
    )  # fmt: skip
    start = time.monotonic()
    try:
        returncode = ranks[0].process.wait(timeout=120)
        elapsed = time.monotonic() - start
    finally:
        for rank in ranks:
            rank.stop()
    stdout, stderr = ranks[0].output()
    steps = [int(s) for s in re.findall(r"rank 0 step (\d+)", stdout)]
    assert returncode != 0, f"rank 0 trained on alone (last step {steps[-1:]}):\n{stderr[-2000:]}"
    assert steps and max(steps) <= FAULT_STEP + 1, f"rank 0 went on to step {max(steps)}"
    assert elapsed < 4 * TIMEOUT_S, f"rank 0 took {elapsed:.0f} s to give up"
    named = re.search(r"CollectiveError: lightning_dgc: the (all-gather|all-reduce) of [^.]+ failed", stderr)
    assert named, stderr[-3000:]
