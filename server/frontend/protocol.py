"""uvicorn's httptools protocol with POST .../infer answered by the protocol itself.

Through ASGI, uvicorn builds a scope, a task, receive/send message dicts and writes the status line
with its headers and the body in two ``send`` calls: two socket writes per answer, and the first
one wakes the client only for it to wait for the second. Here an infer request is parsed from the
parser callbacks, submitted from ``on_message_complete`` with a callback (no task, no future) and
answered with one write. Every other request goes through the normal ASGI cycle, and requests of
both kinds share uvicorn's pipeline queue, so pipelined answers keep their order.

A client in a closed loop sends the same request head (method, path, headers) every time, and each
request arrives in one read. A connection keeps the head of its last such request, byte for byte,
with what the parser made of it; a read that holds exactly one request starting with those bytes,
arriving between messages, is started without the parser and its eight callbacks: the same bytes
parse to the same request. Anything else (another head, a partial or pipelined read, a request
still unanswered) goes through the parser.
"""
from __future__ import annotations

import asyncio
import os
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from shmserve.shm.protocol import SENT_ALL

from .app import Frontend, infer_target
from .ingest import HOLD_S, BodyIngest, header_length
from .known import http_head

# Whether workers may write successful small answers to the HTTP client themselves (a direct answer).
DIRECT_ANSWERS = os.environ.get("SHMSERVE_DIRECT_HTTP_ANSWERS", "1") != "0"

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
JOIN_LIMIT = 1 << 16  # smaller bodies are copied behind the head: one write, one buffer


class _NoEvent:
    """Stands in for the ASGI cycle's message event, which uvicorn sets on disconnect."""

    @staticmethod
    def set() -> None:
        pass


class InferCycle:
    """One infer request on a connection: what uvicorn's code reads of a RequestResponseCycle
    (``response_complete``, ``disconnected``, ``keep_alive``, ``message_event``) plus its body."""

    __slots__ = ("model", "version", "headers", "keep_alive", "expect_continue", "body", "complete", "turn",
                 "started", "response_complete", "disconnected", "head_len", "buffered", "ingest", "hold",
                 "direct_slot", "reply")
    message_event = _NoEvent()

    def __init__(self, model: str, version: str, headers: dict[bytes, bytes], keep_alive: bool,
                 expect_continue: bool, head_len: int | None = None) -> None:
        self.model = model
        self.version = version
        self.headers = headers
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.body: list[bytes] = []
        self.complete = False  # the whole body is in
        self.turn = False  # every earlier request on the connection is answered
        self.started = False
        self.response_complete = False
        self.disconnected = False
        # > 0: a large binary body, taken in as it comes
        self.head_len = header_length(headers) if head_len is None else head_len
        self.buffered = 0  # bytes in ``body``, until the JSON header is in
        self.ingest: BodyIngest | None = None
        self.hold: Any = None  # the timer that moves a slow body out of its reserved block
        self.direct_slot = -1  # the request's slot, if its worker may answer the client itself
        self.reply: Any = None  # its answer's way out (``InferProtocol._start``)

    def take_ingest(self) -> BodyIngest | None:
        """The body's reserved block, handed over (its hold timer stopped)."""
        if self.hold is not None:
            self.hold.cancel()
            self.hold = None
        ingest, self.ingest = self.ingest, None
        return ingest

    def drop_ingest(self) -> None:
        ingest = self.take_ingest()
        if ingest is not None:
            ingest.discard()


class InferProtocol(HttpToolsProtocol):
    """Set ``frontend`` on a subclass (``protocol_for``) before uvicorn instantiates it."""

    frontend: Frontend
    restricted: tuple[bytes, bytes] | None = None  # --http-restricted-api for group 'inference'

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._feeding = False
        self._starting = False
        self._between = True  # the parser sits between messages (none partly fed)
        self._begun = 0  # messages begun in the read being parsed
        self._seen_head = b""  # the head of the last infer request that came in one read
        self._seen: tuple[str, str, dict[bytes, bytes]] | None = None  # what it parsed to (kept alive)
        self._seen_read = -1  # the length of a read holding one such request
        # (status, body length, headers, head) of the last answer
        self._kept_head: tuple[int, int, list, bytes] | None = None
        self._idle_since = 0.0  # loop time of the last infer answer (for the keep-alive timeout)
        self._socket: tuple[int, int] | None = None  # (descriptor, inode), if workers may answer on it

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if DIRECT_ANSWERS and self.scheme == "http" and sock is not None:
            try:
                fd = sock.fileno()
                self._socket = (fd, os.fstat(fd).st_ino)
            except (OSError, ValueError):
                pass

    def _hear_of(self, cycle: Any) -> None:
        """A request arrived behind ``cycle``: if its worker answers the client itself, learn of
        the answer now if it came, else have the worker wake the loop when it does (it would
        not otherwise, and the request behind would wait for the next look)."""
        if type(cycle) is InferCycle and cycle.direct_slot >= 0 and not cycle.response_complete:
            self.frontend.link.reap(cycle.direct_slot)

    def data_received(self, data: bytes) -> None:
        if len(data) == self._seen_read and self._between and data.startswith(self._seen_head):
            last = self.cycle
            if type(last) is InferCycle and last.direct_slot >= 0 and not last.response_complete \
                    and self._rerun(last, data):
                return
            self._hear_of(last)  # (a client sends its next request once it has the answer)
            if self._repeat(data):
                return
        else:
            self._hear_of(self.cycle)
        self._feeding = True
        self._begun = 0
        whole = self._between  # the read starts a message: it may be one whole request
        try:
            super().data_received(data)
        finally:
            self._feeding = False
        cycle = self.cycle
        if type(cycle) is InferCycle:
            self._continue(cycle)
            if whole and self._begun == 1 and cycle.complete and self._between and len(data) <= JOIN_LIMIT:
                self._learn(cycle, data)

    def _learn(self, cycle: InferCycle, data: bytes) -> None:
        """Keep the head of a request that was the whole of one read, for ``_repeat``."""
        headers = cycle.headers
        head_len = len(data) - int(headers[b"content-length"])
        # The head ends at the first blank line: the body's length, counted from the end, must
        # land there (no stray bytes around the request, no chunked body).
        if cycle.keep_alive and not cycle.expect_continue and b"transfer-encoding" not in headers \
                and head_len > 4 and data.find(b"\r\n\r\n") == head_len - 4:
            self._seen_head = data[:head_len]
            self._seen = (cycle.model, cycle.version, headers)
            self._seen_read = len(data)

    def _repeat(self, data: bytes) -> bool:
        """Start a read that is one request with the kept head, as the parser would have; False if
        the connection's state asks for the parser (an unanswered request, tracing turned on)."""
        cycle = self.cycle
        if (cycle is not None and not cycle.response_complete) or self.frontend.tracer.on or self._seen is None:
            return False
        model, version, headers = self._seen  # (the keep-alive timer runs on: _keep_alive_due)
        cycle = InferCycle(model, version, headers, True, False, -1)  # (small: joined, not taken in)
        cycle.turn = cycle.complete = True
        cycle.body.append(data[len(self._seen_head):])
        self.cycle = cycle  # type: ignore[assignment]
        self._start(cycle)
        return True

    def _rerun(self, last: InferCycle, data: bytes) -> bool:
        """``_repeat`` behind a direct request nobody has completed: if its worker answered it
        whole, this one goes in its slot and block (``Inference.rerun``), and the last one is over
        without a completion. Its cycle and reply go on to the new request (a reply reads only
        the cycle's state, and both requests are kept alive). False, with nothing done, otherwise."""
        if self.frontend.tracer.on or self._seen is None or self.transport.get_write_buffer_size():
            return False
        model, version, headers = self._seen
        self._starting = True  # (a refusal is answered from the loop: see _reply)
        try:
            slot = self.frontend.rerun_infer(model, version, headers, data[len(self._seen_head):], last.reply,
                                             last.direct_slot, self._socket)
        finally:
            self._starting = False
        if slot == -1:
            return False
        last.model, last.version, last.headers = model, version, headers
        last.direct_slot = max(slot, -1)
        self._answered()  # the last request's (its worker wrote the whole answer)
        return True

    def _continue(self, cycle: InferCycle) -> None:
        """Answer ``Expect: 100-continue`` once the request's turn has come and its body is missing."""
        if cycle.turn and not cycle.complete and cycle.expect_continue:
            cycle.expect_continue = False
            if not self.transport.is_closing():
                self.transport.write(CONTINUE)

    # -- parser callbacks -----------------------------------------------------------------------
    def on_message_begin(self) -> None:
        # The ASGI scope is built only for requests that go to the app (``_asgi_scope``).
        self._between = False
        self._begun += 1
        self.url = b""
        self.expect_100_continue = False
        self.headers = []

    def _ours(self, headers: dict[bytes, bytes]) -> bool:
        """Whether this infer request may skip the ASGI app: not traced, a declared length within
        --http-max-input-size (the app refuses the rest before reading it), and the header of a
        restricted ``inference`` group present (the app answers 403 otherwise)."""
        fe = self.frontend
        length = headers.get(b"content-length")
        if fe.tracer.on or length is None or not length.isdigit() or int(length) > fe.max_input_bytes:
            return False
        return self.restricted is None or headers.get(self.restricted[0]) == self.restricted[1]

    def on_headers_complete(self) -> None:
        self._hear_of(self.cycle)  # a request behind a direct answer, in the same read
        parser = self.parser
        if parser.get_method() == b"POST" and self.limit_concurrency is None and not parser.should_upgrade():
            target = infer_target(self.url)
            headers = dict(self.headers) if target is not None else {}
            if target is not None and self._ours(headers):
                keep_alive = parser.get_http_version() != "1.0" and parser.should_keep_alive()
                cycle = InferCycle(target[0], target[1], headers, keep_alive, self.expect_100_continue)
                existing = self.cycle
                self.cycle = cycle  # type: ignore[assignment]
                if existing is None or existing.response_complete:
                    cycle.turn = True
                else:  # pipelined behind an unanswered request: uvicorn's queue starts it in order
                    self.flow.pause_reading()
                    self.pipeline.appendleft((cycle, None))  # type: ignore[arg-type]
                return
        self._asgi_scope()
        super().on_headers_complete()

    def _asgi_scope(self) -> None:
        url, headers, expect = self.url, self.headers, self.expect_100_continue
        HttpToolsProtocol.on_message_begin(self)
        self.url, self.expect_100_continue = url, expect
        self.headers.extend(headers)  # the scope holds this same list

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if type(cycle) is InferCycle:
            if cycle.ingest is not None:
                cycle.ingest.feed(body)
            elif not cycle.response_complete:
                cycle.body.append(body)
                if cycle.head_len > 0:
                    cycle.buffered += len(body)
                    if cycle.buffered >= cycle.head_len:
                        self._begin_ingest(cycle)
            return
        super().on_body(body)

    def _begin_ingest(self, cycle: InferCycle) -> None:
        """The JSON header of a large binary body is in: reserve its block and copy the rest there."""
        n, cycle.head_len = cycle.head_len, -1
        joined = b"".join(cycle.body)
        tail_len = int(cycle.headers[b"content-length"]) - n
        ingest = self.frontend.begin_ingest(cycle.model, cycle.version, joined[:n], tail_len)
        if ingest is None:
            cycle.body = [joined]
            return
        ingest.feed(memoryview(joined)[n:])
        cycle.body = []
        cycle.ingest = ingest
        cycle.hold = self.loop.call_later(HOLD_S, self._release_hold, cycle)

    def _release_hold(self, cycle: InferCycle) -> None:
        """A body still arriving, or waiting for its turn, after HOLD_S: out of its block."""
        cycle.hold = None
        if cycle.ingest is not None:
            cycle.body = [cycle.ingest.evacuate()]
            cycle.ingest = None

    def connection_lost(self, exc: Exception | None) -> None:
        for cycle in [self.cycle, *(c for c, _ in self.pipeline)]:
            if type(cycle) is InferCycle:
                cycle.drop_ingest()
        super().connection_lost(exc)

    def on_message_complete(self) -> None:
        self._between = True
        cycle = self.cycle
        if type(cycle) is InferCycle:
            cycle.complete = True
            if cycle.turn:
                self._start(cycle)
            return
        super().on_message_complete()

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        if type(cycle) is InferCycle:  # its turn came in uvicorn's pipeline queue
            cycle.turn = True
            if cycle.complete:
                self._start(cycle)
            else:
                self._continue(cycle)
            return
        super()._start_asgi_task(cycle, app)

    # -- inference ------------------------------------------------------------------------------
    def _start(self, cycle: InferCycle) -> None:
        if cycle.started or cycle.response_complete:
            return
        cycle.started = True
        reply = cycle.reply = lambda status, out, headers, sent=0: self._reply(cycle, status, out, headers, sent)  # noqa: E731
        ingest = cycle.take_ingest()
        self._starting = True
        try:
            if ingest is not None:
                self.frontend.finish_ingest(cycle.model, cycle.version, cycle.headers, ingest, reply)
            else:
                chunks = cycle.body
                body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                cycle.body = []
                # Only while nothing else is due on the socket: no write of ours pending, and a
                # plain answer (not compressed, the connection kept).
                # (``find``, not ``in``: on bytes, ``in`` first tries its operand as an integer,
                # and the TypeError it formats and drops was 3% of the loaded frontend's samples.)
                accept = cycle.headers.get(b"accept-encoding", b"")
                plain = not accept or (accept.find(b"gzip") < 0 and accept.find(b"deflate") < 0)
                socket = self._socket if cycle.keep_alive and plain \
                    and not self.transport.get_write_buffer_size() else None
                cycle.direct_slot = self.frontend.start_infer(cycle.model, cycle.version, cycle.headers, body, reply,
                                                              socket=socket)
                if self.pipeline:  # requests wait behind it
                    self._hear_of(cycle)
        finally:
            self._starting = False

    def _reply(self, cycle: InferCycle, status: int, body: bytes | memoryview, headers: list[tuple[bytes, bytes]],
               sent: int = 0) -> None:
        """Write the answer, but for the ``sent`` bytes of it its worker wrote already (SENT_ALL: all)."""
        if self._feeding or self._starting:
            # Answered at once (a bad request): not from inside the parser's callbacks, and not as a
            # recursion through uvicorn's pipeline queue.
            self.loop.call_soon(self._reply, cycle, status, body, headers, sent)
            return
        if cycle.response_complete:
            return
        cycle.response_complete = True
        transport = self.transport
        if cycle.disconnected or transport.is_closing():
            return
        if 0 < sent != SENT_ALL and status != 200:
            # The worker wrote the start of an answer whose rest is lost (its arena went with it):
            # the connection cannot carry anything sound any more.
            transport.close()
            return
        if sent != SENT_ALL:
            self._write(cycle, status, body, headers, sent)
        if not cycle.keep_alive:  # (a direct answer's connection may have been told to close since)
            transport.close()
        self._answered()

    def _write(self, cycle: InferCycle, status: int, body: bytes | memoryview, headers: list[tuple[bytes, bytes]],
               sent: int) -> None:
        transport = self.transport
        # A worker that wrote the start of it wrote a keep-alive head, whatever was decided since
        # (a graceful shutdown asks to close): the rest must follow that head.
        keep_alive = cycle.keep_alive or sent > 0
        kept = self._kept_head  # a closed-loop client's answers repeat their head too
        if kept is not None and kept[0] == status and kept[1] == len(body) and keep_alive and \
                (kept[2] is headers or kept[2] == headers):
            head = kept[3]
        else:
            head = http_head(STATUS_LINE[status], headers, len(body), keep_alive)
            if keep_alive:
                self._kept_head = (status, len(body), headers, head)
        if sent:  # the worker wrote the start of it (its socket's buffer was full)
            transport.write((head + bytes(body))[sent:])
        elif len(body) < JOIN_LIMIT:
            transport.write(head + body)
        else:  # one writev, no copy of a large body
            transport.writelines([head, body])

    def _answered(self) -> None:
        """uvicorn's ``on_response_complete``, but with the keep-alive timer armed once per idle
        spell instead of cancelled and armed again around every request: when it fires, it
        closes the connection only if that has been idle for the whole timeout."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            self._unset_keepalive_if_required()
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_since = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self._keep_alive_due)

    def _keep_alive_due(self) -> None:
        self.timeout_keep_alive_task = None
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            return  # a request in flight: its answer arms the timer again
        left = self._idle_since + self.timeout_keep_alive - self.loop.time()
        if left > 0:
            self.timeout_keep_alive_task = self.loop.call_later(left, self._keep_alive_due)
        else:
            self.timeout_keep_alive_handler()


def protocol_for(frontend: Frontend, restricted: Any = None) -> type[InferProtocol]:
    """The protocol class uvicorn instantiates per connection, bound to this process's frontend
    (and to the header the ``inference`` group needs, if restricted: (name, value))."""
    rule = (restricted[0].lower().encode("latin-1"), restricted[1].encode("latin-1")) if restricted else None
    return type("BoundInferProtocol", (InferProtocol,), {"frontend": frontend, "restricted": rule})
