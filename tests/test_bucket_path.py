"""A bucket's path through the package reads top to bottom: the hook asks the state once for the bucket's plan,
calls the algorithm, then the collectives, then records once.

The path is traced with ``sys.setprofile`` on one simulated rank: every call the hook makes into another module
of the package is a stop (consecutive calls into one module are one stop), and a stop at a module the path had
already left is a return. A decode run as a collective's callback is not the hook's path (it runs when the
collective completes, in whichever thread completes it)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from torch import nn

import lightning_dgc
from lightning_dgc import algorithms, comm
from lightning_dgc.exchange import hook
from lightning_dgc.exchange.state import ExchangeState

ROOT = Path(lightning_dgc.__file__).parent
HOOK = hook.__file__
COMM = str(Path(comm.__file__).parent)
MAX_STOPS, MAX_RETURNS = 12, 3


def _module(filename: str) -> str:
    return ".".join(Path(filename).relative_to(ROOT).with_suffix("").parts)


def _in_a_callback(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs inside a collective (its callback), below the hook's entry."""
    while frame is not None and frame.f_code is not hook.exchange.__code__:
        if frame.f_code.co_filename.startswith(COMM):
            return True
        frame = frame.f_back
    return False


def bucket_path(name: str, two_level: bool) -> list[str]:
    """The modules one bucket's exchange (the second step's, its plan made) enters from the hook, in order."""
    path: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        code, caller = frame.f_code, frame.f_back
        if event != "call" or caller is None or caller.f_code.co_filename != HOOK:
            return
        if code.co_filename.startswith(str(ROOT)) and code.co_filename != HOOK and not _in_a_callback(caller):
            module = _module(code.co_filename)
            if path[-1] != module:
                path.append(module)

    def rank_run(arg: Any, rank: int) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 48))
        config = algorithms.get(name).config_class(**({"density": 0.05} if name != "powersgd" else {}))
        state = ExchangeState(config, topology=arg) if two_level else ExchangeState(config, collectives=arg)
        state.register_parameters(model.named_parameters())
        params = list(model.parameters())
        for step in range(2):
            for p in params:
                p.grad = torch.zeros_like(p)
            traced = rank == 0 and step == 1
            if traced:
                path.append(_module(HOOK))
                sys.setprofile(profile)
            try:
                future = hook.exchange(state, params, torch.randn(sum(p.numel() for p in params)))
            finally:
                if traced:
                    sys.setprofile(None)
            future.wait()
            state.finish_step()

    if two_level:
        comm.simulate_nodes(2, 2, lambda topology: rank_run(topology, topology.node_rank * 2 + topology.local_rank))
    else:
        comm.simulate(2, lambda collectives: rank_run(collectives, collectives.rank))
    return path


def returns(path: list[str]) -> int:
    return sum(module in path[:i] for i, module in enumerate(path))


@pytest.mark.parametrize("two_level", [False, True], ids=["flat", "two-level"])
@pytest.mark.parametrize("name", ["dgc", "deft", "powersgd"])
def test_a_bucket_walks_down_once_plan_algorithm_collectives_record(name: str, two_level: bool) -> None:
    path = bucket_path(name, two_level)
    shown = " > ".join(path)
    assert path[:2] == ["exchange.hook", "exchange.state"], f"the plan first: {shown}"
    assert path[-1] == "exchange.state" and path.count("exchange.state") == 2, f"plan once, record once: {shown}"
    assert any(m.startswith("algorithms.") for m in path), shown
    assert len(path) <= MAX_STOPS and returns(path) <= MAX_RETURNS, f"{len(path)} stops, {returns(path)} returns: {shown}"
