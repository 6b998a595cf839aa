"""Host memory the exchange frees goes back to the operating system (glibc's heap keeps freed pages)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest
import torch

from lightning_dgc import algorithms
from lightning_dgc.exchange import hook
from lightning_dgc.exchange.state import ExchangeState
from lightning_dgc.tensor_ops import heap
from lightning_dgc.tensor_ops.heap import return_free_host_memory
from lightning_dgc.tensor_ops.memory import ResidualMemory


def _resident_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim: Linux only")
def test_freed_heap_pages_go_back_to_the_system() -> None:
    """Blocks below the mmap threshold come from the heap; once freed behind a live block, glibc keeps
    their pages resident until they are handed back."""
    if not return_free_host_memory():
        pytest.skip("no glibc malloc_trim (musl?)")
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
    size, count = 100_000, 400  # 40 MB in blocks under glibc's smallest mmap threshold (128 KiB)
    blocks = [libc.malloc(size) for _ in range(count)]
    assert all(blocks)
    for block in blocks:
        ctypes.memset(block, 1, size)
    try:
        for block in blocks[:-1]:  # the last block stays: the freed ones are not at the heap's top
            libc.free(block)
        kept = _resident_bytes()
        assert return_free_host_memory()
        assert kept - _resident_bytes() >= 0.75 * size * (count - 1)
    finally:
        libc.free(blocks[-1])


def test_memory_knows_whether_it_lives_on_the_host() -> None:
    elsewhere = ResidualMemory()
    elsewhere.buffer("velocity", "w", 4, torch.device("meta"))
    assert not elsewhere.on_host
    memory = ResidualMemory()
    memory.buffer("velocity", "w", 4, torch.device("cpu"))
    assert memory.on_host
    restored = ResidualMemory()
    restored.load_state_dict(memory.state_dict())
    assert restored.on_host


def _updates(
    monkeypatch: pytest.MonkeyPatch, trim_before_bytes: float, growth_bytes: float = 0
) -> tuple[torch.Tensor, int]:
    """Three steps of DGC (momentum, CPU tensor-by-tensor selection); the updates and how often the heap
    was trimmed (before a compressed tensor's v' was made, and at the end of a step: every step with the
    growth bound at 0)."""
    calls = []
    monkeypatch.setattr(heap, "TRIM_BEFORE_BYTES", trim_before_bytes)
    monkeypatch.setattr(heap, "TRIM_AFTER_STEP_GROWTH_BYTES", growth_bytes)
    monkeypatch.setattr(heap, "return_free_host_memory", lambda: calls.append(1) or True)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(256, 64)) for _ in range(4)]
    state = ExchangeState(algorithms.get("dgc").config_class(density=0.01, momentum=0.9))
    state.register_parameters([(f"p{i}", p) for i, p in enumerate(params)])
    for p in params:
        p.grad = torch.zeros_like(p)
    numel = sum(p.numel() for p in params)
    generator = torch.Generator().manual_seed(1)
    updates = []
    for _ in range(3):
        updates.append(hook.exchange(state, params, torch.randn(numel, generator=generator)).wait().clone())
        state.finish_step()
    return torch.stack(updates), len(calls)


def test_dgc_trims_the_heap_before_a_large_temporary_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A v' of at least TRIM_BEFORE_BYTES (every one here, with the bound at 0) is preceded by a trim,
    smaller ones are not; every step ends with one; the updates are the same bits either way."""
    trimmed, calls = _updates(monkeypatch, 0)
    assert calls == 3 * 4 + 3
    plain, calls = _updates(monkeypatch, 256 * 64 * 4 + 1)
    assert calls == 3
    assert torch.equal(trimmed, plain)
    kept, calls = _updates(monkeypatch, float("inf"), float("inf"))  # never: the same bits again
    assert calls == 0
    assert torch.equal(kept, plain)


@pytest.mark.parametrize(
    ("free", "after_last", "growth", "trim"),
    [
        (100 << 20, None, 16 << 20, True),  # the first step: everything free is growth
        (10 << 20, None, 16 << 20, False),  # ... unless it is under the bound
        (120 << 20, 110 << 20, 16 << 20, False),  # the pages a step takes again every step: kept
        (126 << 20, 110 << 20, 16 << 20, True),  # grown by the bound: handed back
        (50 << 20, 110 << 20, 16 << 20, False),  # fewer free bytes than at the last trim
        (0, 110 << 20, 0, True),  # bound 0: every step
        (1 << 40, None, float("inf"), False),  # bound inf: never
        (None, None, 16 << 20, True),  # free bytes unknown (no mallinfo2): every step, as without a bound
        (None, None, float("inf"), False),
    ],
)
def test_the_end_of_a_step_trims_when_the_free_heap_grew_by_the_bound(
    free: int | None, after_last: int | None, growth: float, trim: bool
) -> None:
    assert heap.should_trim_after_step(free, after_last, growth) is trim


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2 and malloc_trim: Linux only")
def test_freed_blocks_are_handed_back_once_then_kept_while_the_free_heap_does_not_grow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Freed heap blocks raise the free bytes mallinfo2 reports; the first end-of-step trim after that hands
    their pages back, and the next ones do nothing until the free bytes grow by the bound again."""
    if heap.free_heap_bytes() is None or not return_free_host_memory():
        pytest.skip("no glibc mallinfo2 (2.33+) or malloc_trim")
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
    size, count = 100_000, 400  # 40 MB in blocks under glibc's smallest mmap threshold (128 KiB)
    monkeypatch.setattr(heap, "TRIM_AFTER_STEP_GROWTH_BYTES", 16 << 20)
    blocks = [libc.malloc(size) for _ in range(count)]
    assert all(blocks)
    for block in blocks:
        ctypes.memset(block, 1, size)
    try:
        # the heap as a trim left it, once the blocks are taken: they may have come from free bytes an earlier
        # test left, so a baseline read before them could lie above what their freeing then shows
        monkeypatch.setattr(heap, "_free_at_last_trim", heap.free_heap_bytes())
        assert not heap.trim_after_step()  # nothing grew
        before = heap.free_heap_bytes()
        for block in blocks[:-1]:  # the last block stays: the freed ones are not at the heap's top
            libc.free(block)
        assert heap.free_heap_bytes() - before >= 0.9 * size * (count - 1)
        kept, trims = _resident_bytes(), heap.trims_after_step
        assert heap.trim_after_step()
        assert heap.trims_after_step == trims + 1
        assert kept - _resident_bytes() >= 0.75 * size * (count - 1)
        assert not heap.trim_after_step()  # the same free bytes: nothing to hand back
    finally:
        libc.free(blocks[-1])


#: Steps whose temporaries sit at the top of the heap, in a fresh process (in a long-lived one, free bytes that
#: earlier work left could serve them from the middle of the heap): prints, per step, whether it was trimmed.
_TOP_OF_HEAP_STEPS = """
import ctypes, json
from lightning_dgc.tensor_ops import heap
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD, as heap.tune_for_steps sets it: free() leaves the top alone
heap.TRIM_AFTER_STEP_GROWTH_BYTES = 16 << 20
size, count = 100_000, 400  # 40 MB in blocks under glibc's smallest mmap threshold (128 KiB)
heap._free_at_last_trim = heap.free_heap_bytes()
steps = []
for _ in range(4):
    blocks = [libc.malloc(size) for _ in range(count)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    for block in reversed(blocks):
        libc.free(block)
    freed = heap.free_heap_bytes()
    steps.append({"free": freed, "trimmed": heap.trim_after_step(), "after": heap.free_heap_bytes()})
print(json.dumps(steps))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2 and malloc_trim: Linux only")
def test_a_step_that_frees_the_heaps_top_is_trimmed_once_not_at_every_step() -> None:
    """A step whose temporaries sit at the top of the heap: the first trim returns the top to the system, which
    takes it off the free bytes; the next steps take the same pages again and free them, back to the free bytes
    the trim saw, and keep them (trimming them at every step would make every step fault its memory in again)."""
    if heap.free_heap_bytes() is None or not return_free_host_memory():
        pytest.skip("no glibc mallinfo2 (2.33+) or malloc_trim")
    done = subprocess.run([sys.executable, "-c", _TOP_OF_HEAP_STEPS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    steps = json.loads(done.stdout)
    assert steps[0]["after"] < steps[0]["free"] - (16 << 20), f"the blocks were not at the heap's top: {steps}"
    assert [s["trimmed"] for s in steps] == [True, False, False, False], steps


def test_a_bucket_layout_gone_from_a_step_takes_its_plan_with_it() -> None:
    """DDP's first bucket (the whole model) is rebuilt after one step: its plan, with its payload buffers, is
    dropped once a step has run on the new buckets, whose plans are kept and reused."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(256, 64)) for _ in range(2)]
    state = ExchangeState(algorithms.get("dgc").config_class(density=0.01, momentum=0.9))
    state.register_parameters([(f"p{i}", p) for i, p in enumerate(params)])
    for p in params:
        p.grad = torch.zeros_like(p)
    n = params[0].numel()
    hook.exchange(state, params, torch.randn(2 * n)).wait()
    state.finish_step()
    (whole,) = state.plans
    kept = None
    for _ in range(2):
        hook.exchange(state, [params[0]], torch.randn(n)).wait()
        hook.exchange(state, [params[1]], torch.randn(n)).wait()
        state.finish_step()
        assert len(state.plans) == 2 and all(plan is not whole for plan in state.plans)
        assert kept is None or [id(p) for p in state.plans] == [id(p) for p in kept]
        kept = state.plans


_MMAPPED_AFTER_TUNING = """
import ctypes, os, sys
from lightning_dgc.tensor_ops import heap
heap.TUNE_MALLOC = sys.argv[1] == "on"
heap.free_heap_bytes()  # loads mallinfo2
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
tuned = heap.tune_for_steps()
before = heap._mallinfo2().hblkhd
block = libc.malloc(8 << 20)  # over glibc's first mmap threshold (128 KiB), under the tuned one (32 MiB)
print(tuned, heap._mallinfo2().hblkhd - before, heap.tune_for_steps())
libc.free(block)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and mallinfo2: Linux only")
@pytest.mark.parametrize(
    "switch,environment,tuned", [("on", {}, True), ("off", {}, False), ("on", {"MALLOC_MMAP_THRESHOLD_": "131072"}, False)]
)
def test_glibc_thresholds_are_fixed_once_unless_turned_off_or_set_by_the_user(
    switch: str, environment: dict[str, str], tuned: bool
) -> None:
    """Tuned, an 8 MB block comes from the heap, not from its own mmap, as a block of that size does once glibc's
    dynamic threshold has risen (after the first step): the next steps reuse the heap's pages, not fault them in
    again. A second call does nothing; ``TUNE_MALLOC = False`` or a threshold in the environment leaves glibc's."""
    import subprocess

    if heap.free_heap_bytes() is None or not heap._libc("mallopt"):
        pytest.skip("no glibc mallinfo2 (2.33+) or mallopt")
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    done = subprocess.run([sys.executable, "-c", _MMAPPED_AFTER_TUNING, switch], env={**env, **environment},
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    said, mmapped, again = done.stdout.split()
    assert (said, again) == (str(tuned), "False")
    assert (int(mmapped) == 0) is tuned, done.stdout  # untuned: the block is its own mapping
