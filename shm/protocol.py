"""Fixed layouts of the records that move between processes, and the codes they carry.

Records are tiny: they point at a block by segment and offset: a request's *manifest* (a small
JSON document followed by tensor bytes), or an answer (shm/answer.py). Tensor bytes themselves
never travel in a record.
"""
from __future__ import annotations

import struct
from typing import Any

import orjson

# Ring records: kind, a small integer argument, offset, length, an id.
RECORD = struct.Struct("<IIQQQ")

# Kinds of records on a client's request ring (client -> broker).
REQ_INFER = 1
REQ_CONTROL = 2
REQ_BYE = 3
# The owner cancelled the request in slot ``small int`` (its slot's cancelled word is set): the
# broker drops it from its queues if it is still there.
REQ_CANCEL = 4
# Flag on a direct-lane infer record: its client polls for the answer, so the worker polls a
# moment for that client's next request too (shm/waker.py's SpinPolicy).
REQ_POLLING = 0x100
# The error of an answer completed without a block (offset 0): its producer's arena had no room
# for it, not even for an error. Its status is 503.
NO_ROOM = "the server had no room in its shared-memory arena for the response; retry later"
# Such a completion's length word says why: 0, the arena (NO_ROOM); NO_BLOCK_SHM_FULL, /dev/shm had no
# page for it. Under --local-client-users a user's first answer makes that user's extent, and where
# /dev/shm is full not even the error fits anywhere its client may read: this is all it learns.
NO_BLOCK_SHM_FULL = 1
NO_ROOM_SHM_FULL = "/dev/shm is full: the server could not take a page for the response; retry later"


def no_block_text(length: int) -> str:
    """The error of an answer completed without a block, by its length word."""
    return NO_ROOM_SHM_FULL if length == NO_BLOCK_SHM_FULL else NO_ROOM

# A cancelled request's answer, as Triton words TRITONSERVER_ERROR_CANCELLED (its HTTP endpoint
# maps that code to 400). Nobody usually reads it: its owner stopped waiting.
CANCELLED_STATUS = 400


def cancelled_error(request_id: str = "") -> str:
    return f"[request id: {request_id or '<id_unknown>'}] Request was cancelled"


# Kinds of records on a worker's inbox (broker -> worker).
W_BATCH = 1
W_STOP = 2
W_CHECK_READY = 3  # run the model's is_ready() (workers/readiness.py); the answer goes in the header

# Kinds of records on a worker's outbox (worker -> broker).
W_READY = 1
W_LOAD_FAILED = 2
W_DONE = 3
W_CONFIG = 4
# A part of the next message's payload: a payload larger than a part comes as parts, then its message.
W_MORE = 5

# Roles of the segments a completion may point into.
ROLE_BROKER = 0
ROLE_WORKER = 1
ROLE_NAMES = {ROLE_BROKER: "broker", ROLE_WORKER: "worker"}
# A slot's role word also says which of its producer's output extents holds the answer
# (shm/extents.py): role | extent << EXTENT_SHIFT. Extent 0 lies in the producer's own segment.
EXTENT_SHIFT = 8
# A stream record's role word also marks the response a model sent with the final flag (Triton's
# gRPC stream marks that one final); the stream's end still completes the slot after it.
LAST_RESPONSE = 1 << (EXTENT_SHIFT - 1)
ROLE_MASK = LAST_RESPONSE - 1


def role_word(role: int, extent: int) -> int:
    return role | extent << EXTENT_SHIFT

# Completion slot states in a client's slot table.
SLOT_FREE = 0
SLOT_PENDING = 1
SLOT_DONE = 2

# A slot: state, status (an HTTP status code), role, segment number, offset, length, and target
# (the worker a direct request went to). Each slot takes a cache line of its own.
SLOT = struct.Struct("<IIIIQQQ")
SLOT_BYTES = 64
# A slot's answer: its fields from status to length, which a producer writes on their own before
# it stores DONE. ``pack_into`` zeroes what it writes first: packing the whole slot made its state
# and target words, which other processes poll, pass through 0 (FREE, "through the broker").
SLOT_ANSWER = struct.Struct("<IIIQQ")
SLOT_ANSWER_AT = 4

# Decoupled (streaming) requests: the client reserves a small ring in its request block; the
# producer appends one record per response (status, role word, block offset, length, worker
# number). The role word is a slot's (``role_word``): a worker's extent, or ROLE_BROKER when the
# block lies in the broker's arena (a decoupled ensemble's response).
STREAM_CAPACITY = 64

# A connect record: client pid, then the client segment's name (NUL padded).
CONNECT = struct.Struct("<I124s")

_MANIFEST_LEN = struct.Struct("<I")
MANIFEST_ALIGN = 64


def manifest_room(doc_bytes: int) -> int:
    """Bytes a manifest's header and JSON take before the 64-byte aligned tensor data."""
    return (4 + doc_bytes + MANIFEST_ALIGN - 1) & ~(MANIFEST_ALIGN - 1)


def write_manifest(buf: memoryview, offset: int, doc: bytes) -> int:
    """Write ``doc`` at ``offset``; returns where tensor data may start (64-byte aligned)."""
    _MANIFEST_LEN.pack_into(buf, offset, len(doc))
    buf[offset + 4:offset + 4 + len(doc)] = doc
    return offset + manifest_room(len(doc))


def read_manifest(buf: memoryview, offset: int) -> Any:
    (n,) = _MANIFEST_LEN.unpack_from(buf, offset)
    return orjson.loads(buf[offset + 4:offset + 4 + n])


def read_manifest_with_data(buf: memoryview, offset: int) -> tuple[Any, int]:
    """The document and the absolute offset where its tensor data starts."""
    (n,) = _MANIFEST_LEN.unpack_from(buf, offset)
    return orjson.loads(buf[offset + 4:offset + 4 + n]), offset + manifest_room(n)
