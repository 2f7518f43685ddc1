"""Large inference bodies copied into the shared-memory arena while they arrive.

A 600 KB image batch comes in several socket reads, a 16 MiB tensor in a few hundred. Gathering
them (uvicorn copies each into its buffer and out again per ``receive``), joining them and
copying the body into the arena once it is complete would cost three copies of every byte and a
task wake-up per 64 KiB. Instead, once the JSON header of a binary body of ``MIN_BODY_BYTES`` or
more is in, the frontend parses it, reserves the request's block in its arena
(``Connection.reserve``) and has the connection read the rest of the body straight into its
place (``BODY_SINK``, protocol.py): the kernel's copy from the socket is the only one. When the
body ends only the send is left.
Requests whose tensor bytes are not all binary data behind the header (JSON values), compressed
bodies and anything the header check refuses go the ordinary way, which also gives every error
its usual words.

A body that arrives slowly must not pin its block: the arena is a FIFO, so a block held long
stalls the reuse of the space behind it for every other request of this frontend. A body not
complete within ``HOLD_S`` is copied out to process memory, its block is given back, and it goes
the ordinary way.
"""
from __future__ import annotations

import asyncio

from shmserve.shm.connection import Connection, Reservation

MIN_BODY_BYTES = 256 << 10  # smaller bodies come in a read or two: joined, no reservation
MAX_HEADER_BYTES = 1 << 16  # a longer JSON header is unusual; parsed the ordinary way
HOLD_S = 0.5


def header_length(headers: dict[bytes, bytes]) -> int:
    """The JSON header's length of a body worth taking in this way, else -1."""
    length = headers.get(b"content-length", b"")
    if not length.isdigit() or int(length) < MIN_BODY_BYTES or b"content-encoding" in headers:
        return -1  # every small request stops here
    head = headers.get(b"inference-header-content-length", b"")
    if not head.isdigit() or len(head) > 6:
        return -1
    n = int(head)
    return n if 0 < n <= MAX_HEADER_BYTES and n < int(length) else -1


class BodyIngest:
    """One body being copied into its reserved block: what the header said, and how far it got;
    after ``HOLD_S`` (``spill``), the body so far and the rest in process memory instead.

    It is the connection's ``BodySink`` (protocol.py): ``room`` is where the next bytes read go,
    ``took`` counts them there, ``feed`` takes bytes read elsewhere, ``left`` is what is to come."""

    def __init__(self, conn: Connection, reservation: Reservation, head: bytes, doc: dict,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.conn = conn
        self.reservation = reservation
        self.head = head
        self.doc = doc
        self.total = len(reservation.data)  # type: ignore[arg-type] - the binary tail's length
        self.pos = 0  # of the tail, in (in the block, or spilled)
        self.spilled: list[bytes] | None = None  # the body, once out of its block
        self._timer: asyncio.TimerHandle | None = loop.call_later(HOLD_S, self.spill)

    def left(self) -> int:
        return self.total - self.pos

    def room(self) -> memoryview | None:
        """The rest of the block, where the next bytes read go (``took`` counts them); None once
        the body has spilled out of it."""
        data = self.reservation.data
        return data[self.pos:] if self.spilled is None and data is not None else None

    def took(self, n: int) -> None:
        """``n`` more bytes were read into ``room``."""
        self.pos += n

    def feed(self, chunk: bytes | memoryview) -> None:
        n = len(chunk)
        if self.pos + n > self.total:
            raise ValueError("the body runs past its declared length")
        if self.spilled is not None:
            self.spilled.append(bytes(chunk))
        else:
            data = self.reservation.data
            assert data is not None
            data[self.pos:self.pos + n] = chunk
        self.pos += n

    def spill(self) -> None:
        """Copy the body so far out of its block and give the block back."""
        self._timer = None
        data = self.reservation.data
        if self.spilled is None and data is not None:
            self.spilled = [self.head, bytes(data[:self.pos])]
            self.conn.discard(self.reservation)

    def finish(self) -> bytes | None:
        """The whole body is in: None if it lies in its block (send the reservation), else the
        body as bytes."""
        self._stop()
        return b"".join(self.spilled) if self.spilled is not None else None

    def discard(self) -> None:
        self._stop()
        self.conn.discard(self.reservation)

    def _stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
