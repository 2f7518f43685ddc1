"""Single-producer single-consumer ring of fixed-size records in shared memory.

The producer writes the record, then publishes the new tail; the consumer reads up to the tail it
sees, then publishes the new head. Each side writes only its own counter, so no lock is needed.
The wake-up is a separate futex wake on the receiver's flag, done by the caller (waker.py).

The counters are read and written through an aligned memoryview cast to 'Q': one 8-byte load or
store each (CPython packs a 'Q' item with a single fixed-size copy), and about three times cheaper
than a numpy scalar. ``struct.pack_into`` zeroes a word before it writes it (words.py), and a
reader on another core could then see a counter that jumps back and lose records.

A ring between processes of different trust (a client's request ring, its lanes, the connect
ring) holds counters the other side may scribble on: ``drain`` refuses a distance between them
outside ``[0, capacity]`` (``RingCorrupt``), so a reader never does more than one ring's worth of
work, and ``resync`` lets the consumer skip what it cannot trust.
"""
from __future__ import annotations

import struct

HEADER_BYTES = 64


class RingCorrupt(Exception):
    """The ring's counters say it holds a negative number of records, or more than fit: its
    producer wrote garbage into them. Nothing was read or consumed."""

    def __init__(self, head: int, tail: int, capacity: int) -> None:
        super().__init__(f"ring counters corrupt: head {head}, tail {tail} (capacity {capacity})")
        self.head = head
        self.tail = tail


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

    def has_room(self) -> bool:
        """Whether a ``put`` would succeed now (for the producer: only the consumer moves the
        counters meanwhile, and only to make room)."""
        ctr = self._ctr
        return 0 <= ctr[1] - ctr[0] < self._cap

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
        """Every record published so far, consumed. Raises RingCorrupt (consuming nothing) when the
        counters are impossible, rather than read far more records than the ring holds."""
        ctr = self._ctr
        head, tail = ctr[0], ctr[1]
        if head == tail:
            return []
        if not 0 < tail - head <= self._cap:
            raise RingCorrupt(head, tail, self._cap)
        rec, cap, data, size = self._rec, self._cap, self._data, self._rec.size
        out = [rec.unpack_from(self._buf, data + (i % cap) * size) for i in range(head, tail)]
        ctr[0] = tail
        return out

    def take(self) -> tuple | None:
        """The oldest record, consumed; None when there is none. A reader that takes records one
        at a time can leave the rest where they are, so a producer that finds the ring full waits
        (backpressure). Raises RingCorrupt as ``drain``."""
        ctr = self._ctr
        head, tail = ctr[0], ctr[1]
        if head == tail:
            return None
        if not 0 < tail - head <= self._cap:
            raise RingCorrupt(head, tail, self._cap)
        out = self._rec.unpack_from(self._buf, self._data + (head % self._cap) * self._rec.size)
        ctr[0] = head + 1
        return out

    def resync(self) -> int:
        """Consumer side, after RingCorrupt: skip to the producer's tail (the only counter we may
        write is our own head); returns how many records that skipped, modulo 2**64."""
        ctr = self._ctr
        head, tail = ctr[0], ctr[1]
        ctr[0] = tail
        return (tail - head) % (1 << 64)

    def pending(self) -> int:
        seen = self._ctr
        return seen[1] - seen[0]
