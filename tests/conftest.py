"""Shared fixtures: keep Lightning's environment variables from leaking between multi-process tests; run the slow
tests first."""

from __future__ import annotations

import os
import socket

import pytest

_DIST_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "LOCAL_WORLD_SIZE",
)

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _clean_distributed_env(monkeypatch: pytest.MonkeyPatch):
    """Lightning writes MASTER_PORT & co. into os.environ; every test starts without them."""
    for var in _DIST_VARS:
        monkeypatch.delenv(var, raising=False)
    yield
    for var in _DIST_VARS:
        os.environ.pop(var, None)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the ``slow`` tests first (a stable sort: each group keeps its order): under ``-n auto`` the workers
    then share out the long multi-process tests at the start, and the run does not end on one worker finishing
    a long test alone while the other waits."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
