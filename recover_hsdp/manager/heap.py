"""The C heap's free pages handed back to the system after a change of membership.

[Note: the heap after a repair] glibc's malloc serves a request above its mmap threshold with
its own mapping and, when such a block is freed, raises the threshold to that block's size (up
to 32 MiB): from then on blocks of that size come from the heap arenas, and what they free stays
there, interleaved with live blocks, counted in the process's resident memory. A repair, a
join and a state transfer allocate such blocks in new sizes and orders (buckets restored and
reduced again, the newcomer's state sent in pieces, new communicators): measured on the 300-step
soak (4 x 1, a failure every 10 steps, 21 replacements joined), the spawner's resident memory
grew from 887 to 1092 MiB, ~10 MiB per failure or join, while a failure-free run stayed flat;
with the threshold pinned (``MALLOC_MMAP_THRESHOLD_``) the same failures left it flat, so the
memory was free, not leaked, but pinning made every step ~30% slower on CPU. So after each
change of membership the manager calls ``malloc_trim(0)`` once, between steps: it gives every
free page of every arena back (``madvise``), costs milliseconds, and nothing when nothing failed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time

_trim = None


def _malloc_trim():
    global _trim
    if _trim is None:
        try:
            _trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
            _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to do
            _trim = False
    return _trim


def release_free_heap() -> float | None:
    """``malloc_trim(0)``; the seconds it took, or None where the C library has none."""
    trim = _malloc_trim()
    if not trim:
        return None
    started = time.perf_counter()
    trim(0)
    return time.perf_counter() - started
