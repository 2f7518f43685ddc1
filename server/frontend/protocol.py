"""The HTTP/1.1 connection as a frontend keeps it: uvicorn's httptools protocol with the limits
production servers keep (``HttpLimits``, limits.py).

uvicorn's protocol (pinned, pyproject.toml) arms its keep-alive timeout only after a first
answer and has no limit on a request head's size or time, no body timeout and no bound on
connections: a connection that never sends a byte, a head that never ends (httptools buffers it
whole) or a body that stops half-way each held a descriptor and memory for good.
``LimitedHttpProtocol`` adds, per connection:

- idle: no request in progress for ``idle_timeout_s`` (from the accept on, and after each answer)
  closes it, as uvicorn's keep-alive timeout did after answers only (0, the default: never, as
  Triton keeps them: a proxy that pools connections to us must not find one closed under it);
- head: a request line and header fields must be complete within ``header_timeout_s`` of their
  first byte (408) and hold at most ``max_header_bytes`` (431, measured once the head is complete;
  a head still arriving is cut once it passes the limit by one socket read at most);
- body: while a body is read, nothing arriving for ``body_timeout_s`` is a 408 (time the frontend
  itself stops reading, to let a request ahead finish, does not count);
- send: an answer its client reads none of for ``send_timeout_s`` while the transport holds more
  of it than its high-water mark (a client that stopped reading) cuts the connection, freeing
  what was unsent, which otherwise stayed in this process's memory for as long as the connection
  lived (nginx's ``send_timeout``);
- answered early: a request answered before its body has all come keeps its connection when the
  rest of the body is declared and at most ``DISCARD_MAX_BYTES`` (a GET with a body, a refusal
  that needed none of it): the rest is read and dropped, and the next request is parsed, as
  Triton, which reads every body before it answers, keeps the connection. Otherwise (refused for
  its size, chunked, waiting for ``100 Continue``, or the answer says ``connection: close``) the
  connection ends: what the
  client still sends is dropped unread for at most ``LINGER_S`` after the answer, so that a
  client still writing reads the answer rather than a reset (nginx's lingering close), then the
  connection closes: a never-ending body is cut;
- bound: past ``max_connections`` connections in this process a new one takes the place of the
  connection idle longest, closed for it (as nginx reuses its keep-alive connections when it has
  none left); with every connection busy it is answered 503 at once and closed. Idle connections
  cannot take the descriptors the frontend needs for itself.

It also lets the application take the rest of a body straight from the socket
(``scope[BODY_SINK](sink)``, ingest.py): the connection is a ``BufferedProtocol``, and while a
sink takes a body the socket is read into the sink's ``room`` (a large request's block in the
arena), at most the body's bytes left, and the parser never sees them; once they are all in, the
request is complete and a fresh parser takes the next one. Before, each piece went through
uvicorn's buffer (or, later, the parser's ``on_body``) and was copied twice more on its way, with
a pause, a resume and a task wake-up per 64 KiB. Everything else read goes to the parser as
before, from one buffer the loop's connections share (each read is parsed before the next).

Every refusal is a JSON ``{"error": ...}`` naming its flag, with ``connection: close``; where an
answer to an earlier request is still being made, nothing can be written in between and the
connection is closed without one.
"""
from __future__ import annotations

import asyncio
import fcntl
import logging
import termios
import time
import typing
import weakref
from typing import Any

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from shmserve.server.edge.edge_counts import EdgeCounts
from shmserve.server.edge.header_forward import RAW_HEADER_NAMES

from .limits import HttpLimits

log = logging.getLogger("shmserve.frontend")

LINGER_S = 5.0  # the most a refused body is read and dropped (nginx: lingering_timeout 5 s)
# The most of a declared body answered before it came that is read and dropped to keep the
# connection: --http-max-input-size's default, which Triton reads a body up to before it answers.
DISCARD_MAX_BYTES = 64 << 20
BUSY_LINGER_S = 1.0  # the same for a connection past the bound: its descriptor is what is short
WARN_EVERY_S = 10.0  # one warning line per kind this often at most: refusals come in floods
# Triton's bound on a chunked body's non-empty chunks (each costs a buffer entry, however small).
MAX_CHUNKS = 1 << 16
# What a chunked body may carry besides its data (chunk sizes, extensions, trailers): twice the
# head's limit (--http-max-header-bytes: the read a body starts in holds its head too) and this
# much a chunk. Trailers are dropped, never taken as
# header fields (RFC 9110 6.5.1), but the parser gathers each before it hands it over.
CHUNK_FRAMING_BYTES = 64
# Requests read behind one still being answered (HTTP/1.1 pipelining): past these, the rest of
# the connection's input is dropped and the connection ends after their answers (a client retries
# requests a closed connection did not answer); a client that sends without reading would
# otherwise have each answer let another read's worth of requests in.
MAX_PIPELINED = 128
# scope key: a callable taking a ``BodySink`` (or None: the application stops taking the body);
# the rest of the request's body goes to it as it is read, and ``receive`` returns only its end (an
# empty last message) or the disconnect.
BODY_SINK = "shmserve.body_sink"
# What one socket read of a connection not taking a body directly goes into: as much as uvicorn
# buffers of a body before it pauses reading. A large body's first reads are parsed (the request
# has not seen its header yet); reads of 256 KiB (uvloop's own size) parsed more of a 600 KB body
# that way: 0.95x the rate at 1.12x the CPU of 64 KiB, and no change for 200 KB bodies.
READ_BYTES = 64 << 10
# scope key: a callable the application calls right before it sends a response's start and its
# whole body, with no await between that could wait: uvicorn writes the head and the body in two
# sends, and the client, woken by the head, waits again for the body. Held, they go in one.
ONE_WRITE = "shmserve.one_write"


class BodySink(typing.Protocol):
    """Where a request's body goes past the parser (``BODY_SINK``; ingest.py's ``BodyIngest``)."""

    def left(self) -> int:
        """Bytes of the body still to come (more than 0 when the sink is given)."""

    def room(self) -> memoryview | None:
        """Where the next bytes read go directly, exactly ``left`` long; None: read them elsewhere
        and ``feed`` them."""

    def took(self, n: int) -> None:
        """``n`` bytes were read into ``room``."""

    def feed(self, chunk: memoryview) -> None:
        """``chunk`` was read elsewhere (a copy is the sink's to make)."""


_read_buffers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, memoryview] = weakref.WeakKeyDictionary()


def _read_buffer(loop: asyncio.AbstractEventLoop) -> memoryview:
    """The buffer that the connections of ``loop`` read into for the parser: one per loop, since a
    loop parses each read (``buffer_updated``, which copies what it keeps) before it reads again.
    Not one per process: uvloop runs a loop without the GIL, so two loops of one process (servers
    in threads) would read into one buffer at once."""
    buffer = _read_buffers.get(loop)
    if buffer is None:
        buffer = _read_buffers[loop] = memoryview(bytearray(READ_BYTES))
    return buffer


class _StopParsing(Exception):
    """Raised from a parser callback once the connection is refused: the parser stops there."""


class _CycleTransport:
    """The transport as one request's cycle sees it: ``close`` (an answer with ``connection:
    close``) lingers while the request's body is still coming (``LimitedHttpProtocol.end``), and
    an answer's head can wait for its body (``ONE_WRITE``)."""

    __slots__ = ("_protocol", "_transport", "_hold", "_held")

    def __init__(self, protocol: "LimitedHttpProtocol", transport: asyncio.Transport) -> None:
        self._protocol = protocol
        self._transport = transport
        self._hold = False  # the next write is an answer's head, kept for the write after it
        self._held: bytes | None = None

    def hold_next(self) -> None:
        """``scope[ONE_WRITE]``: keep the next write (the answer's head) for the one after it."""
        self._hold = True

    def write(self, data: bytes) -> None:
        if self._hold:
            self._hold, self._held = False, data
            return
        held = self._held
        if self._transport.is_closing():  # its client left (say, after pipelining requests): a write would raise
            self._held = None
            return
        if held is None:
            self._transport.write(data)
        else:
            self._held = None
            self._transport.writelines((held, data))  # one send for both

    def forget(self) -> None:
        """A new request: nothing held from one whose body was never written (its client left)."""
        self._hold, self._held = False, None

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        self._protocol.end()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


KEEP_ALIVE_HEADER = (b"connection", b"keep-alive")


def _asks_keep_alive(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(name == b"connection" and b"keep-alive" in value.lower() for name, value in headers)


def _keep_alive_for_http10(cycle: RequestResponseCycle) -> None:
    """An HTTP/1.0 request with ``Connection: keep-alive`` (``ab -k``, some health checkers)
    keeps its connection, as Triton keeps it: uvicorn closes every HTTP/1.0 connection. The
    answer says ``connection: keep-alive``, without which the client closes; an answer with no
    length (chunked, which an HTTP/1.0 client cannot read as such) or that says ``close`` ends
    the connection."""
    cycle.keep_alive = True
    send = cycle.send

    async def send_keeping_alive(message: Any) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            names = {name.lower() for name, _ in headers}
            if b"content-length" not in names:
                cycle.keep_alive = False
            elif b"connection" not in names and cycle.keep_alive:  # (not when the input ended since)
                message = {**message, "headers": [*headers, KEEP_ALIVE_HEADER]}
        await send(message)

    cycle.send = send_keeping_alive  # type: ignore[method-assign]


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's ``HttpToolsProtocol`` with the limits of the module's docstring, reading into
    buffers it chooses (``get_buffer``, through ``BufferedConnection``): a body a sink takes
    straight into the sink's room."""

    limits = HttpLimits()  # set per frontend by ``protocol_class``
    max_connections = 1 << 20
    edge = EdgeCounts("http")  # the frontend's own, set by ``protocol_class`` too
    _warned: dict[str, float] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # between requests or in a head: the parser waits for a head's end
        self._in_body = False  # a head is complete and its body is not
        # Bytes of the head in progress, counted a read at a time: at least (the read it began in
        # not counted) and at most (that read counted whole).
        self._head_min = self._head_max = 0
        self._head_deadline = 0.0  # when the head in progress must be complete (0: none started)
        self._fed = 0  # length of the read being parsed
        self._began = False  # a request began within the read being parsed
        self._last_read = 0.0
        self._watch: asyncio.TimerHandle | None = None  # the one timer of the head, body and linger limits
        self._lingering = False
        self._chunks = 0  # chunk headers of the body in progress (its last, empty chunk included)
        self._framing = 0  # bytes of the body in progress parsed that were not data (a chunked one's framing)
        self._sink: BodySink | None = None  # where the body in progress goes (BODY_SINK); None: dropped
        self._body_left = 0  # bytes of the body in progress still to be read past the parser (0: none)
        self._into_room = False  # the last buffer given was the sink's room
        self._shared_read = _read_buffer(self.loop)
        # A request that ends the connection had its body read past the parser: what follows is
        # dropped, as uvicorn's parser drops what comes after such a request (lenient_data_after_close).
        self._input_done = False
        self._idle_since = 0.0  # when its last answer went out (or it was accepted): the bound's drain order
        self._send_watch: asyncio.TimerHandle | None = None  # the send timeout's, while answers wait unread
        self._unsent = 0  # bytes the transport held at the send watch's last look
        self._drained = False  # the transport resumed us since the send watch's last look

    # -- connections -----------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.edge.connections += 1  # (less one in connection_lost, which every connection gets)
        self._idle_since = time.monotonic()  # (not the loop's time: uvloop's is the same through an iteration)
        if len(self.connections) > self.max_connections and not self._drain_idle():
            self._warn("bound", "refusing connections past --http-max-connections %d (503)", self.max_connections)
            self._refuse(503, f"the frontend holds its limit of {self.max_connections} connections "
                              f"(--http-max-connections); retry later", BUSY_LINGER_S)
            return
        self._cycle_transport = _CycleTransport(self, transport)
        self._one_write = self._cycle_transport.hold_next
        # uvicorn arms its keep-alive timeout after an answer only; a silent new connection is idle too.
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def _idle(self) -> bool:
        """No request in progress, none begun, none waiting behind an answer."""
        cycle = self.cycle
        return (self._in_head and not self._head_deadline and not self._lingering and not self.pipeline
                and (cycle is None or cycle.response_complete) and not self.transport.is_closing())

    def _drain_idle(self) -> bool:
        """At the bound: close the connection idle longest to make room for this one; False if
        every other connection is busy. A scan of this process's connections, only at the bound."""
        idle = [c for c in self.connections if c is not self and isinstance(c, LimitedHttpProtocol) and c._idle()]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c._idle_since)
        self._warn("drain", "at --http-max-connections %d: closing the connection idle longest for a new one",
                   self.max_connections)
        oldest.transport.close()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.edge.connections -= 1
        self._cancel_watch()
        if self._send_watch is not None:
            self._send_watch.cancel()
            self._send_watch = None
        self._sink, self._body_left = None, 0
        super().connection_lost(exc)

    # -- reading ---------------------------------------------------------------------------------
    def get_buffer(self, sizehint: int) -> memoryview:
        """Where the loop reads next: the sink's room while a sink takes the body, otherwise the
        shared buffer (at most the body's bytes left, so that what follows is parsed)."""
        left = self._body_left
        if not left or self._lingering:
            return self._shared_read
        sink = self._sink
        room = sink.room() if sink is not None else None
        self._into_room = room is not None
        if room is not None:
            return room
        return self._shared_read[:left] if left < READ_BYTES else self._shared_read

    def buffer_updated(self, nbytes: int) -> None:
        if not self._body_left or self._lingering:
            self.data_received(self._shared_read[:nbytes])  # type: ignore[arg-type] - httptools takes any buffer
            return
        sink = self._sink
        if sink is not None:
            if self._into_room:
                sink.took(nbytes)
            else:
                sink.feed(self._shared_read[:nbytes])
        self._body_left -= nbytes
        self._last_read = now = self.loop.time()
        if self._body_left:
            self._watch_at(now + self.limits.body_timeout_s)
        else:  # the parser waits for bytes it will never see: the next request gets a fresh one
            self._input_done = not self.parser.should_keep_alive()  # (the old parser knows from the head)
            self.parser = self._new_parser()
            self.on_message_complete()

    def _new_parser(self) -> httptools.HttpRequestParser:
        """A parser as uvicorn makes one (``HttpToolsProtocol.__init__``)."""
        parser = httptools.HttpRequestParser(self)
        try:
            parser.set_dangerous_leniencies(lenient_data_after_close=True)
        except AttributeError:  # httptools < 0.6.3, as uvicorn allows
            pass
        return parser

    def data_received(self, data: bytes) -> None:
        """uvicorn's, counting and timing the head, and dropping what a refused request still sends
        (and what follows a request that ends the connection)."""
        if self._lingering or self._input_done:
            return
        self._unset_keepalive_if_required()
        self._last_read = now = self.loop.time()
        if self._in_head and not self._head_deadline:
            self._start_head(now)  # (also when the first bytes are only line ends)
        self._fed, self._began = len(data), False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self._lingering or self._input_done or self.transport.is_closing():
                return  # refused or ended in a callback (_StopParsing)
            self._unparsable()
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if self._in_head and self._head_deadline:
            self._head_max += len(data)
            if not self._began:
                self._head_min += len(data)
                if self._head_min > self.limits.max_header_bytes:
                    self._head_too_large(self._head_min)
        elif self._in_body:
            self._watch_at(now + self.limits.body_timeout_s)
            if self._chunks and not self._began:  # (a read a request began in is bounded by READ_BYTES)
                self._framing += len(data)  # (on_body takes the data back out)
                if self._framing > 2 * self.limits.max_header_bytes + CHUNK_FRAMING_BYTES * self._chunks:
                    self._too_much_framing()

    # -- parser callbacks ------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._began = True
        self._chunks = self._framing = 0
        self._head_min = self._head_max = 0
        if not self._head_deadline:
            self._start_head(self.loop.time())

    def on_headers_complete(self) -> None:
        limit = self.limits.max_header_bytes
        if self._head_max + self._fed > limit:  # it may be too large: measure what was parsed
            size = len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers) + 16
            if size > limit:
                self._head_too_large(size)
                raise _StopParsing
        if len(self.pipeline) >= MAX_PIPELINED:
            self._end_input()
            raise _StopParsing
        if self._unknown_transfer_coding():
            raise _StopParsing
        self._in_head, self._in_body = False, True
        self._head_deadline = 0.0
        previous = self.cycle
        super().on_headers_complete()
        cycle = self.cycle  # (the new request's, started or queued behind an answer; none for an upgrade)
        if cycle is not None and cycle is not previous and cycle.scope["http_version"] == "1.0" \
                and _asks_keep_alive(cycle.scope["headers"]):
            _keep_alive_for_http10(cycle)  # (now: an end of input decided later still ends it)
        self.scope[BODY_SINK] = self._take_body  # type: ignore[typeddict-unknown-key]
        self.scope[ONE_WRITE] = self._one_write  # type: ignore[typeddict-unknown-key]

    def on_header(self, name: bytes, value: bytes) -> None:
        """A header field; in a chunked body, a trailer field, which is dropped: taken into the
        head, it would pass for a header the client never sent there (a restricted API's key,
        Inference-Header-Content-Length) past anything that checked the head."""
        if self._in_head:
            super().on_header(name, value)

    def on_body(self, body: bytes) -> None:
        self._framing -= len(body)
        super().on_body(body)

    def _too_much_framing(self) -> None:
        """A chunked body carried more than its chunks' framing and a head's worth of trailers:
        refused as a head too large is (counted after a read was parsed: nothing to stop)."""
        limit = self.limits.max_header_bytes
        self._warn("framing", "refused a chunked body whose sizes, extensions and trailers passed %d bytes "
                              "(--http-max-header-bytes %d)", self._framing, limit)
        self._refuse_body(431, f"the chunked request's framing and trailers of at least {self._framing} bytes "
                               f"exceed the limit of {limit} bytes (--http-max-header-bytes)")

    def _unparsable(self) -> None:
        """Bytes the parser refused. In a body, the request they belong to is refused (400).
        Between requests, after requests still to be answered (a bad pipelined request, or a
        body longer than its ``Content-Length``), those answers go out first: the input ends and
        the last of them closes the connection, as Triton answers them and closes (no 400 can go
        between them). With nothing to answer, a 400 ends the connection."""
        msg = "Invalid HTTP request received."
        self._warn("unparsable", msg)
        if self._in_body:
            self._refuse_body(400, msg)
        elif self.pipeline or self._answer_in_progress():
            self._input_done = True
            last = self.pipeline[0][0] if self.pipeline else self.cycle  # (appendleft: the newest queued is first)
            last.keep_alive = False
        else:
            self.send_400_response(msg)

    def send_400_response(self, msg: str) -> None:
        """A request the parser refused (uvicorn's answer is plain text): as every refusal here, a
        JSON ``{"error": ...}`` with ``connection: close``."""
        body = orjson.dumps({"error": msg})
        self.transport.write(b"%scontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
                             % (STATUS_LINE[400], len(body), body))
        self.transport.close()

    def _unknown_transfer_coding(self) -> bool:
        """Whether the head names a transfer coding besides ``chunked`` (``gzip, chunked``, say),
        which the parser would read as plain chunked: refused with 501 (RFC 9112 6.1), as the
        body could not be read as the client meant it."""
        for name, value in self.headers:
            if name == b"transfer-encoding":
                codings = [c.strip() for c in value.lower().split(b",")]
                if codings != [b"chunked"]:
                    if self._answer_in_progress():  # no answer can go in between: just close
                        self._lingering = True
                        self.transport.close()
                        return True
                    self._refuse(501, f"the transfer coding {value.decode('latin-1')!r} is not implemented "
                                      f"(only chunked is)")
                    return True
        return False

    def _end_input(self) -> None:
        """Past ``MAX_PIPELINED`` requests behind the one being answered: drop the rest of the input
        and close once those queued are answered (the last of them ends the connection)."""
        self._warn("pipeline", "a connection pipelined more than %d requests behind an answer: the rest of its "
                               "input is dropped and it is closed after their answers", MAX_PIPELINED)
        self._input_done = True
        self.pipeline[0][0].keep_alive = False  # (appendleft: the newest queued is first)

    def _take_body(self, sink: BodySink | None) -> None:
        """Read the rest of the body in progress into ``sink`` (``BODY_SINK``), past the parser.
        Called by the application right after a ``receive`` that said more is coming, with no
        await between: the body the parser is in is that request's, and all of it read so far
        was parsed. None (the application stopped early): the rest is read and dropped, which
        keeps the next request's bytes where they start."""
        if sink is not None and not self._body_left:
            self._body_left = sink.left()
        self._sink = sink

    def on_chunk_header(self) -> None:
        """Count a chunked body's chunks: past ``MAX_CHUNKS`` non-empty ones (the one more is the
        empty last chunk) the request is refused as Triton refuses it, and the rest is dropped."""
        self._chunks += 1
        if self._chunks <= MAX_CHUNKS + 1:
            return
        self._warn("chunks", "refused a chunked body of more than %d chunks", MAX_CHUNKS)
        self._refuse_body(400, f"Chunked request body exceeds maximum of {MAX_CHUNKS} non-empty chunks. Send fewer "
                               f"or larger HTTP chunks.")
        raise _StopParsing

    def _refuse_body(self, status: int, message: str) -> None:
        """Refuse the request whose body is being read: the application reads no more of it and
        answers nothing. Where an answer is already going out (an earlier pipelined request's,
        or this one's), nothing can be written in between: the connection is just closed."""
        cycle = self.cycle
        if self.pipeline or (cycle is not None and cycle.response_started):
            self._lingering = True
            self.transport.close()
            return
        if cycle is not None:
            cycle.disconnected = True
            cycle.message_event.set()
        self._refuse(status, message)

    def on_message_complete(self) -> None:
        self._in_head, self._in_body = True, False
        self._sink, self._body_left = None, 0
        super().on_message_complete()
        cycle = self.cycle
        if cycle is not None and cycle.response_complete and self.timeout_keep_alive_task is None \
                and not self.pipeline and not self.transport.is_closing():
            # the rest of a body answered before it came was dropped: idle from now on
            self._idle_since = time.monotonic()
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        self._cycle_transport.forget()
        cycle.transport = self._cycle_transport  # type: ignore[assignment]
        super()._start_asgi_task(cycle, app)

    def on_response_complete(self) -> None:
        self._idle_since = time.monotonic()
        super().on_response_complete()  # (arms the keep-alive timeout, or starts a pipelined request)
        if self.pipeline and not self.transport.is_closing():
            self.flow.pause_reading()  # (uvicorn resumed it: not while requests are still queued)
        if self._lingering:
            self._unset_keepalive_if_required()  # the linger ends it
        elif self._answered_early() and not self.transport.is_closing():
            if self._rest_is_bounded():
                self._unset_keepalive_if_required()  # not idle while the rest comes (on_message_complete)
            else:
                self._linger(LINGER_S)

    # -- ending a connection ---------------------------------------------------------------------
    def end(self) -> None:
        """Close after an answer: at once, or lingering if the request's body is still coming."""
        if self._answered_early():
            self._linger(LINGER_S)
        else:
            self.transport.close()

    def _answered_early(self) -> bool:
        cycle = self.cycle
        return self._in_body and cycle is not None and cycle.response_complete

    def _rest_is_bounded(self) -> bool:
        """The body in progress declared a length of at most ``DISCARD_MAX_BYTES``, and its client
        did not ask for a ``100 Continue`` (answered early, it may send no body at all, and then
        its next request would be read as this body): dropping the rest keeps the connection at a
        bounded cost (the body timeout still applies)."""
        if self.expect_100_continue:  # (the request in progress's: reset as the next one begins)
            return False
        declared = next((value for name, value in self.headers if name == b"content-length"), None)
        return declared is not None and declared.isdigit() and int(declared) <= DISCARD_MAX_BYTES

    def _linger(self, seconds: float) -> None:
        """Read and drop what the client still sends for up to ``seconds``, then close (earlier if
        the client closes its side). Our side is shut once the answer is out: the client sees the end."""
        if self._lingering:
            return
        self._lingering = True
        self._unset_keepalive_if_required()
        self.flow.resume_reading()
        transport = self.transport
        if not transport.is_closing() and transport.can_write_eof():
            transport.write_eof()
        self._cancel_watch()
        self._watch = self.loop.call_later(min(seconds, self.limits.body_timeout_s), transport.close)

    def _refuse(self, status: int, message: str, linger_s: float = LINGER_S) -> None:
        if self.transport.is_closing():
            return
        body = orjson.dumps({"error": message})
        self.transport.write(b"%scontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
                             % (STATUS_LINE[status], len(body), body))
        self._linger(linger_s)

    def _answer_in_progress(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _head_too_large(self, size: int) -> None:
        self._warn("head", "refused a request head of at least %d bytes (--http-max-header-bytes %d)", size,
                   self.limits.max_header_bytes)
        if self._answer_in_progress():
            self._lingering = True  # no answer can go in between: just close
            self.transport.close()
            return
        self._refuse(431, f"the request head of at least {size} bytes exceeds the limit of "
                          f"{self.limits.max_header_bytes} bytes (--http-max-header-bytes)")

    # -- the head and body timeouts --------------------------------------------------------------
    def _start_head(self, now: float) -> None:
        self._head_deadline = now + self.limits.header_timeout_s
        self._watch_at(self._head_deadline)

    def _watch_at(self, when: float) -> None:
        """Have ``_on_watch`` run at ``when`` at the latest (a timer due earlier stays: it re-arms)."""
        watch = self._watch
        if watch is not None:
            if watch.when() <= when:
                return
            watch.cancel()
        self._watch = self.loop.call_at(when, self._on_watch)

    def _cancel_watch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    def _on_watch(self) -> None:
        self._watch = None
        if self._lingering or self.transport.is_closing():
            return
        now = self.loop.time()
        limits = self.limits
        if self._in_head and self._head_deadline:
            if self._answer_in_progress():  # not the client's time: a request ahead is being answered
                self._head_deadline = max(self._head_deadline, now + limits.header_timeout_s)
            elif now >= self._head_deadline:
                self._warn("head-timeout", "closed a connection whose request head took over %g s "
                                           "(--http-header-timeout-secs)", limits.header_timeout_s)
                self._refuse(408, f"the request head was not complete within {limits.header_timeout_s:g} s "
                                  f"(--http-header-timeout-secs)")
                return
            self._watch_at(self._head_deadline)
        elif self._in_body:
            if self.flow.read_paused:  # the frontend stopped reading, not the client sending
                self._last_read = now
            due = self._last_read + limits.body_timeout_s
            if now < due:
                self._watch_at(due)
                return
            self._body_timed_out()

    def _body_timed_out(self) -> None:
        limits = self.limits
        self._warn("body-timeout", "closed a connection whose request body stalled for %g s "
                                   "(--http-body-timeout-secs)", limits.body_timeout_s)
        cycle = self.cycle
        if cycle is None or cycle.response_started:
            self._lingering = True
            self.transport.close()
            return
        cycle.disconnected = True  # the request's reader sees the client gone and lets go of it
        cycle.message_event.set()
        self._refuse(408, f"no part of the request body arrived for {limits.body_timeout_s:g} s "
                          f"(--http-body-timeout-secs)")

    # -- the send timeout ------------------------------------------------------------------------
    def pause_writing(self) -> None:
        """The transport holds more of our answers than its high-water mark: the client reads more
        slowly than we write. From now on it must read some every ``send_timeout_s``."""
        super().pause_writing()
        if self._send_watch is None:
            self._unsent, self._drained = self._unsent_bytes(), False
            self._send_watch = self.loop.call_later(self.limits.send_timeout_s, self._on_send_watch)

    def _unsent_bytes(self) -> int:
        """What the transport holds, and what the kernel holds that the client has not taken
        (``SIOCOUTQ``): the transport gives the kernel more only once a good part of its buffer
        is free, so a client that reads steadily empties the kernel's long before ours moves."""
        unsent = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        try:
            got = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")  # (SIOCOUTQ)
        except (AttributeError, OSError):
            return unsent
        return unsent + int.from_bytes(got, "little")

    def resume_writing(self) -> None:
        """The transport's buffer fell below its low-water mark: the client read."""
        super().resume_writing()
        self._drained = True

    def _on_send_watch(self) -> None:
        """No byte read over ``send_timeout_s`` (the transport neither resumed us nor held fewer
        bytes than at the last look; more written since, a later answer's, is not progress):
        the connection is cut (not closed, which would wait for them to go) and what the
        transport held is freed. Its own timer, apart from ``_watch``: a closing connection's
        answer may wait unread too."""
        self._send_watch = None
        if not self.transport.get_write_buffer_size():
            return  # all handed to the kernel: armed again if the transport pauses us again
        unsent = self._unsent_bytes()
        if self._drained or unsent < self._unsent:  # the client read some meanwhile
            self._unsent, self._drained = unsent, False
            self._send_watch = self.loop.call_later(self.limits.send_timeout_s, self._on_send_watch)
            return
        self._warn("send-timeout", "cut a connection whose client read none of its answer for %g s, %d bytes unsent "
                                   "(--http-send-timeout-secs)", self.limits.send_timeout_s, unsent)
        cycle = self.cycle
        if cycle is not None:
            cycle.disconnected = True  # an answer still being made sees its client gone
            cycle.message_event.set()
        self._lingering = True
        self.transport.abort()

    @classmethod
    def _warn(cls, kind: str, msg: str, *args: Any) -> None:
        """A limit refused or cut something: counted by ``kind`` (the edge metrics), said in the
        log at most once every ``WARN_EVERY_S`` per kind."""
        cls.edge.refused(kind)
        now = time.monotonic()
        if now - cls._warned.get(kind, -WARN_EVERY_S) >= WARN_EVERY_S:
            cls._warned[kind] = now
            log.warning(msg, *args)


class NameKeepingHttpProtocol(LimitedHttpProtocol):
    """``LimitedHttpProtocol`` that also keeps each header's name as the client sent it (uvicorn
    lowers them) under ``scope[RAW_HEADER_NAMES]``, in the order of ``scope["headers"]``: a
    forwarded header reaches the model named as sent, as in Triton (header_forward.py). Used
    only under --http-header-forward-pattern."""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[RAW_HEADER_NAMES] = self._raw_names = []  # type: ignore[typeddict-unknown-key]

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._in_head:  # (a trailer is dropped)
            self._raw_names.append(name)
        super().on_header(name, value)


class BufferedConnection(asyncio.BufferedProtocol):
    """What the loop sees of a connection: a ``BufferedProtocol`` around its HTTP protocol.
    uvloop reads into a protocol's own buffers only if it is not an ``asyncio.Protocol``, which
    uvicorn's protocol is; the HTTP protocol's methods are bound here, so no call goes through
    this object on the way."""

    http_class: type[LimitedHttpProtocol] = LimitedHttpProtocol  # set per frontend by ``protocol_class``

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.http = http = self.http_class(*args, **kwargs)
        self.connection_made = http.connection_made  # type: ignore[method-assign]
        self.connection_lost = http.connection_lost  # type: ignore[method-assign]
        self.eof_received = http.eof_received  # type: ignore[method-assign]
        self.pause_writing = http.pause_writing  # type: ignore[method-assign]
        self.resume_writing = http.resume_writing  # type: ignore[method-assign]
        self.get_buffer = http.get_buffer  # type: ignore[method-assign]
        self.buffer_updated = http.buffer_updated  # type: ignore[method-assign]


def protocol_class(limits: HttpLimits, max_connections: int, edge: EdgeCounts | None = None,
                   keep_header_names: bool = False) -> type[BufferedConnection]:
    """The protocol uvicorn builds per connection (``uvicorn.Config(http=...)``), with these
    limits, counting into ``edge``; ``keep_header_names``: one that keeps the names as sent
    (``NameKeepingHttpProtocol``)."""
    base = NameKeepingHttpProtocol if keep_header_names else LimitedHttpProtocol
    http = type("FrontendHttpProtocol", (base,), {"limits": limits, "max_connections": max_connections,
                                                  "edge": edge or EdgeCounts("http"), "_warned": {}})
    return type("FrontendHttpConnection", (BufferedConnection,), {"http_class": http})
