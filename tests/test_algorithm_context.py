"""An algorithm sees the exchange through :class:`~lightning_dgc.algorithms.ExchangeContext`: the package's own
algorithms, the kit's example algorithms and the extending guide's code use nothing else of ``self.state``, and
the exchange's own state offers every member of it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch

from lightning_dgc import algorithms
from lightning_dgc.algorithms import ExchangeContext
from lightning_dgc.comm import simulate
from lightning_dgc.exchange.state import ExchangeState

REPO = Path(__file__).resolve().parents[1]
MEMBERS = set(ExchangeContext.__annotations__) | {name for name in vars(ExchangeContext) if not name.startswith("_")}


def state_members_used(source: str) -> set[str]:
    """Every ``X`` of ``self.state.X`` in ``source``."""
    used = set()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "state"
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "self"
        ):
            used.add(node.attr)
    return used


def test_the_context_names_world_step_memory_generators_settings_and_statistics() -> None:
    assert {"world_size", "rank", "step", "memory", "generator", "draw_generator", "tensor_generator",
            "settings_for", "continues", "param"} <= MEMBERS  # fmt: skip
    assert "finish_step" not in MEMBERS and "plan" not in MEMBERS and "stats" not in MEMBERS


def test_algorithms_use_only_the_context() -> None:
    sources = {p: p.read_text() for p in [*(REPO / "lightning_dgc" / "algorithms").glob("*.py"),
                                          *(REPO / "tests" / "extending").glob("*.py")]}  # fmt: skip
    guide = (REPO / "docs" / "extending.md").read_text()
    for i, block in enumerate(re.findall(r"```python\n(.*?)```", guide, flags=re.S)):
        sources[Path(f"docs/extending.md block {i}")] = block
    outside = {str(p): sorted(state_members_used(src) - MEMBERS) for p, src in sources.items()}
    assert not {p: names for p, names in outside.items() if names}, "members outside ExchangeContext"
    assert state_members_used((REPO / "lightning_dgc" / "algorithms" / "powersgd.py").read_text()), "the scan finds uses"


def test_the_exchange_state_offers_every_member_of_the_context() -> None:
    for name in sorted(algorithms.registered()):
        config = algorithms.get(name).config_class()
        state = simulate(1, lambda collectives, config=config: ExchangeState(config, collectives=collectives))[0]
        assert isinstance(state, ExchangeContext), name
        assert isinstance(state.algorithm.state, ExchangeContext)
        missing = [m for m in MEMBERS if not hasattr(state, m)]
        assert not missing, (name, missing)
        assert isinstance(state.draw_generator(torch.device("cpu")), torch.Generator)
