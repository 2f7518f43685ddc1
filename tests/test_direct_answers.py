"""Direct answers: a worker writes a small successful answer to the HTTP client's socket itself
(server/frontend/protocol.py, shm/peer_fds.py), and the frontend learns of it later. Whatever
path an answer takes, the client gets its own answer, whole, in order, and once.

The frontend answers that way only while it serves several clients (a lone client's answers are
polled for), so these tests keep a second connection busy between the requests they look at."""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import PRODUCT_MODELS, TEST_MODELS, read_raw_response
from test_batching import REPO as BATCHING_MODELS
from test_batching import infer_with, metric
from test_repeated_heads import _add_sub, _check, _pairs, send_split_and_pipelined


def _direct(server, model: str) -> float:
    return metric(server, "shmserve_http_direct_answers", model)


def _add_sub_call(client: httpclient.InferenceServerClient, a: np.ndarray, b: np.ndarray) -> None:
    inputs = [httpclient.InferInput("INPUT0", [16], "INT32"), httpclient.InferInput("INPUT1", [16], "INT32")]
    inputs[0].set_data_from_numpy(a, binary_data=True)
    inputs[1].set_data_from_numpy(b, binary_data=True)
    outputs = [httpclient.InferRequestedOutput(n, binary_data=True) for n in ("OUTPUT0", "OUTPUT1")]
    result = client.infer("add_sub", inputs, outputs=outputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


class Other:
    """Another client: one add_sub request of its own before each request of the test's client,
    so that the frontend sees several clients."""

    def __init__(self, server) -> None:
        self.sock = socket.create_connection(("127.0.0.1", server.port))
        self.reader = self.sock.makefile("rb")
        self.pairs = iter(_pairs(99, 10_000))

    def turn(self) -> None:
        a, b = next(self.pairs)
        self.sock.sendall(_add_sub(a, b))
        _check(self.reader, a, b)

    def close(self) -> None:
        self.reader.close()
        self.sock.close()


def _alternating(server, seed: int, n: int) -> None:
    """``n`` add_sub calls from two tritonclient clients taking turns."""
    clients = [server.client(), server.client()]
    try:
        for i, (a, b) in enumerate(_pairs(seed, n)):
            _add_sub_call(clients[i % 2], a, b)
    finally:
        for c in clients:
            c.close()


def _turns(server, other: Other, seed: int, n: int = 4) -> socket.socket:
    """A connection that sent ``n`` add_sub requests, each after one of ``other``'s (so the last
    ones were answered by the worker itself), with every answer checked."""
    sock = socket.create_connection(("127.0.0.1", server.port))
    reader = sock.makefile("rb")
    for a, b in _pairs(seed, n):
        other.turn()
        sock.sendall(_add_sub(a, b))
        _check(reader, a, b)
    reader.close()
    return sock


def _stray(sock: socket.socket, wait_s: float) -> bytes:
    """Bytes that arrive on ``sock`` within ``wait_s`` (none expected)."""
    sock.settimeout(wait_s)
    try:
        return sock.recv(1000)
    except socket.timeout:
        return b""


def _wait_for(predicate, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _raiser(x: list[int]) -> bytes:
    header = json.dumps({"inputs": [{"name": "X", "datatype": "INT32", "shape": [len(x)],
                                     "parameters": {"binary_data_size": 4 * len(x)}}],
                         "outputs": [{"name": "Y", "parameters": {"binary_data": True}}]}).encode()
    body = header + np.array(x, dtype=np.int32).tobytes()
    return (f"POST /v2/models/raiser/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            f"Inference-Header-Content-Length: {len(header)}\r\n\r\n").encode() + body


def _sleeper() -> bytes:
    header = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1],
                                     "parameters": {"binary_data_size": 4}}],
                         "outputs": [{"name": "PID", "parameters": {"binary_data": True}}]}).encode()
    body = header + np.array([1.0], dtype=np.float32).tobytes()
    return (f"POST /v2/models/sleeper/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            f"Inference-Header-Content-Length: {len(header)}\r\n\r\n").encode() + body


def test_a_closed_loop_client_is_answered_by_the_worker_itself(server):
    """tritonclient in a closed loop: after the first answers (the frontend learns their head),
    the worker writes them; every answer holds its own sums, and the frontend still sees each
    request through (the next request on the connection is served at once)."""
    before = _direct(server, "add_sub")
    _alternating(server, 11, 60)
    _wait_for(lambda: _direct(server, "add_sub") - before >= 55, "the worker answered at most a few itself")


def test_a_lone_client_is_answered_by_the_frontend(server):
    """One client in a closed loop: the loop polls for its answers, which is quicker for it."""
    client = server.client()
    try:
        for a, b in _pairs(9, 3):  # (the first two may follow another test's client: answered
            _add_sub_call(client, a, b)  # directly, and counted when the next one runs)
        before = _direct(server, "add_sub")
        for a, b in _pairs(10, 30):
            _add_sub_call(client, a, b)
        _add_sub_call(client, *_pairs(10, 1)[0])  # one more round: the counters are flushed
        assert _direct(server, "add_sub") == before
    finally:
        client.close()


def test_no_direct_answers_when_turned_off(server_factory, monkeypatch):
    """SHMSERVE_DIRECT_HTTP_ANSWERS=0: the frontend writes every answer (the counter stays 0)."""
    monkeypatch.setenv("SHMSERVE_DIRECT_HTTP_ANSWERS", "0")
    srv = server_factory.start([PRODUCT_MODELS])
    _alternating(srv, 12, 30)
    client = srv.client()
    _add_sub_call(client, *_pairs(13, 1)[0])  # one more round: the counters are flushed
    client.close()
    assert _direct(srv, "add_sub") == 0


def test_pipelined_and_split_requests_behind_direct_answers_keep_their_order(server):
    """Once the worker answers a connection itself: three requests in one write, a request split
    in two writes, two in one write, and a write that ends inside the next request are each
    answered in order."""
    pairs = _pairs(14, 16)
    before = _direct(server, "add_sub")
    other = Other(server)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reader = sock.makefile("rb")
        for a, b in pairs[:4]:
            other.turn()
            sock.sendall(_add_sub(a, b))
            _check(reader, a, b)
        other.turn()
        started = time.monotonic()
        sock.sendall(_add_sub(*pairs[4]) + _add_sub(*pairs[5]) + _add_sub(*pairs[6]))
        for p in pairs[4:7]:
            _check(reader, *p)
        # The two behind the direct answer are started when it is done, not at the frontend's
        # next look once a second (a few ms here).
        assert time.monotonic() - started < 0.2
        send_split_and_pipelined(sock, reader, pairs[7:12], other.turn)
        for a, b in pairs[12:]:
            other.turn()
            sock.sendall(_add_sub(a, b))
            _check(reader, a, b)
    other.close()
    _wait_for(lambda: _direct(server, "add_sub") - before >= 10, "the worker answered at most a few itself")


def test_an_error_between_direct_answers_is_written_by_the_frontend(server):
    """The same request head, answered by the worker, then failing in the model (500), then
    answered by the worker again: the error comes whole, and so do the answers around it."""
    other = Other(server)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        reader = sock.makefile("rb")
        for values in ([1, 2], [3, 4], [5, 6], [-1, 2], [7, 8], [-3, -4], [9, 10]):
            other.turn()
            sock.sendall(_raiser(values))
            status, headers, body = read_raw_response(reader)
            if min(values) < 0:
                assert status == 500, body
                assert "raiser cannot take negative numbers" in json.loads(body)["error"]
            else:
                assert status == 200, body
                n = int(headers["inference-header-content-length"])
                np.testing.assert_array_equal(np.frombuffer(body[n:], dtype=np.int32), np.array(values) * 2)
    other.close()
    assert _direct(server, "raiser") >= 1


def test_a_client_that_leaves_before_its_direct_answer_harms_no_one(server):
    """A connection closed while the worker runs its request, and a new connection opened at
    once (it may get the old one's descriptor number in the frontend): the new client gets its
    own answer only, and the server goes on."""
    other = Other(server)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:  # the frontend learns the head
        reader = sock.makefile("rb")
        for _ in range(3):
            other.turn()
            sock.sendall(_sleeper())
            assert read_raw_response(reader)[0] == 200
        other.turn()
        sock.sendall(_sleeper())  # to be answered by the worker itself, once it has slept
    other.turn()
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
    other.turn()
    other.close()
    assert _direct(server, "sleeper") >= 1  # the third was answered by the worker itself


def test_large_answers_to_a_client_that_does_not_read_arrive_whole(server):
    """Answers piling up unread until the socket's buffer is full: the worker writes what fits
    (or nothing) and the frontend the rest, and then, while the frontend still has bytes to write,
    it answers the next ones itself. Every answer still arrives whole and in order."""
    n = 15000  # 60 KB of FP32: under the largest direct answer
    header = json.dumps({"inputs": [{"name": "IN_FP32", "datatype": "FP32", "shape": [1, n],
                                     "parameters": {"binary_data_size": 4 * n}}],
                         "outputs": [{"name": "OUT_FP32", "parameters": {"binary_data": True}}]}).encode()
    count = 120  # about 7 MB of answers: more than the kernel buffers for the connection
    values = [np.arange(n, dtype=np.float32) + i for i in range(count)]
    before = _direct(server, "identity_all")
    other = Other(server)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))

    def send_all() -> None:
        for v in values:
            other.turn()  # another client between each: the frontend lets the worker answer
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
    other.close()
    assert _direct(server, "identity_all") > before  # the first ones, before the buffer filled


def test_a_keep_alive_connection_answered_directly_is_still_closed_when_idle(server):
    """uvicorn's keep-alive timeout (5 s) after a direct answer: the frontend learns of the answer
    on its own (nothing else arrives on the connection) and closes the idle connection."""
    before = _direct(server, "add_sub")
    other = Other(server)
    with _turns(server, other, 16) as sock:
        other.close()
        started = time.monotonic()
        sock.settimeout(15)
        assert sock.recv(100) == b""  # closed by the server
        assert 4 < time.monotonic() - started < 10
    assert _direct(server, "add_sub") > before


def test_a_connection_the_server_closes_after_direct_answers_ends_soon(server):
    """A request asking to close, right after answers the worker wrote: its answer comes whole,
    and the connection ends within the time a worker may keep the socket (``peer_fds.HOLD_S``),
    not when the next client's answer happens to come."""
    from shmserve.shm.peer_fds import HOLD_S

    before = _direct(server, "add_sub")
    other = Other(server)
    with _turns(server, other, 20) as sock:
        reader = sock.makefile("rb")
        a, b = _pairs(21, 1)[0]
        sock.sendall(_add_sub(a, b, extra="Connection: close\r\n"))
        _check(reader, a, b)
        started = time.monotonic()
        sock.settimeout(5)
        assert sock.recv(100) == b""  # closed by the server
        assert time.monotonic() - started < HOLD_S + 0.5
        reader.close()
    other.close()
    assert _direct(server, "add_sub") > before


def test_a_failing_model_stays_unharmed_by_direct_answers_of_another(server):
    """Requests to a model that fails, through tritonclient, between direct answers: the errors
    arrive as errors, the answers as answers."""
    _alternating(server, 17, 6)
    x = httpclient.InferInput("X", [2], "INT32")
    x.set_data_from_numpy(np.array([-5, 1], dtype=np.int32))
    client = server.client()
    try:
        client.infer("raiser", [x])
        raise AssertionError("the model's error was not reported")
    except InferenceServerException as e:
        assert "raiser cannot take negative numbers" in e.message()
    finally:
        client.close()
    _alternating(server, 18, 6)


_ = TEST_MODELS  # (the shared server carries the test models: raiser, sleeper, identity_all)


def test_a_direct_answer_is_not_followed_by_an_error_when_the_broker_dies(server_factory):
    """The broker killed right after a direct answer the frontend has not noticed yet: the
    frontend fails what is in flight with 503s, but that answer stays answered; nothing is
    written behind it on its connection (a 503 there would answer the client's next request)."""
    srv = server_factory.start([PRODUCT_MODELS])
    other = Other(srv)
    before = _direct(srv, "add_sub")
    with _turns(srv, other, 19) as sock:
        assert _direct(srv, "add_sub") > before  # (the earlier ones; the last is counted later)
        broker = next(pid for pid, t in srv.titles().items() if t.startswith("shmserve broker "))
        os.kill(broker, signal.SIGKILL)  # with the last answer, written by the worker, unseen
        time.sleep(2.5)  # the frontend's liveness check has found the broker gone
        stray = _stray(sock, 0.5)
        assert stray == b"", stray
    other.close()


def test_the_answers_of_a_batch_go_through_the_frontend(server_factory):
    """A batching model (``probe``: a batch forms at 4 requests, or after 300 ms): the answers of
    a batch of 4 are written by the frontend, one wake-up for all; a request that runs alone,
    from a connection after another's, is answered by the worker itself (the control: the
    frontend did let the worker answer this model)."""
    import concurrent.futures as cf

    server = server_factory.start([BATCHING_MODELS])

    def batch_of_four() -> None:
        with cf.ThreadPoolExecutor(4) as pool:  # each call on a connection of its own
            assert [r["reqs"] for r in pool.map(lambda _: infer_with(server.url, "probe"), range(4))] == [4] * 4

    for _ in range(3):  # the frontend learns the header and the answer's head
        batch_of_four()
    # (A worker counts an answer it wrote when it flushes its counters, at its next execution.)
    infer_with(server.url, "probe")  # A: alone (after 300 ms), answered directly
    before = _direct(server, "probe")
    batch_of_four()  # counts A
    infer_with(server.url, "probe")  # B, alone: counts the batch
    assert _direct(server, "probe") == before + 1  # A, and none of the four
    infer_with(server.url, "probe")  # counts B
    assert _direct(server, "probe") == before + 2
