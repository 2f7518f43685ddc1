"""The wire protocol's fixed layouts: a manifest (length, JSON document, 64-byte aligned tensor
data) round-trips, and the record and slot layouts fit where the segments expect them."""
from __future__ import annotations

import struct

import orjson
import pytest

from shmserve.shm import protocol as p


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
    assert p.read_manifest_with_data(buf, offset) == (doc, start)
    buf[start:start + 4] = b"\x01\x02\x03\x04"  # tensor bytes behind it leave the document alone
    assert p.read_manifest(buf, offset) == doc


def test_a_request_record_round_trips_with_its_flags_apart_from_its_kind():
    buf = buffer(p.RECORD.size)
    kind = p.REQ_INFER | p.REQ_POLLING
    p.RECORD.pack_into(buf, 0, kind, 7, 1 << 40, 123, (1 << 64) - 1)
    got = p.RECORD.unpack_from(buf, 0)
    assert got == (kind, 7, 1 << 40, 123, (1 << 64) - 1)
    assert got[0] & 0xFF == p.REQ_INFER and got[0] & p.REQ_POLLING
    assert p.REQ_POLLING not in {p.REQ_INFER, p.REQ_CONTROL, p.REQ_BYE}
    assert p.RECORD.size == 32


def test_a_slot_round_trips_within_its_64_bytes():
    assert p.SLOT.size <= p.SLOT_BYTES == 64
    buf = buffer(p.SLOT_BYTES * 2)
    fields = (p.SLOT_DONE, 200, p.ROLE_WORKER, 5, 4096, 100, 2)
    p.SLOT.pack_into(buf, 0, *fields)
    assert p.SLOT.unpack_from(buf, 0) == fields
    assert bytes(buf[p.SLOT_BYTES:]) == bytes(p.SLOT_BYTES)  # nothing spills into the next slot
    assert len({p.SLOT_FREE, p.SLOT_PENDING, p.SLOT_DONE}) == 3 and p.ROLE_NAMES[p.ROLE_WORKER] == "worker"


def test_a_connect_record_carries_a_segment_name_nul_padded():
    name = "/shmserve.abc.client.12"
    pid, raw = p.CONNECT.unpack(p.CONNECT.pack(4321, name.encode()))
    assert pid == 4321 and raw.rstrip(b"\0").decode() == name and len(raw) == 124
    with pytest.raises(struct.error):
        p.CONNECT.pack(1, "x")  # type: ignore[arg-type]  # names go as bytes


