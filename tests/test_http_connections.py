"""HTTP/1.1 connections as the frontend keeps them: many requests on one connection, split across
writes or pipelined in one, good and bad ones mixed, keep-alive and close. Whatever way a request
arrives, its answer is computed from its own body, comes whole, in order, and once."""
from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np

from conftest import PRODUCT_MODELS, read_raw_response
from shmserve.tools.harness import cmdline, descendants

HEAD_FIELDS = "Host: x\r\nUser-Agent: http-connections\r\n"
KEEP_ALIVE_S = 5.0  # --http-idle-timeout-secs where a test sets one (the default keeps idle connections)


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


def _raiser(x: list[int]) -> bytes:
    """A request to the test model that fails (500) for negative numbers and doubles the rest."""
    header = json.dumps({"inputs": [{"name": "X", "datatype": "INT32", "shape": [len(x)],
                                     "parameters": {"binary_data_size": 4 * len(x)}}],
                         "outputs": [{"name": "Y", "parameters": {"binary_data": True}}]}).encode()
    body = header + np.array(x, dtype=np.int32).tobytes()
    return (f"POST /v2/models/raiser/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            f"Inference-Header-Content-Length: {len(header)}\r\n\r\n").encode() + body


def _sleeper() -> bytes:
    """A request to the test model that sleeps 0.3 s before it answers."""
    header = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1],
                                     "parameters": {"binary_data_size": 4}}],
                         "outputs": [{"name": "PID", "parameters": {"binary_data": True}}]}).encode()
    body = header + np.array([1.0], dtype=np.float32).tobytes()
    return (f"POST /v2/models/sleeper/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            f"Inference-Header-Content-Length: {len(header)}\r\n\r\n").encode() + body


def _stray(sock: socket.socket, wait_s: float) -> bytes:
    """Bytes that arrive on ``sock`` within ``wait_s`` (none expected)."""
    sock.settimeout(wait_s)
    try:
        return sock.recv(1000)
    except socket.timeout:
        return b""


def test_repeated_heads_are_answered_from_their_own_bodies(server):
    """The same head with new values each time, one request per write, mixed with another head:
    every answer holds its own sums."""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        reader = sock.makefile("rb")
        for i, (a, b) in enumerate(_pairs(1, 12)):
            extra = "X-Round: odd\r\n" if i in (5, 6) else ""
            sock.sendall(_add_sub(a, b, extra))
            _check(reader, a, b)


def _write_calls(pid: int) -> int:
    """The write system calls ``pid`` has made (write and writev; /proc/<pid>/io's syscw)."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("syscw:"))


def test_an_answer_goes_out_in_one_write(server):
    """uvicorn writes an answer's head and its body in two sends, and a client woken by the head
    waits again for the body: the frontend holds the head for the body (protocol.ONE_WRITE). 40
    answers on one connection take 40 of the frontend's write calls, not 80."""
    [frontend] = [p for p in descendants(server.pid) if cmdline(p).startswith("shmserve frontend ")]
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        reader = sock.makefile("rb")
        pairs = _pairs(7, 41)
        sock.sendall(_add_sub(*pairs[0]))
        _check(reader, *pairs[0])
        before = _write_calls(frontend)
        for a, b in pairs[1:]:
            sock.sendall(_add_sub(a, b))
            _check(reader, a, b)
        writes = _write_calls(frontend) - before
    assert 40 <= writes < 50, f"{writes} write calls for 40 answers"


def test_split_and_pipelined_requests_are_answered_in_order(server):
    """A request split within its head, its JSON and its last byte; three requests in one write;
    a write that ends with the start of the next request: each is answered, in order."""
    pairs = _pairs(2, 9)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = sock.makefile("rb")
        sock.sendall(_add_sub(*pairs[0]))
        _check(reader, *pairs[0])
        whole = _add_sub(*pairs[1])
        for cut in (20, len(whole) - 100, len(whole) - 1):
            sock.sendall(whole[:cut])
            time.sleep(0.05)
            sock.sendall(whole[cut:])
            _check(reader, *pairs[1])
        sock.sendall(_add_sub(*pairs[2]) + _add_sub(*pairs[3]) + _add_sub(*pairs[4]))
        for p in pairs[2:5]:
            _check(reader, *p)
        first, second = _add_sub(*pairs[5]), _add_sub(*pairs[6])
        sock.sendall(first + second[:30])
        time.sleep(0.05)
        sock.sendall(second[30:])
        _check(reader, *pairs[5])
        _check(reader, *pairs[6])
        sock.sendall(_add_sub(*pairs[7]) + _add_sub(*pairs[8]))
        _check(reader, *pairs[7])
        _check(reader, *pairs[8])


def test_a_bad_body_between_good_ones_gets_its_error(server):
    """A body as long as a good one but broken is refused with its usual words, and the answers
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


def test_a_model_error_between_answers_comes_whole(server):
    """Answers of one model on one connection, failing in the model (500) now and then: the
    errors come whole, and so do the answers around them."""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        reader = sock.makefile("rb")
        for values in ([1, 2], [3, 4], [-1, 2], [7, 8], [-3, -4], [9, 10]):
            sock.sendall(_raiser(values))
            status, headers, body = read_raw_response(reader)
            if min(values) < 0:
                assert status == 500, body
                assert "raiser cannot take negative numbers" in json.loads(body)["error"]
            else:
                assert status == 200, body
                n = int(headers["inference-header-content-length"])
                np.testing.assert_array_equal(np.frombuffer(body[n:], dtype=np.int32), np.array(values) * 2)


def test_a_closing_request_closes_the_connection(server):
    """A request that asks to close is answered with ``connection: close`` and the connection
    ends, after requests that kept it alive."""
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


def test_a_request_answered_before_its_body_came_keeps_its_connection(server):
    """A request answered without its body (a GET with one, one with a wrong method),
    whose body arrives after its head (as http.client sends one), is answered, the rest of its
    body is read and dropped, and the next request on the connection is answered: Triton reads
    every body before it answers and keeps the connection, and a client that pools connections
    reuses it."""
    (a, b), = _pairs(6, 1)
    early = [(b"GET /v2/models/add_sub", 200), (b"GET /v2/models/add_sub/infer", 405)]
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        reader = sock.makefile("rb")
        for body in (b"xx", b"{}" + b" " * 300_000):  # a small one, and one of several socket reads
            for request, expected in early:
                sock.sendall(request + b" HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
                status, headers, answer = read_raw_response(reader)  # answered before the body is sent
                assert status == expected and headers.get("connection") != "close", (request, answer)
                sock.sendall(body)
                sock.sendall(_add_sub(a, b))
                _check(reader, a, b)


def test_an_idle_connection_is_kept_by_default(server):
    """As Triton keeps them: a proxy that pools connections to the server (nginx, a cloud load
    balancer) reuses one after a minute idle, and one closed under it fails that request."""
    (a, b), = _pairs(5, 1)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        reader = sock.makefile("rb")
        sock.sendall(_add_sub(a, b))
        _check(reader, a, b)
        time.sleep(KEEP_ALIVE_S + 2)  # past the 5 s that uvicorn's default, once ours, closed it at
        sock.sendall(_add_sub(a, b))
        _check(reader, a, b)


def test_the_keep_alive_timeout_closes_idle_connections_only(server_factory):
    """With --http-idle-timeout-secs: a connection that keeps sending stays open past it; one left
    idle is closed once the timeout passed, and so is the busy one once it falls idle."""
    server = server_factory.start([PRODUCT_MODELS], ["--http-idle-timeout-secs", str(KEEP_ALIVE_S)])
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
        busy.settimeout(KEEP_ALIVE_S + 10)  # closed well before this, or the read raises
        assert busy_reader.read() == b""
        busy_closed_after = time.monotonic() - busy_from
    # Not before the timeout (a loaded host may close later: the socket timeouts bound that).
    assert closed_after >= KEEP_ALIVE_S - 0.1
    assert busy_closed_after >= KEEP_ALIVE_S - 0.5


def test_a_client_that_leaves_before_its_answer_harms_no_one(server):
    """A connection closed while the worker runs its request, and a new connection opened at once:
    the new client gets its own answer only, and the server goes on."""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        reader = sock.makefile("rb")
        sock.sendall(_sleeper())
        assert read_raw_response(reader)[0] == 200
        sock.sendall(_sleeper())  # left before its answer
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        reader = sock.makefile("rb")
        sock.sendall(_raiser([21, 22]))
        status, headers, body = read_raw_response(reader)
        assert status == 200, body
        n = int(headers["inference-header-content-length"])
        np.testing.assert_array_equal(np.frombuffer(body[n:], dtype=np.int32), [42, 44])
        time.sleep(0.5)  # the sleeper's answer would have come by now
        stray = _stray(sock, 0.2)
        assert stray == b"", stray  # nothing meant for the closed connection
        sock.settimeout(10)
        sock.sendall(_sleeper())
        assert read_raw_response(reader)[0] == 200


def test_pipelined_requests_of_a_client_that_left_are_dropped_quietly(server):
    """A client that pipelines requests and closes without reading: their answers have nowhere
    to go and are dropped, with no error logged for each (an error traceback per answer would
    flood the log), and the server goes on."""
    a, b = _pairs(7, 1)[0]
    before = server.log().count("Exception in ASGI application")
    for _ in range(10):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(_add_sub(a, b) * 30)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(_add_sub(a, b))
        _check(sock.makefile("rb"), a, b)
    time.sleep(0.5)  # (the dropped answers' writes are over by now; a failed one logs at once)
    assert server.log().count("Exception in ASGI application") == before, server.log_tail(30)


def test_large_answers_to_a_client_that_does_not_read_arrive_whole(server):
    """Answers piling up unread until the connection's buffers are full: every answer still
    arrives whole and in order once the client reads."""
    n = 15000  # 60 KB of FP32
    header = json.dumps({"inputs": [{"name": "IN_FP32", "datatype": "FP32", "shape": [1, n],
                                     "parameters": {"binary_data_size": 4 * n}}],
                         "outputs": [{"name": "OUT_FP32", "parameters": {"binary_data": True}}]}).encode()
    count = 120  # about 7 MB of answers: more than the kernel buffers for the connection
    values = [np.arange(n, dtype=np.float32) + i for i in range(count)]
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))

    def send_all() -> None:
        for v in values:
            sock.sendall((f"POST /v2/models/identity_all/infer HTTP/1.1\r\nHost: x\r\nContent-Length: "
                          f"{len(header) + 4 * n}\r\nInference-Header-Content-Length: {len(header)}\r\n\r\n"
                          ).encode() + header + v.tobytes())

    with sock:
        reader = sock.makefile("rb")
        sender = threading.Thread(target=send_all)
        sender.start()
        time.sleep(2.0)  # the answers pile up unread
        for v in values:
            status, headers, body = read_raw_response(reader)
            assert status == 200
            np.testing.assert_array_equal(
                np.frombuffer(body[int(headers["inference-header-content-length"]):], dtype=np.float32), v)
        sender.join(10)
        assert not sender.is_alive()
