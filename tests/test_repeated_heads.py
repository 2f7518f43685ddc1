"""Requests whose head repeats byte for byte on a connection skip the HTTP parser
(server/frontend/protocol.py), and answers whose head repeats reuse it: whatever path a request
takes, its answer is computed from its own body, in order, with its own status."""
from __future__ import annotations

import json
import socket
import time

import numpy as np

from conftest import read_raw_response

HEAD_FIELDS = "Host: x\r\nUser-Agent: repeated-heads\r\n"


def _add_sub(a: np.ndarray, b: np.ndarray, extra: str = "") -> bytes:
    """One add_sub request, binary inputs and outputs, as a closed-loop client sends it."""
    header = json.dumps({"inputs": [{"name": n, "datatype": "INT32", "shape": [16],
                                     "parameters": {"binary_data_size": 64}} for n in ("INPUT0", "INPUT1")],
                         "outputs": [{"name": n, "parameters": {"binary_data": True}}
                                     for n in ("OUTPUT0", "OUTPUT1")]}).encode()
    body = header + a.tobytes() + b.tobytes()
    return (f"POST /v2/models/add_sub/infer HTTP/1.1\r\n{HEAD_FIELDS}{extra}Content-Length: {len(body)}\r\n"
            f"Inference-Header-Content-Length: {len(header)}\r\n\r\n").encode() + body


def _check(reader, a: np.ndarray, b: np.ndarray) -> None:
    status, headers, body = read_raw_response(reader)
    assert status == 200, body[:300]
    n = int(headers["inference-header-content-length"])
    assert [o["name"] for o in json.loads(body[:n])["outputs"]] == ["OUTPUT0", "OUTPUT1"]
    out = np.frombuffer(body[n:], dtype=np.int32)
    np.testing.assert_array_equal(out[:16], a + b)
    np.testing.assert_array_equal(out[16:], a - b)


def _pairs(seed: int, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(-1000, 1000, 16, dtype=np.int32), rng.integers(-1000, 1000, 16, dtype=np.int32))
            for _ in range(count)]


def send_split_and_pipelined(sock: socket.socket, reader, pairs: list, before_each=lambda: None) -> None:
    """Requests sent in awkward ways, each answer checked in order: ``pairs[0]`` split within its
    head, its JSON and its last byte; ``pairs[1:3]`` in one write; ``pairs[3]`` in a write that
    ends with the start of ``pairs[4]``. ``before_each`` runs before each write of a new request."""
    whole = _add_sub(*pairs[0])
    for cut in (20, len(whole) - 100, len(whole) - 1):
        before_each()
        sock.sendall(whole[:cut])
        time.sleep(0.05)
        sock.sendall(whole[cut:])
        _check(reader, *pairs[0])
    before_each()
    sock.sendall(_add_sub(*pairs[1]) + _add_sub(*pairs[2]))
    _check(reader, *pairs[1])
    _check(reader, *pairs[2])
    before_each()
    first, second = _add_sub(*pairs[3]), _add_sub(*pairs[4])
    sock.sendall(first + second[:30])
    time.sleep(0.05)
    sock.sendall(second[30:])
    _check(reader, *pairs[3])
    _check(reader, *pairs[4])


def test_repeated_heads_are_answered_from_their_own_bodies(server):
    """The same head with new values each time, one request per write, mixed with other heads
    (another header, the connection's first head again): every answer holds its own sums."""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        reader = sock.makefile("rb")
        for i, (a, b) in enumerate(_pairs(1, 12)):
            extra = "X-Round: odd\r\n" if i in (5, 6) else ""
            sock.sendall(_add_sub(a, b, extra))
            _check(reader, a, b)


def test_a_repeated_head_in_parts_or_pipelined_goes_through_the_parser(server):
    """Once a head is known: a request split across writes, two requests in one write, and a
    request whose write ends with the start of the next are each answered in order."""
    pairs = _pairs(2, 9)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = sock.makefile("rb")
        for a, b in pairs[:2]:  # learned
            sock.sendall(_add_sub(a, b))
            _check(reader, a, b)
        send_split_and_pipelined(sock, reader, pairs[2:7])
        sock.sendall(_add_sub(*pairs[7]))  # and the known head again, in one write
        _check(reader, *pairs[7])


def test_a_bad_body_behind_a_known_head_gets_its_error(server):
    """A body as long as the known one but broken is refused with its usual words, and the answers
    around it (same head, other status) are not mixed up."""
    (a, b), = _pairs(3, 1)
    good = _add_sub(a, b)
    head_end = good.index(b"\r\n\r\n") + 4
    broken = good[:head_end] + b"x" + good[head_end + 1:]
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        reader = sock.makefile("rb")
        for _ in range(2):
            sock.sendall(good)
            _check(reader, a, b)
            for _ in range(2):
                sock.sendall(broken)
                status, headers, body = read_raw_response(reader)
                assert status == 400 and "failed to parse" in json.loads(body)["error"], body
                assert headers["content-type"] == "application/json"


def test_a_closing_request_after_known_heads_closes_the_connection(server):
    """A request that asks to close is answered with ``connection: close`` and the connection
    ends, though the head before it was known."""
    (a, b), = _pairs(4, 1)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        reader = sock.makefile("rb")
        for _ in range(2):
            sock.sendall(_add_sub(a, b))
            _check(reader, a, b)
        sock.sendall(_add_sub(a, b, "Connection: close\r\n"))
        status, headers, body = read_raw_response(reader)
        assert status == 200 and headers.get("connection") == "close"
        assert reader.read() == b""  # closed by the server


KEEP_ALIVE_S = 5.0  # uvicorn's default, which the frontend keeps


def test_the_keep_alive_timeout_closes_idle_connections_only(server):
    """Answers no longer re-arm the keep-alive timer each time: a connection that keeps sending
    (known heads) stays open past the timeout, one left idle is closed once the timeout passed."""
    (a, b), = _pairs(5, 1)
    with socket.create_connection(("127.0.0.1", server.port)) as busy, \
            socket.create_connection(("127.0.0.1", server.port)) as idle:
        busy_reader, idle_reader = busy.makefile("rb"), idle.makefile("rb")
        idle.sendall(_add_sub(a, b))
        _check(idle_reader, a, b)
        idle_from = time.monotonic()
        idle.settimeout(KEEP_ALIVE_S + 3)
        while time.monotonic() - idle_from < KEEP_ALIVE_S + 1.5:
            busy.sendall(_add_sub(a, b))
            _check(busy_reader, a, b)
            busy_from = time.monotonic()  # idle from its last answer on
            time.sleep(0.5)
        assert idle_reader.read() == b""  # closed by the server meanwhile
        closed_after = time.monotonic() - idle_from
        busy.settimeout(KEEP_ALIVE_S + 3)
        assert busy_reader.read() == b""
        busy_closed_after = time.monotonic() - busy_from
    assert closed_after >= KEEP_ALIVE_S - 0.1
    assert KEEP_ALIVE_S - 0.5 <= busy_closed_after <= KEEP_ALIVE_S + 1.5
