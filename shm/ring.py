"""Single-producer single-consumer ring of fixed-size records in shared memory.

The producer writes the record, then publishes the new tail; the consumer reads up to the tail it
sees, then publishes the new head. Each side writes only its own counter, so no lock is needed.
The wake-up is a separate semaphore post, done by the caller (one post per hop).
"""
from __future__ import annotations

import struct

_COUNTERS = struct.Struct("<QQ")  # head, tail
_HEAD = struct.Struct("<Q")
HEADER_BYTES = 64


class Ring:
    def __init__(self, buf: memoryview, offset: int, capacity: int, record: struct.Struct) -> None:
        self._buf = buf
        self._off = offset
        self._cap = capacity
        self._rec = record
        self._data = offset + HEADER_BYTES

    @staticmethod
    def nbytes(capacity: int, record: struct.Struct) -> int:
        return HEADER_BYTES + capacity * record.size

    def reset(self) -> None:
        _COUNTERS.pack_into(self._buf, self._off, 0, 0)

    def put(self, *fields: int) -> bool:
        """Append one record; False when the ring is full (the caller decides how to back off)."""
        head, tail = _COUNTERS.unpack_from(self._buf, self._off)
        if tail - head >= self._cap:
            return False
        self._rec.pack_into(self._buf, self._data + (tail % self._cap) * self._rec.size, *fields)
        _HEAD.pack_into(self._buf, self._off + 8, tail + 1)
        return True

    def drain(self) -> list[tuple]:
        head, tail = _COUNTERS.unpack_from(self._buf, self._off)
        if head == tail:
            return []
        rec, cap, data, size = self._rec, self._cap, self._data, self._rec.size
        out = [rec.unpack_from(self._buf, data + (i % cap) * size) for i in range(head, tail)]
        _HEAD.pack_into(self._buf, self._off, tail)
        return out

    def pending(self) -> int:
        head, tail = _COUNTERS.unpack_from(self._buf, self._off)
        return tail - head
