"""The wire protocol's fixed layouts: a manifest (length, JSON document, 64-byte aligned tensor
data) round-trips, the send time is rewritten in place only when its length stays, and the record
and slot layouts fit where the segments expect them."""
from __future__ import annotations

import struct

import orjson
import pytest

from shmserve.shm import protocol as p
from shmserve.shm.connection import Connection


def buffer(size: int = 4096) -> memoryview:
    return memoryview(bytearray(size))


@pytest.mark.parametrize("doc_bytes, room", [(0, 64), (60, 64), (61, 128), (124, 128), (125, 192)])
def test_manifest_room_keeps_the_tensor_data_64_byte_aligned(doc_bytes, room):
    assert p.manifest_room(doc_bytes) == room


@pytest.mark.parametrize("offset", [0, 64, 1024])
def test_a_manifest_round_trips_and_its_data_starts_aligned_after_it(offset):
    buf = buffer()
    doc = {"model": "m", "inputs": [{"name": "X", "shape": [1, 3], "data": 0, "size": 12}], "id": "é"}
    data = orjson.dumps(doc)
    start = p.write_manifest(buf, offset, data)
    assert start == offset + p.manifest_room(len(data)) and start % p.MANIFEST_ALIGN == 0
    assert p.read_manifest(buf, offset) == doc
    assert p.read_manifest_raw(buf, offset) == (data, start)
    assert p.read_manifest_with_data(buf, offset) == (doc, start)
    buf[start:start + 4] = b"\x01\x02\x03\x04"  # tensor bytes behind it leave the document alone
    assert p.read_manifest(buf, offset) == doc


def test_the_send_time_is_rewritten_in_place_when_it_keeps_its_length():
    buf = buffer()
    prefix = Connection.prepared_prefix({"model": "m", "inputs": []})
    start = p.write_manifest(buf, 128, b"%b%d}" % (prefix, 1000))
    buf[start:start + 3] = b"abc"
    assert p.rewrite_send_time(buf, 128, len(prefix), 9999) == start
    assert p.read_manifest(buf, 128)["t"] == 9999
    assert bytes(buf[start:start + 3]) == b"abc"


@pytest.mark.parametrize("new", [999, 10000])
def test_a_send_time_of_another_length_is_refused_and_nothing_written(new):
    buf = buffer()
    prefix = Connection.prepared_prefix({"model": "m"})
    p.write_manifest(buf, 0, b"%b%d}" % (prefix, 1000))
    before = bytes(buf)
    assert p.rewrite_send_time(buf, 0, len(prefix), new) == -1
    assert bytes(buf) == before


def test_a_request_record_round_trips_with_its_flags_apart_from_its_kind():
    buf = buffer(p.RECORD.size)
    kind = p.REQ_INFER | p.REQ_POLLING | p.REQ_DIRECT
    p.RECORD.pack_into(buf, 0, kind, 7, 1 << 40, 123, (1 << 64) - 1)
    got = p.RECORD.unpack_from(buf, 0)
    assert got == (kind, 7, 1 << 40, 123, (1 << 64) - 1)
    assert got[0] & 0xFF == p.REQ_INFER and got[0] & p.REQ_POLLING and got[0] & p.REQ_DIRECT
    assert {p.REQ_INFER, p.REQ_CONTROL, p.REQ_BYE}.isdisjoint({p.REQ_POLLING, p.REQ_DIRECT})
    assert p.RECORD.size == 32


def test_a_slot_and_its_wake_word_fit_in_its_64_bytes():
    assert p.SLOT.size <= p.SLOT_WAKE_OFFSET and p.SLOT_WAKE_OFFSET + 4 <= p.SLOT_BYTES == 64
    buf = buffer(p.SLOT_BYTES)
    fields = (p.SLOT_DONE, 200, p.ROLE_WORKER, 5, 4096, 100, 2, p.SENT_ALL, 987654321)
    p.SLOT.pack_into(buf, 0, *fields)
    struct.pack_into("<I", buf, p.SLOT_WAKE_OFFSET, 1)
    assert p.SLOT.unpack_from(buf, 0) == fields  # the wake word is past the slot's fields
    assert p.SENT_ALL != p.SENT_REFUSED and p.SENT_REFUSED > 0
    assert len({p.SLOT_FREE, p.SLOT_PENDING, p.SLOT_DONE}) == 3 and p.ROLE_NAMES[p.ROLE_WORKER] == "worker"


def test_a_connect_record_carries_a_segment_name_nul_padded():
    name = "/shmserve.abc.client.12"
    pid, raw = p.CONNECT.unpack(p.CONNECT.pack(4321, name.encode()))
    assert pid == 4321 and raw.rstrip(b"\0").decode() == name and len(raw) == 124
    with pytest.raises(struct.error):
        p.CONNECT.pack(1, "x")  # type: ignore[arg-type]  # names go as bytes


def test_the_direct_trailer_round_trips():
    fields = (17, 300, 120, 0, 1 << 50)
    assert p.DIRECT_TRAILER.unpack(p.DIRECT_TRAILER.pack(*fields)) == fields
    assert p.DIRECT_TRAILER.size == 24
