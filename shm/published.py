"""A document one process publishes for many readers, without a lock (a seqlock).

The writer makes the generation odd, writes, then makes it even; a reader copies the bytes between
two reads of the generation and retries if it changed or was odd. Readers that only need to know
whether anything changed compare one 8-byte generation.
"""
from __future__ import annotations

import struct
import time


_LEN = struct.Struct("<Q")
HEADER = 16


class Published:
    def __init__(self, buf: memoryview, offset: int, size: int) -> None:
        self._buf = buf
        self._gen = buf[offset:offset + 8].cast("Q")  # read per request by clients: cheaper than numpy
        self._off = offset
        self._size = size

    def publish(self, data: bytes) -> None:
        if HEADER + len(data) > self._size:
            raise ValueError(f"published document of {len(data)} bytes exceeds its {self._size}-byte area")
        g = int(self._gen[0])
        self._gen[0] = g + 1
        _LEN.pack_into(self._buf, self._off + 8, len(data))
        self._buf[self._off + HEADER:self._off + HEADER + len(data)] = data
        self._gen[0] = g + 2

    def generation(self) -> int:
        return self._gen[0]

    def read(self, attempts: int = 0) -> tuple[int, bytes]:
        """(generation, document); with ``attempts``, (-1, b"") after that many tries found a
        write in progress (a writer that died mid-write must not hang its reader)."""
        tries = 0
        while True:
            g1 = int(self._gen[0])
            if g1 & 1:
                tries += 1
                if attempts and tries >= attempts:
                    return -1, b""
                time.sleep(0)
                continue
            (n,) = _LEN.unpack_from(self._buf, self._off + 8)
            data = bytes(self._buf[self._off + HEADER:self._off + HEADER + min(n, self._size - HEADER)])
            if int(self._gen[0]) == g1:
                return g1, data
