"""Checks of what a client writes into shared memory, before the broker or a worker uses it.

A client owns its segment (header, request ring, slots, arena) and writes its lanes' counters and
records and the broker's connect ring. Everything read from there is checked here against the
real sizes first: a record's kind, slot, offset and length, a descriptor's length prefix and its bytes
(an inference request's: shm/descriptor.py; a control request's: a JSON object),
a connect record's pid and name, a segment's header. What fails is ``Garbage``, something no
shmserve client writes: its reader disconnects that client (the broker) or reports it to the
broker (a worker); it never takes a server process down. What a descriptor *says* (models,
tensors, options) is checked later, as a request error (intake.py, workers/requests.py).
"""
from __future__ import annotations

import enum
import re
import struct
from typing import Any, NamedTuple

import orjson

from .descriptor import DescriptorError, InferRequest, decode
from .protocol import MANIFEST_ALIGN, REQ_BYE, REQ_CANCEL, REQ_CONTROL, REQ_INFER, REQ_POLLING, manifest_room

_U32 = struct.Struct("<I")
KIND_MASK = 0xFF  # a record's kind; the bits above are flags (REQ_POLLING)
MAX_SLOTS = 1 << 16  # far above any connection's table (DEFAULT_SLOTS is 1024)

# What a client may put on its request ring (to the broker), and on its lanes (to a worker).
RING_KINDS = frozenset({REQ_INFER, REQ_CONTROL, REQ_CANCEL, REQ_BYE})
LANE_KINDS = frozenset({REQ_INFER})
_FLAGS = REQ_POLLING


class Fault(enum.IntEnum):
    """What a client got wrong (also the code a worker reports to the broker, channel.py)."""

    RING = 1  # a ring's counters
    KIND = 2  # a record's kind or flags
    SLOT = 3  # a slot number past its table
    BLOCK = 4  # a record's offset and length outside its arena
    DESCRIPTOR = 5  # a descriptor's length prefix, an inference request's bytes, a control's JSON
    CONNECT = 6  # a connect record: pid or name
    HEADER = 7  # its segment's header (size, slot count, wake-up kind)

    @property
    def text(self) -> str:
        return _TEXTS[self]


_TEXTS = {Fault.RING: "ring counters out of range", Fault.KIND: "unknown record kind",
          Fault.SLOT: "slot number out of range", Fault.BLOCK: "record offset or length outside its arena",
          Fault.DESCRIPTOR: "malformed request descriptor", Fault.CONNECT: "malformed connect record",
          Fault.HEADER: "malformed client segment header"}


class Garbage(ConnectionError):
    """A client wrote what no shmserve client writes: the connection is not usable."""

    def __init__(self, fault: Fault, detail: str) -> None:
        super().__init__(f"{fault.text}: {detail}")
        self.fault = fault


class Record(NamedTuple):
    """A record from a client's request ring or lane, checked: ``kind`` without its flags,
    ``slot`` inside the slot table, ``off``/``length`` a block inside the arena (for the kinds
    that carry one), ``cookie`` the lane's cookie (0 on the request ring)."""

    kind: int
    flags: int
    slot: int
    off: int
    length: int
    cookie: int


class Layout(NamedTuple):
    """The sizes a client segment's records are checked against."""

    nslots: int
    arena_offset: int
    size: int


def check_record(layout: Layout, raw: tuple, kinds: frozenset[int]) -> Record:
    """``raw``: the fields ``RECORD`` unpacked. Raises Garbage."""
    kind_word, slot, off, length, cookie = raw
    kind, flags = kind_word & KIND_MASK, kind_word & ~KIND_MASK
    if kind not in kinds or flags & ~_FLAGS:
        raise Garbage(Fault.KIND, f"kind {kind_word:#x}")
    if kind == REQ_BYE:
        return Record(kind, flags, 0, 0, 0, cookie)
    if slot >= layout.nslots:
        raise Garbage(Fault.SLOT, f"slot {slot} (the table has {layout.nslots})")
    if kind != REQ_CANCEL:
        if off < layout.arena_offset or length < 4 or off + length > layout.size:
            raise Garbage(Fault.BLOCK, f"offset {off}, length {length} (arena {layout.arena_offset}..{layout.size})")
    return Record(kind, flags, slot, off, length, cookie)


def _descriptor_length(buf: memoryview, rec: Record) -> int:
    (n,) = _U32.unpack_from(buf, rec.off)
    if 4 + n > rec.length:
        raise Garbage(Fault.DESCRIPTOR, f"length {n} in a block of {rec.length} bytes")
    return n


def read_request(buf: memoryview, rec: Record) -> tuple[InferRequest, int]:
    """The inference request a checked record's block starts with, and where its tensor bytes
    start (as ``protocol.read_manifest_with_data``). Raises Garbage."""
    n = _descriptor_length(buf, rec)
    try:
        return decode(buf, rec.off + 4, rec.off + 4 + n), rec.off + manifest_room(n)
    except DescriptorError as e:
        raise Garbage(Fault.DESCRIPTOR, str(e)) from None


def read_descriptor(buf: memoryview, rec: Record) -> tuple[dict[str, Any], int]:
    """The JSON object a checked control record's block starts with, and where the bytes after
    it start. Raises Garbage."""
    n = _descriptor_length(buf, rec)
    try:
        doc = orjson.loads(buf[rec.off + 4:rec.off + 4 + n])
    except orjson.JSONDecodeError as e:
        raise Garbage(Fault.DESCRIPTOR, f"not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise Garbage(Fault.DESCRIPTOR, f"a JSON {type(doc).__name__}, not an object")
    return doc, rec.off + manifest_room(n)


def client_name_pattern(server_id: str) -> re.Pattern[str]:
    """The names ``Connection`` gives client segments: ``/shmserve.<id>.client.<ticket>-<n>``
    (the ticket: its process's liveness lock, liveness.py)."""
    return re.compile(rf"/shmserve\.{re.escape(server_id)}\.client\.([0-9]{{1,10}})-[0-9]{{1,10}}")


def check_connect(pattern: re.Pattern[str], pid: int, raw: bytes) -> str:
    """The client segment a connect record names. The name must be the client's own (carry the
    record's number, its ticket, which the broker then checks is held), so that a client can
    only ever hand the broker a segment of its own process. Raises Garbage."""
    body = raw.rstrip(b"\0")
    try:
        name = body.decode("ascii")
    except UnicodeDecodeError:
        raise Garbage(Fault.CONNECT, f"pid {pid}: name {body[:40]!r} is not text") from None
    match = pattern.fullmatch(name)
    if match is None or int(match.group(1)) != pid or pid == 0:
        raise Garbage(Fault.CONNECT, f"pid {pid}: {name[:80]!r} is not a client segment of that process")
    return name


def check_layout(size: int, nslots: int, notify_kind: int, known_kinds: frozenset[int], header_bytes: int,
                 ring_bytes: int, slot_bytes: int) -> Layout:
    """A client segment's header against its real size (the creator wrote it; it may lie)."""
    if not 0 < nslots <= MAX_SLOTS:
        raise Garbage(Fault.HEADER, f"slot count {nslots}")
    if notify_kind not in known_kinds:
        raise Garbage(Fault.HEADER, f"wake-up kind {notify_kind}")
    slots_offset = header_bytes + ring_bytes
    arena_offset = (slots_offset + nslots * slot_bytes + 4095) & ~4095
    if arena_offset + MANIFEST_ALIGN > size:
        raise Garbage(Fault.HEADER, f"{size} bytes cannot hold {nslots} slots and an arena")
    return Layout(nslots, arena_offset, size)
