"""The authors' kit's replay (:func:`lightning_dgc.kit.check.check_algorithm`): the same run in another Python
interpreter, with another ``PYTHONHASHSEED``, started at the first request and reused; a rank's update must
not depend on the hash salt (set or dict order, ``hash()``)."""

from __future__ import annotations

import atexit
import os
import pickle
import struct
import subprocess
import sys
import threading
from typing import IO, Any

import torch
from torch import Tensor

from lightning_dgc.algorithms import AlgorithmConfig
from lightning_dgc.algorithms.base import algorithm_for
from lightning_dgc.kit.run import _run


def _send(stream: IO[bytes], obj: object) -> None:
    blob = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(blob)) + blob)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the replay process ended")
    return pickle.loads(stream.read(struct.unpack("<Q", head)[0]))


def _serve() -> None:
    """The replay process: runs :func:`_run` for every request on stdin, answers on stdout (prints go to stderr)."""
    import importlib
    import traceback

    requests, answers = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    while True:
        try:
            modules, threads, args = _receive(requests)
        except EOFError:
            return
        try:
            for module in modules:
                importlib.import_module(module)
            torch.set_num_threads(threads)
            steps, _, _ = _run(*args)
            _send(answers, ("ok", [[step.updates for step in rank] for rank in steps]))
        except BaseException:  # noqa: BLE001  (sent back and raised in the caller)
            _send(answers, ("error", traceback.format_exc()))


class _ReplayProcess:
    """One Python interpreter with another hash salt than this one, started at the first request and reused."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.process: subprocess.Popen[bytes] | None = None

    def run(self, modules: list[str], args: tuple[Any, ...]) -> Any:
        with self.lock:
            if self.process is None or self.process.poll() is not None:
                mine = os.environ.get("PYTHONHASHSEED", "random")
                other = str(int(mine) + 1) if mine.isdigit() else "1"  # a random salt is 1's with p = 2**-64
                path = os.pathsep.join([p or os.getcwd() for p in sys.path])
                self.process = subprocess.Popen(
                    [sys.executable, "-c", "from lightning_dgc.kit.replay import _serve; _serve()"],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    env=os.environ | {"PYTHONHASHSEED": other, "PYTHONPATH": path},
                )  # fmt: skip
                atexit.register(self.close)
            assert self.process.stdin is not None and self.process.stdout is not None
            _send(self.process.stdin, (modules, torch.get_num_threads(), args))
            return _receive(self.process.stdout)

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()  # type: ignore[union-attr]
            self.process.wait(timeout=30)


_REPLAY = _ReplayProcess()


def _replay_elsewhere(config: AlgorithmConfig, args: tuple[Any, ...]) -> list[list[dict[str, Tensor]]]:
    """The updates of ``_run(*args)`` computed in another process (another ``PYTHONHASHSEED``)."""
    fix = (
        " Define the configuration and the algorithm at the top level of an importable module, or pass"
        " separate_process=False (the ranks are then only compared within this process)."
    )
    cls = type(config)
    modules = list(dict.fromkeys([cls.__module__, algorithm_for(config).__module__]))
    if "__main__" in modules or "<locals>" in cls.__qualname__:
        raise ValueError(
            f"check_algorithm({cls.__name__}): another process cannot import {cls.__qualname__}.{fix}"
        )
    status, result = _REPLAY.run(modules, args)
    if status != "ok":
        raise ValueError(
            f"check_algorithm({cls.__name__}): the replay in another process failed:\n{result}{fix}"
        )
    return result
