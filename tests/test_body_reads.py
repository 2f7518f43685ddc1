"""A body taken past the parser (server/frontend/protocol.py, ``BODY_SINK``): the connection reads
it straight into the sink's room, reads no byte past its end, and parses what follows as the next
request; a sink dropped half-way has the rest of its body read and thrown away, and the connection
still serves the next request; after a request that ends the connection (``Connection: close``,
HTTP/1.0) whatever follows its body is dropped, as uvicorn's parser drops it, and the request is
answered.

The frontend's protocol runs here under uvicorn and uvloop, as the frontend runs it, with an app of
the test's own that takes the body with a sink recording how each byte came; clients are plain
sockets sending a large body and a second request in one write, so that both lie in the socket
together.
"""
from __future__ import annotations

import hashlib
import json
import socket
import threading
from typing import Any, Iterator

import pytest
import uvicorn

from conftest import free_ports, read_raw_response
from shmserve.server.frontend.limits import HttpLimits
from shmserve.server.frontend.protocol import BODY_SINK, protocol_class

BODY = bytes(range(256)) * (3 << 12)  # 3 MiB: many socket reads
FIRST = 1 << 10  # what the app receives the ordinary way before it gives its sink


class RecordingSink:
    """A ``BodySink`` over a bytearray, counting the bytes read into its room and those fed."""

    def __init__(self, left: int) -> None:
        self.data = bytearray(left)
        self.pos = self.took_bytes = self.fed_bytes = self.rooms = 0

    def left(self) -> int:
        return len(self.data) - self.pos

    def room(self) -> memoryview | None:
        self.rooms += 1
        return memoryview(self.data)[self.pos:]

    def took(self, n: int) -> None:
        self.pos += n
        self.took_bytes += n

    def feed(self, chunk: memoryview) -> None:
        self.data[self.pos:self.pos + len(chunk)] = chunk
        self.pos += len(chunk)
        self.fed_bytes += len(chunk)


async def app(scope: dict, receive: Any, send: Any) -> None:
    """/sink: take the body past FIRST bytes with a sink; /drop: give the sink and take it back at
    once; anything else: read the body the ordinary way. Answers what came, as JSON."""
    if scope["type"] != "http":
        return
    declared = int(dict(scope["headers"])[b"content-length"])
    got, sink, more = bytearray(), None, True
    while more:
        message = await receive()
        got += message.get("body", b"")
        more = message.get("more_body", False)
        if more and sink is None and scope["path"] in ("/sink", "/drop") and len(got) >= FIRST:
            sink = RecordingSink(declared - len(got))
            scope[BODY_SINK](sink)
            if scope["path"] == "/drop":
                scope[BODY_SINK](None)
    whole = bytes(got) + (bytes(sink.data[:sink.pos]) if sink is not None else b"")
    answer = json.dumps({"sha": hashlib.sha256(whole).hexdigest(), "length": len(whole),
                         "parsed": len(got), "took": sink.took_bytes if sink else 0,
                         "fed": sink.fed_bytes if sink else 0}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(answer))]})
    await send({"type": "http.response.body", "body": answer})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    (port,) = free_ports(1)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, loop="uvloop", http=protocol_class(HttpLimits(), 100),
                            lifespan="off", log_level="warning", log_config=None)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "uvicorn did not start"
        threading.Event().wait(0.01)
    yield port
    server.should_exit = True
    thread.join(10)
    assert not thread.is_alive()


def request(path: str, body: bytes, version: bytes = b"1.1", headers: bytes = b"") -> bytes:
    return b"POST %s HTTP/%s\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n%s" % (
        path.encode(), version, len(body), headers, body)


def answers(port: int, *requests: bytes) -> list[dict]:
    """Send ``requests`` in one write on one connection; their answers, in order."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"".join(requests))
        reader = sock.makefile("rb")
        out = []
        for _ in requests:
            status, _, body = read_raw_response(reader)
            assert status == 200, body[:300]
            out.append(json.loads(body))
        return out


def test_a_body_goes_into_the_sinks_room_and_the_next_request_is_parsed(port):
    small = b"after the large body"
    sunk, after = answers(port, request("/sink", BODY), request("/echo", small))
    assert (sunk["length"], sunk["sha"]) == (len(BODY), hashlib.sha256(BODY).hexdigest())
    assert sunk["parsed"] < len(BODY) // 2  # the parser saw its first reads only
    assert sunk["took"] > 0 and sunk["parsed"] + sunk["took"] + sunk["fed"] == len(BODY)
    assert (after["length"], after["sha"]) == (len(small), hashlib.sha256(small).hexdigest())


def test_bodies_back_to_back_on_one_connection_keep_their_bounds(port):
    bodies = [BODY[:n] for n in (FIRST + 1, 700_000, len(BODY))]
    found = answers(port, *(request("/sink", b) for b in bodies))
    assert [(a["length"], a["sha"]) for a in found] == [(len(b), hashlib.sha256(b).hexdigest()) for b in bodies]


def test_a_sink_dropped_half_way_has_the_rest_read_and_the_connection_goes_on(port):
    small = b"the next request"
    dropped, after = answers(port, request("/drop", BODY), request("/echo", small))
    assert dropped["took"] == dropped["fed"] == 0 and dropped["parsed"] < len(BODY)
    assert (after["length"], after["sha"]) == (len(small), hashlib.sha256(small).hexdigest())


@pytest.mark.parametrize("version, headers", [(b"1.1", b"Connection: close\r\n"), (b"1.0", b"")])
def test_what_follows_a_request_that_ends_the_connection_is_dropped(port, version, headers):
    """Bytes after such a request's body were parsed by a fresh parser as a new request: junk got a
    400 that cut the request's own answer, a head over the limit closed the connection unanswered."""
    for after in (b"JUNK JUNK\r\n\r\n", b"GET / HTTP/1.1\r\nX: " + b"a" * 200_000 + b"\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(request("/sink", BODY, version, headers) + after)
            reader = sock.makefile("rb")
            status, _, body = read_raw_response(reader)
            assert status == 200, body[:300]
            sunk = json.loads(body)
            assert (sunk["length"], sunk["sha"]) == (len(BODY), hashlib.sha256(BODY).hexdigest())
            assert sunk["took"] > 0
            assert reader.read() == b""  # then the connection ends, with nothing more said
