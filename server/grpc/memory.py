"""The gRPC frontend gives the memory of large messages back to the kernel once they are freed.

grpc reads a message into many small buffers across its threads' malloc arenas before the
frontend sees it, and glibc keeps such freed memory in the process: six 300 MB messages,
refused or served, used to leave gigabytes resident. ``HeapWatch.check``, on the frontend's
tick, reads the process's private resident memory (one small /proc read) and, once it has grown
``SLACK_BYTES`` past where it was after the last trim, trims the heap (``malloc_trim``, in a
thread: it releases the GIL). Memory that calls in flight still use does not go; while it stays
above, the trim is tried again at doubling intervals (up to ``MAX_RETRY_S``), so memory freed
when a long call ends goes back too.

``malloc_trim`` gives back free pages inside each arena but not the top of the arenas of grpc's
threads, which glibc shrinks by itself only past its trim threshold: so the gRPC frontend leaves
glibc's own thresholds alone rather than raise them as heap.py's ``keep_large_buffers`` does for
the HTTP frontend (with them, each of those arenas kept up to 256 MiB).
"""
from __future__ import annotations

import asyncio
import os
import time

from shmserve.shm import heap

SLACK_BYTES = 64 << 20  # more than small calls leave behind; less than one large message
FIRST_RETRY_S = 0.5
MAX_RETRY_S = 30.0
PAGE = os.sysconf("SC_PAGE_SIZE")


def private_resident_bytes() -> int:
    """Resident memory that is neither a file's nor shared memory (the arenas' pages are shared)."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - int(fields[2])) * PAGE


class HeapWatch:
    def __init__(self, slack: int = SLACK_BYTES) -> None:
        self.slack = slack
        self.floor = private_resident_bytes()
        self.retry_s = FIRST_RETRY_S
        self.not_before = 0.0

    async def check(self) -> None:
        """Trim if the private memory lies ``slack`` over the floor; back off while it stays there."""
        now = time.monotonic()
        if now < self.not_before:
            return
        if private_resident_bytes() < self.floor + self.slack:
            self.retry_s = FIRST_RETRY_S
            return
        await asyncio.get_running_loop().run_in_executor(None, heap.give_back_free_memory)
        after = private_resident_bytes()
        if after < self.floor + self.slack:
            self.floor = min(self.floor, after)
            self.retry_s = FIRST_RETRY_S
        else:  # still in use (a call in flight), or grown for good (then a trim each MAX_RETRY_S)
            self.not_before = now + self.retry_s
            self.retry_s = min(self.retry_s * 2, MAX_RETRY_S)
