"""One momentum per optimizer step, however many backward passes feed it: DGC at density 1 (exact selection,
masking off, SGD momentum taken over) equals DDP in every pattern Lightning and Fabric allow.

Every pattern runs under DDP and under DGC in the same 2 interpreters (``accumulate_script.py``): two
``manual_backward`` calls before one step (plain and Nesterov with weight decay), Lightning's manual
accumulation recipe, two optimizers GAN-style (the second's parameters keep the first pass's gradients), a
parameter left unused every other step (its momentum must stay as it was), and two ``fabric.backward``
calls before one ``optimizer.step()``.
"""

from __future__ import annotations

import pytest
import torch

from tests.lightning.run import run_script

pytestmark = pytest.mark.slow

PATTERNS = ["twice", "twice_nesterov", "accumulate", "gan", "unused", "fabric"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("accumulate") / "acc"
    run_script("accumulate_script.py", out, "--patterns", ",".join(PATTERNS), timeout=600)
    return out


@pytest.mark.parametrize("pattern", PATTERNS)
def test_dgc_at_density_one_equals_ddp(runs, pattern: str) -> None:
    for rank in (0, 1):
        ddp = torch.load(f"{runs}.{pattern}.ddp.rank{rank}.pt", weights_only=True)
        dgc = torch.load(f"{runs}.{pattern}.dgc.rank{rank}.pt", weights_only=True)
        torch.testing.assert_close(dgc, ddp, rtol=1e-5, atol=1e-6)


def test_gradients_dropped_after_the_exchange_applied_momentum_are_an_error(tmp_path) -> None:
    """``zero_grad()`` after a synchronised backward pass, with no step: DDP loses that gradient with the
    optimizer's momentum untouched, the exchange has already taken it into its momentum. A clear error."""
    proc = run_script("accumulate_script.py", tmp_path / "drop", "--patterns", "dropped", check=False, timeout=300)
    assert proc.returncode != 0
    assert "dropped (`zero_grad()`) before any optimizer stepped them" in proc.stderr
