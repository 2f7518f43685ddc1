"""Keep large buffers in the process heap between requests (glibc only).

By default glibc serves allocations above 128 KiB (raised as it sees them freed, up to 32 MiB)
with fresh ``mmap`` calls and gives heap tops above the trim threshold back to the kernel, so a
process that builds one large body per request (the HTTP frontend joining a 16 MiB request body,
the response written out of it) faults every page of it in again each time: on this kind of VM
that was 24 ms of system time per 16 MiB request, more than the bytes' own copies. Raising the
thresholds once keeps that memory mapped and reused; the price is that the heap keeps its high
water mark (bounded by the largest request the frontend accepts).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("shmserve.heap")

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for this setting on 64-bit
TRIM_THRESHOLD = 256 << 20
TOP_PAD = 16 << 20


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def give_back_free_memory() -> None:
    """Return the heap's free pages to the kernel now (``malloc_trim``): after a large private
    copy was dropped (weights moved to shared memory), which the thresholds above would keep."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is not None:
        trim(0)


def keep_large_buffers() -> bool:
    """Apply the settings; False where the C library is not glibc (nothing to tune, no harm)."""
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False
    ok = all(mallopt(param, value) == 1 for param, value in
             ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    if not ok:
        log.debug("mallopt refused a setting; large buffers may be mapped anew per request")
    return ok
