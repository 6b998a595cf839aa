"""Checkpoint files on disk: what a writer killed mid-save leaves behind, and a damaged file on resume."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_dgc.checkpoint.files import read_checkpoint, save_atomically

# A process that starts saving a checkpoint with save_atomically and never finishes (its pickling blocks).
_WRITER = """
import sys, time
import torch
from lightning_dgc.checkpoint.files import save_atomically

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


def _truncated(tmp_path: Path) -> Path:
    whole, cut = tmp_path / "whole.ckpt", tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(10_000)}, "global_step": 4}, whole)
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    return cut


def test_a_truncated_checkpoint_is_an_error_naming_the_file_and_the_fix_in_both_strategies(tmp_path) -> None:
    from lightning_dgc import DGCStrategy
    from lightning_dgc.front.fabric import FabricCompressionStrategy

    cut = _truncated(tmp_path)
    for strategy in (DGCStrategy(), FabricCompressionStrategy("dgc")):
        with pytest.raises(RuntimeError, match=rf"The checkpoint '{re.escape(str(cut))}' is incomplete or damaged") as e:
            strategy.load_checkpoint(cut)
        assert "Resume from an earlier checkpoint" in str(e.value) and "or delete this file" in str(e.value)


def test_a_whole_checkpoint_that_fails_to_load_for_another_reason_keeps_its_own_error(tmp_path) -> None:
    whole = tmp_path / "whole.ckpt"
    torch.save({"w": torch.zeros(3)}, whole)

    def fails() -> dict:
        raise RuntimeError("Error(s) in loading state_dict")

    with pytest.raises(RuntimeError, match=r"^Error\(s\) in loading state_dict$"):
        read_checkpoint(fails, whole)
    with pytest.raises(FileNotFoundError):
        read_checkpoint(lambda: torch.load(tmp_path / "none.ckpt"), tmp_path / "none.ckpt")
