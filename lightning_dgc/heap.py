"""The C heap's free pages, handed back to the operating system (glibc's ``malloc_trim``).

The exchange's per-step host temporaries (index and value arrays of a few MB) raise glibc's dynamic mmap
threshold once they are freed, after which such arrays come from the heap, whose freed pages glibc keeps.
:func:`return_free_host_memory` returns them, so that a rank's resident size is what it holds;
:func:`trim_before` does it before a temporary too large for the heap's free pages to serve.
"""

from __future__ import annotations

import sys
from typing import Any

#: A host temporary this large or larger is always a fresh ``mmap`` under glibc (32 MiB is as high as its
#: dynamic mmap threshold goes), so the heap's free pages cannot serve it: they are handed back first
#: (:func:`trim_before`) where the exchange is about to make one (DGC's v' of a compressed tensor on the
#: CPU). Read at every call: set it to ``float("inf")`` to trade that memory for the time it costs
#: (measured: 4-5% of a CPU exchange of three 11M-value tensors, the pages handed back being faulted in
#: again by the next temporaries).
TRIM_BEFORE_BYTES: float = 32 << 20

_malloc_trim: Any = None  # glibc's malloc_trim, looked up on first use; False where there is none


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
        _malloc_trim = False
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                _malloc_trim = ctypes.CDLL(None).malloc_trim
                _malloc_trim.argtypes, _malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
            except (OSError, AttributeError):
                _malloc_trim = False
    if not _malloc_trim:
        return False
    _malloc_trim(0)
    return True


def trim_before(nbytes: int) -> None:
    """Hand the heap's free pages back (:func:`return_free_host_memory`) before a host temporary of ``nbytes``
    is made, if it is at least :data:`TRIM_BEFORE_BYTES`: then the temporary adds to what is free, not to
    free pages kept beside it."""
    if nbytes >= TRIM_BEFORE_BYTES:
        return_free_host_memory()
