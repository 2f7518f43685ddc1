"""Large inference bodies copied into the shared-memory arena while they arrive.

A 16 MiB tensor sent over HTTP comes in a few hundred socket reads. Gathering them and copying
the joined body into the arena once it is complete put two full copies between the body's last
byte and the request's dispatch (5.5 ms of a 16 MiB identity request here). Instead, once the
JSON header of a large binary body is in, the frontend parses it, reserves the request's block in
its arena (``Connection.reserve``) and copies every later read straight to its place; when the
body ends only the send is left. Requests whose tensor bytes are not all binary data behind the
header (JSON values), compressed bodies and anything the header check refuses go the ordinary
way, which also gives every error its usual words.

A body that arrives slowly must not pin its block: the arena is a FIFO, so a block held long
stalls the reuse of the space behind it for every other request of this frontend. A body not
complete within ``HOLD_S`` (or waiting for its turn behind an earlier request on its connection)
is copied out to process memory, its block is given back, and it goes the ordinary way.
"""
from __future__ import annotations

from shmserve.shm.connection import Connection, Reservation

from .known import Known

MIN_BODY_BYTES = 1 << 20  # smaller bodies are joined: one copy, no reservation
MAX_HEADER_BYTES = 1 << 16  # a longer JSON header is unusual; parsed the ordinary way
HOLD_S = 0.5


def header_length(headers: dict[bytes, bytes]) -> int:
    """The JSON header's length of a body worth taking in this way, else -1."""
    length = headers.get(b"content-length", b"")  # (checked for digits before the request got here)
    if not length.isdigit() or int(length) < MIN_BODY_BYTES or b"content-encoding" in headers:
        return -1  # every small request stops here
    head = headers.get(b"inference-header-content-length", b"")
    if not head.isdigit() or len(head) > 6:
        return -1
    n = int(head)
    return n if 0 < n <= MAX_HEADER_BYTES and n < int(length) else -1


class BodyIngest:
    """One body being copied into its reserved block: what the header said, and how far it got."""

    __slots__ = ("conn", "reservation", "head", "doc", "known", "pos")

    def __init__(self, conn: Connection, reservation: Reservation, head: bytes, doc: dict,
                 known: Known | None) -> None:
        self.conn = conn
        self.reservation = reservation
        self.head = head
        self.doc = doc
        self.known = known
        self.pos = 0

    def feed(self, chunk: bytes | memoryview) -> None:
        data = self.reservation.data
        assert data is not None
        n = len(chunk)
        data[self.pos:self.pos + n] = chunk  # httptools framed the body: it cannot run past its end
        self.pos += n

    def evacuate(self) -> bytes:
        """The body so far as bytes, and the block given back."""
        data = self.reservation.data
        assert data is not None
        body = b"".join((self.head, data[:self.pos]))
        self.discard()
        return body

    def discard(self) -> None:
        self.conn.discard(self.reservation)
