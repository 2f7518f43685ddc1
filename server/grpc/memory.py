"""The gRPC frontend gives the memory of large messages back to the kernel once they are freed.

grpc reads a message into many small buffers across its threads' malloc arenas before the
frontend sees it, and glibc keeps such freed memory in the process (more so with heap.py's
thresholds, kept so that one large message's memory serves the next): six 300 MB messages,
refused or served, used to leave gigabytes resident. ``HeapWatch.check``, on the frontend's
tick, measures what glibc keeps without handing out (private resident memory less the bytes
malloc has allocated) and trims the heap (``malloc_trim``, in a thread: it releases the GIL)
when that has grown by ``SLACK_BYTES`` since the last trim. Memory that calls in flight use is
not counted, so a large call in progress neither triggers trims nor hides its memory from the
trim after it ends.

``malloc_trim`` gives back free pages inside each arena but not the top of the arenas of grpc's
threads, which glibc shrinks by itself only past its trim threshold: so the gRPC frontend leaves
glibc's own thresholds alone rather than raise them as heap.py's ``keep_large_buffers`` does for
the HTTP frontend (with them, each of those arenas kept up to 256 MiB).
"""
from __future__ import annotations

import asyncio
import ctypes
import os
from typing import Any

from shmserve.shm import heap

SLACK_BYTES = 64 << 20  # more than small calls leave behind; less than one large message
PAGE = os.sysconf("SC_PAGE_SIZE")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2() -> Any:
    try:
        function = ctypes.CDLL(None).mallinfo2  # glibc 2.33 and later
    except (OSError, AttributeError):
        return None
    function.restype = _Mallinfo2
    function.argtypes = []
    return function


MALLINFO2 = _mallinfo2()


def private_resident_bytes() -> int:
    """Resident memory that is neither a file's nor shared memory (the arenas' pages are shared)."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * PAGE


def kept_bytes() -> int | None:
    """Private resident memory not allocated through malloc: memory glibc keeps after it was
    freed, plus what is not malloc's (code, stacks, Python's small-object arenas), which varies
    little. None where the C library has no ``mallinfo2``."""
    if MALLINFO2 is None:
        return None
    info = MALLINFO2()
    return private_resident_bytes() - (info.uordblks + info.hblkhd)


class HeapWatch:
    def __init__(self, slack: int = SLACK_BYTES) -> None:
        self.slack = slack
        self.floor = kept_bytes()

    async def check(self) -> None:
        """Trim when glibc keeps ``slack`` more than after the last trim."""
        kept = kept_bytes()
        if kept is None or self.floor is None or kept < self.floor + self.slack:
            return
        await asyncio.get_running_loop().run_in_executor(None, heap.give_back_free_memory)
        self.floor = kept_bytes()  # what a trim cannot give back (fragments) does not trigger the next
