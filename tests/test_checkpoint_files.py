"""Checkpoint files on disk: what a writer killed mid-save leaves behind, and a damaged file on resume."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from lightning_dgc.checkpoint import save_atomically

# A process that starts saving a checkpoint with save_atomically and never finishes (its pickling blocks).
_WRITER = """
import sys, time
import torch
from lightning_dgc.checkpoint import save_atomically

class Blocks:
    def __reduce__(self):
        time.sleep(600)
        return (int, (0,))

save_atomically({"weights": torch.zeros(1000), "never": Blocks()}, sys.argv[1])
"""


def _wait_for(pattern: str, folder: Path, proc: subprocess.Popen, timeout: float = 120.0) -> list[Path]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(folder.glob(pattern))
        if found:
            return found
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    raise AssertionError(f"no {pattern} in {folder} after {timeout} s")


def test_a_save_removes_the_partial_file_of_a_writer_killed_mid_save_and_keeps_a_live_writers(tmp_path) -> None:
    target = tmp_path / "last.ckpt"
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(target)])
    try:
        (left,) = _wait_for(".last.ckpt.*.partial", tmp_path, writer)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    assert left.name == f".last.ckpt.{writer.pid}.partial" and left.exists() and not target.exists()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        busy = tmp_path / f".last.ckpt.{alive.pid}.partial"  # a writer still at work
        other = tmp_path / f".epoch=1.ckpt.{writer.pid}.partial"  # another checkpoint's
        busy.write_bytes(b"x")
        other.write_bytes(b"x")
        save_atomically({"step": 3}, target)
        assert not left.exists()
        assert busy.exists() and other.exists()
        assert torch.load(target, weights_only=True) == {"step": 3}
    finally:
        alive.kill()
        alive.wait()
