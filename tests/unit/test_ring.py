"""The single-producer single-consumer ring over real shared memory: records come out in order
across wrap-around, a full ring refuses, and a consumer over a second mapping of the segment (as
another process has) sees exactly what the producer published."""
from __future__ import annotations

import struct

import pytest

from shmserve.shm.protocol import RECORD
from shmserve.shm.ring import HEADER_BYTES, Ring, RingCorrupt
from segments import segment_pair  # noqa: F401  (a fixture: real segments, mapped twice)

SMALL = struct.Struct("<IQ")


def test_nbytes_is_the_header_and_the_records():
    assert Ring.nbytes(4, RECORD) == HEADER_BYTES + 4 * RECORD.size


def test_records_come_out_in_order_and_a_full_ring_refuses(segment_pair):
    seg, _ = segment_pair(4096)
    ring = Ring(seg.buf, 0, 3, RECORD)
    assert ring.drain() == [] and ring.pending() == 0
    assert all(ring.put(1, i, 100 + i, 8, i) for i in range(3))
    assert ring.put(1, 9, 9, 9, 9) is False  # full: nothing written
    assert ring.pending() == 3
    assert ring.drain() == [(1, i, 100 + i, 8, i) for i in range(3)]
    assert ring.pending() == 0 and ring.drain() == []


def test_records_keep_their_order_across_many_wrap_arounds(segment_pair):
    seg, _ = segment_pair(4096)
    ring = Ring(seg.buf, 0, 5, SMALL)
    sent: list[tuple[int, int]] = []
    received: list[tuple[int, int]] = []
    n = 0
    for burst in [1, 5, 3, 4, 2, 5, 5, 1] * 25:  # bursts of every size, each start position in the ring
        for _ in range(burst):
            assert ring.put(n % 7, n * 1_000_003)
            sent.append((n % 7, n * 1_000_003))
            n += 1
        received += ring.drain()
    assert received == sent and n > 100 * 5


def test_a_consumer_over_a_second_mapping_sees_what_the_producer_published(segment_pair):
    created, attached = segment_pair(8192)
    offset = 1024  # rings live inside larger segments
    producer = Ring(created.buf, offset, 4, RECORD)
    producer.reset()
    consumer = Ring(attached.buf, offset, 4, RECORD)
    for i in range(4):
        assert producer.put(2, i, i << 33, 64, i)
    assert not producer.put(2, 4, 0, 0, 0)
    assert consumer.pending() == 4
    assert [r[1] for r in consumer.drain()] == [0, 1, 2, 3]
    assert producer.pending() == 0  # the consumer's head, published through the shared counters
    assert producer.put(2, 4, 0, 0, 0)  # room again
    assert [r[1] for r in consumer.drain()] == [4]


def test_a_ring_writes_only_inside_its_own_bytes(segment_pair):
    seg, _ = segment_pair(4096)
    offset, cap = 256, 3
    end = offset + Ring.nbytes(cap, SMALL)
    seg.buf[:] = b"\xa5" * len(seg.buf)
    ring = Ring(seg.buf, offset, cap, SMALL)
    ring.reset()
    for i in range(10):
        ring.put(i, i)
        ring.drain()
    assert bytes(seg.buf[:offset]) == b"\xa5" * offset
    assert bytes(seg.buf[end:]) == b"\xa5" * (len(seg.buf) - end)


def test_reset_empties_a_ring_and_a_new_ring_object_continues_an_existing_one(segment_pair):
    seg, _ = segment_pair(4096)
    ring = Ring(seg.buf, 0, 4, SMALL)
    ring.put(1, 1)
    ring.put(2, 2)
    again = Ring(seg.buf, 0, 4, SMALL)  # attaching does not reset: the counters live in the segment
    assert again.pending() == 2
    again.reset()
    assert ring.pending() == 0 and ring.drain() == []


def test_records_with_bytes_fields_round_trip(segment_pair):
    seg, other = segment_pair(4096)
    rec = struct.Struct("<I12s")
    Ring(seg.buf, 0, 2, rec).put(7, b"hello")
    assert Ring(other.buf, 0, 2, rec).drain() == [(7, b"hello" + b"\0" * 7)]


def test_impossible_counters_are_refused_and_the_consumer_resyncs_past_them(segment_pair):
    seg, other = segment_pair(4096)
    producer, consumer = Ring(seg.buf, 0, 4, SMALL), Ring(other.buf, 0, 4, SMALL)
    producer.put(1, 1)
    for head, tail in ((0, 1 << 62), (5, 2), (0, 5)):  # far past, behind, one more than fits
        consumer._ctr[0], producer._ctr[1] = head, tail  # noqa: SLF001 - a producer scribbling
        with pytest.raises(RingCorrupt):
            consumer.drain()
        assert consumer._ctr[0] == head  # noqa: SLF001 - nothing consumed
        assert consumer.resync() == (tail - head) % (1 << 64)
        assert consumer.pending() == 0 and consumer.drain() == []
    assert producer.put(2, 2) and consumer.drain() == [(2, 2)]  # and the ring works on from there
