"""Fixed layouts of the records that move between processes, and the codes they carry.

Records are tiny: they point at a *manifest* (a block holding a small JSON document followed by
tensor bytes) by segment and offset. Tensor bytes themselves never travel in a record.
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
# Flag on a direct-lane infer record: its client polls for the answer (a closed loop of quick
# calls), so the worker polls a moment for that client's next request too (SpinPolicy).
REQ_POLLING = 0x100
# Flag on a direct-lane infer record: the request block ends with a DIRECT_TRAILER, and the worker
# may write a successful answer straight to the HTTP client's socket (shm/peer_fds.py).
REQ_DIRECT = 0x200
# The error of an answer completed without a block (offset 0, not a whole direct answer): its
# producer's arena had no room for it, not even for an error. Its status is 503.
NO_ROOM = "the server had no room in its shared-memory arena for the response; retry later"
# The trailer, the block's last bytes, behind the answer descriptor the frontend expects and the
# bytes to send before the outputs' (the HTTP head and the JSON header): the socket's descriptor
# number in the frontend, the two lengths, spare, the socket's inode.
DIRECT_TRAILER = struct.Struct("<IIIIQ")

# Kinds of records on a worker's inbox (broker -> worker).
W_BATCH = 1
W_STOP = 2

# Kinds of records on a worker's outbox (worker -> broker).
W_READY = 1
W_LOAD_FAILED = 2
W_DONE = 3
W_CONFIG = 4

# Roles of the segments a completion may point into.
ROLE_BROKER = 0
ROLE_WORKER = 1
ROLE_NAMES = {ROLE_BROKER: "broker", ROLE_WORKER: "worker"}

# Completion slot states in a client's slot table.
SLOT_FREE = 0
SLOT_PENDING = 1
SLOT_DONE = 2

# A slot: state, status (an HTTP status code), role, segment number, offset, length, target (the
# worker a direct request went to), bytes of the answer the worker wrote to the HTTP client itself,
# and when it did (monotonic ns: the frontend learns of such answers late, and times them by it).
SLOT = struct.Struct("<IIIIQQQQQ")
SLOT_BYTES = 64
# A word the owner of a slot answered directly raises when it must hear of that answer (a request
# came behind it on the same HTTP connection before the slot read done): the worker wakes it then.
SLOT_WAKE_OFFSET = 56
# The bytes-sent field of a slot whose whole answer the worker wrote to the HTTP client; and of one
# it could not, because this host refuses it the client's socket (the frontend then stops asking).
SENT_ALL = (1 << 64) - 1
SENT_REFUSED = (1 << 64) - 2

# Decoupled (streaming) requests: the client reserves a small ring in its request block; the
# worker appends one record per response (status, flags, block offset, length, worker number).
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


def rewrite_send_time(buf: memoryview, offset: int, prefix_len: int, sent_ns: int) -> int:
    """Put a new send time into the manifest at ``offset``, whose document is a prepared prefix
    of ``prefix_len`` bytes, its send time and ``}``; returns where its tensor data starts, or -1
    (nothing written) if the new time has another number of digits: the document would change
    length, and the data would move."""
    digits = b"%d}" % sent_ns
    (n,) = _MANIFEST_LEN.unpack_from(buf, offset)
    if n != prefix_len + len(digits):
        return -1
    at = offset + 4 + prefix_len
    buf[at:at + len(digits)] = digits
    return offset + manifest_room(n)


def read_manifest(buf: memoryview, offset: int) -> Any:
    (n,) = _MANIFEST_LEN.unpack_from(buf, offset)
    return orjson.loads(buf[offset + 4:offset + 4 + n])


def read_manifest_raw(buf: memoryview, offset: int) -> tuple[bytes, int]:
    """The document's bytes, unparsed, and the absolute offset where its tensor data starts."""
    (n,) = _MANIFEST_LEN.unpack_from(buf, offset)
    return bytes(buf[offset + 4:offset + 4 + n]), offset + manifest_room(n)


def read_manifest_with_data(buf: memoryview, offset: int) -> tuple[Any, int]:
    """The document and the absolute offset where its tensor data starts."""
    (n,) = _MANIFEST_LEN.unpack_from(buf, offset)
    return orjson.loads(buf[offset + 4:offset + 4 + n]), offset + manifest_room(n)
