"""Single-producer single-consumer ring of fixed-size records in shared memory.

The producer writes the record, then publishes the new tail; the consumer reads up to the tail it
sees, then publishes the new head. Each side writes only its own counter, so no lock is needed.
The wake-up is a separate semaphore post, done by the caller (one post per hop).

The counters are read and written through an aligned memoryview cast to 'Q': one 8-byte load or
store each (CPython packs a 'Q' item with a single fixed-size copy), and about three times cheaper
than a numpy scalar. ``struct.pack_into`` writes integers byte by byte, and a reader on another
core could then see a torn counter (a tail that jumps back) and lose records.
"""
from __future__ import annotations

import struct

HEADER_BYTES = 64


class Ring:
    def __init__(self, buf: memoryview, offset: int, capacity: int, record: struct.Struct) -> None:
        self._buf = buf
        self._off = offset
        self._cap = capacity
        self._rec = record
        self._data = offset + HEADER_BYTES
        self._ctr = buf[offset:offset + 16].cast("Q")  # head, tail

    @staticmethod
    def nbytes(capacity: int, record: struct.Struct) -> int:
        return HEADER_BYTES + capacity * record.size

    def reset(self) -> None:
        self._ctr[0] = self._ctr[1] = 0

    def put(self, *fields: int | bytes) -> bool:
        """Append one record; False when the ring is full (the caller decides how to back off)."""
        ctr = self._ctr
        tail = ctr[1]
        if tail - ctr[0] >= self._cap:
            return False
        self._rec.pack_into(self._buf, self._data + (tail % self._cap) * self._rec.size, *fields)
        ctr[1] = tail + 1  # one aligned 8-byte store (memoryview packs a 'Q' with a single copy)
        return True

    def drain(self) -> list[tuple]:
        ctr = self._ctr
        head, tail = ctr[0], ctr[1]
        if head == tail:
            return []
        rec, cap, data, size = self._rec, self._cap, self._data, self._rec.size
        out = [rec.unpack_from(self._buf, data + (i % cap) * size) for i in range(head, tail)]
        ctr[0] = tail
        return out

    def pending(self) -> int:
        seen = self._ctr
        return seen[1] - seen[0]
