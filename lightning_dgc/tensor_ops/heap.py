"""The C heap's free pages, handed back to the operating system (glibc's ``malloc_trim``).

The exchange's per-step host temporaries (index and value arrays of a few MB) raise glibc's dynamic mmap
threshold once they are freed, after which such arrays come from the heap, whose freed pages glibc keeps.
:func:`return_free_host_memory` returns them. Two moments call it:

* :func:`trim_before`, before a temporary too large for the heap's free pages to serve (it would add to
  them, raising the peak);
* :func:`trim_after_step`, at the end of a step whose memory is on the host, but only when the heap's free
  bytes grew by :data:`TRIM_AFTER_STEP_GROWTH_BYTES` since the last time it handed them back
  (:func:`should_trim_after_step`). Pages a step frees and the next step takes again (the forward pass's
  activations, the exchange's temporaries) are not handed back every step: faulting them in again would
  cost the next step more than the exchange itself (15% of the CPU time of a ResNet-20 step of the CPU
  recipe, ``python -m benchmarks.overhead --recipe``). What the heap keeps
  free then is what the step's own peak held, never more than :data:`TRIM_AFTER_STEP_GROWTH_BYTES` above
  it; growth past that (a step that frees more than the steps before it) goes back at once.

Left to itself, glibc hands pages back on its own too: its mmap threshold and its trim threshold (twice the
former) move with what was freed, and a free that leaves more than the trim threshold at the top of the heap
returns it, which the next step faults in again (under DGC at density 1 on the CPU recipe, twice the page faults
of DDP's run and measurably longer steps). :func:`tune_for_steps` fixes both thresholds once per process, at the
end of the first step whose memory is on the host, so that this module alone decides.
"""

from __future__ import annotations

import os
import sys
from typing import Any

#: A host temporary this large or larger is always a fresh ``mmap`` under glibc (32 MiB is as high as its
#: dynamic mmap threshold goes), so the heap's free pages cannot serve it: they are handed back first
#: (:func:`trim_before`) where the exchange is about to make one (DGC's v' of a compressed tensor on the
#: CPU). Read at every call: set it to ``float("inf")`` to trade that memory for the time it costs
#: (measured: 4-5% of a CPU exchange of three 11M-value tensors, the pages handed back being faulted in
#: again by the next temporaries).
TRIM_BEFORE_BYTES: float = 32 << 20

#: The end of a step hands the heap's free pages back when its free bytes (glibc's ``mallinfo2``, every
#: arena) exceed what they were when it last did by this much (:func:`should_trim_after_step`).
#: Read at every call: ``0`` hands them back after every step (the resident size at the end of a step is
#: then what the rank holds, at the cost of faulting the pages in again in the next step);
#: ``float("inf")`` never at the end of a step.
TRIM_AFTER_STEP_GROWTH_BYTES: float = 16 << 20

#: Whether :func:`tune_for_steps` fixes glibc's thresholds (``False``: glibc's own dynamic ones stay). It leaves
#: them alone where the environment sets them (``GLIBC_TUNABLES``, ``MALLOC_MMAP_THRESHOLD_``,
#: ``MALLOC_TRIM_THRESHOLD_``). They apply to the whole process.
TUNE_MALLOC: bool = True
#: The thresholds it sets: allocations from 32 MiB up (the highest glibc's dynamic threshold reaches) are their
#: own ``mmap``; the top of the heap goes back by itself only past 256 MiB.
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_tuned = False  # whether this process decided already (tuned, or left alone)

_malloc_trim: Any = None  # glibc's malloc_trim, looked up on first use; False where there is none
_mallinfo2: Any = None  # glibc's mallinfo2 (2.33+), likewise
#: The heap's free bytes when the last end-of-step trim ran, read before it (``None``: none yet in this process).
_free_at_last_trim: int | None = None
#: How many times this process handed the heap's free pages back at the end of a step (for benchmarks).
trims_after_step = 0


def _libc(name: str) -> Any:
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return False


def return_free_host_memory() -> bool:
    """Hand the C heap's free pages back to the operating system (glibc's ``malloc_trim(0)``).

    The exchange's per-step host temporaries (index and value arrays of a few MB) raise glibc's dynamic
    mmap threshold once they are freed, after which such arrays come from the heap, whose freed pages
    glibc keeps (tens of MB per process for a model of 34M parameters; more in the threads that run
    collectives). Those pages are free, not live: this returns them, so that a rank's resident size is
    what it holds. Returns False (and does nothing) where there is no glibc (macOS, Windows, musl).
    """
    global _malloc_trim
    if _malloc_trim is None:
        _malloc_trim = _libc("malloc_trim")
        if _malloc_trim:
            import ctypes

            _malloc_trim.argtypes, _malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    if not _malloc_trim:
        return False
    _malloc_trim(0)
    return True


def free_heap_bytes() -> int | None:
    """The C heap's free bytes, every arena (glibc's ``mallinfo2().fordblks``); ``None`` without glibc 2.33+.

    Pages handed back by ``malloc_trim`` stay counted (their chunks are still free, only not resident), so a
    rise of this figure is memory the heap took from the system since; the heap's top is the exception: a trim
    returns it to the system and takes it off the count.
    """
    global _mallinfo2
    if _mallinfo2 is None:
        _mallinfo2 = _libc("mallinfo2")
        if _mallinfo2:
            import ctypes

            class MallInfo2(ctypes.Structure):
                _fields_ = [(name, ctypes.c_size_t) for name in (
                    "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                    "fordblks", "keepcost")]  # fmt: skip

            _mallinfo2.argtypes, _mallinfo2.restype = [], MallInfo2
    if not _mallinfo2:
        return None
    return int(_mallinfo2().fordblks)


def should_trim_after_step(free_bytes: int | None, free_at_last_trim: int | None, growth_bytes: float) -> bool:
    """Whether the end of a step hands the heap's free pages back (see :func:`trim_after_step`).

    Args:
        free_bytes: the heap's free bytes now (:func:`free_heap_bytes`); ``None`` where they cannot be read:
            then every step hands them back.
        free_at_last_trim: the heap's free bytes when the last trim ran (read before it); ``None`` before the
            first.
        growth_bytes: how far ``free_bytes`` may exceed ``free_at_last_trim`` before the pages go back
            (``0``: every step; ``inf``: never).
    """
    if growth_bytes == float("inf"):
        return False
    if free_bytes is None or growth_bytes <= 0:
        return True
    return free_bytes - (free_at_last_trim or 0) >= growth_bytes


def trim_after_step() -> bool:
    """At the end of a step whose memory is on the host: hand the heap's free pages back if they grew by
    :data:`TRIM_AFTER_STEP_GROWTH_BYTES` since the last time (:func:`should_trim_after_step`). Returns
    whether it did."""
    global _free_at_last_trim, trims_after_step
    growth = TRIM_AFTER_STEP_GROWTH_BYTES
    free = free_heap_bytes() if 0 < growth < float("inf") else None
    if not should_trim_after_step(free, _free_at_last_trim, growth):
        return False
    if not return_free_host_memory():
        return False
    trims_after_step += 1
    if free is not None:
        # the free bytes before this trim, not after: a trim that shrinks the heap's top takes those bytes off
        # the count, and the next step, taking the same pages again and freeing them, would look like growth
        # and be trimmed again, every step
        _free_at_last_trim = free
    return True


def tune_for_steps() -> bool:
    """Fix glibc's mmap and trim thresholds (:data:`MMAP_THRESHOLD_BYTES`, :data:`TRIM_THRESHOLD_BYTES`), once per
    process, unless :data:`TUNE_MALLOC` is false or the environment sets them. Returns whether it set them now."""
    global _tuned
    if _tuned:
        return False
    _tuned = True
    if not TUNE_MALLOC or any(
        v in os.environ for v in ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    ):
        return False
    mallopt = _libc("mallopt")
    if not mallopt:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


def trim_before(nbytes: int) -> None:
    """Hand the heap's free pages back (:func:`return_free_host_memory`) before a host temporary of ``nbytes``
    is made, if it is at least :data:`TRIM_BEFORE_BYTES`: then the temporary adds to what is free, not to
    free pages kept beside it."""
    if nbytes >= TRIM_BEFORE_BYTES:
        return_free_host_memory()
