"""Large binary bodies, which the frontend copies into its arena while they arrive
(server/frontend/ingest.py): bodies that come slowly, are dropped mid-way, or are pipelined
must each be answered from their own bytes, and none may keep its room in the arena."""
from __future__ import annotations

import gzip
import json
import socket
import threading
import time

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import DEADLINE_S, TEST_MODELS, raw_request, read_raw_response

MIB = 1 << 20
# A small arena: two 16 MiB bodies fit, so one block that were never given back shows at once.
ARENA_MB = 40


@pytest.fixture(scope="module")
def server(module_factory):
    return module_factory.start([TEST_MODELS], ["--model-control-mode", "explicit", "--load-model", "identity_all",
                                                "--frontend-arena-mb", str(ARENA_MB)])


def _request(values: np.ndarray, keep_alive: bool = True) -> tuple[bytes, bytes]:
    """(the HTTP head, the body) of an identity_all request with ``values`` as binary data."""
    head = json.dumps({"inputs": [{"name": "IN_FP32", "datatype": "FP32", "shape": list(values.shape),
                                   "parameters": {"binary_data_size": values.nbytes}}],
                       "outputs": [{"name": "OUT_FP32", "parameters": {"binary_data": True}}]}).encode()
    body = head + values.tobytes()
    http = (f"POST /v2/models/identity_all/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            f"Inference-Header-Content-Length: {len(head)}\r\n"
            f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n").encode()
    return http, body


def _output(headers: dict, body: bytes) -> np.ndarray:
    n = int(headers["inference-header-content-length"])
    return np.frombuffer(body[n:], dtype=np.float32)


def _identity(client: httpclient.InferenceServerClient, values: np.ndarray) -> np.ndarray:
    i = httpclient.InferInput("IN_FP32", list(values.shape), "FP32")
    i.set_data_from_numpy(values, binary_data=True)
    result = client.infer("identity_all", [i], outputs=[httpclient.InferRequestedOutput("OUT_FP32", binary_data=True)])
    return result.as_numpy("OUT_FP32")


def test_large_bodies_through_tritonclient(server):
    """Bodies past the size taken in as they arrive, in several shapes, back to back."""
    client = server.client()
    rng = np.random.default_rng(1)
    for shape in [(1, 4 * MIB // 4), (64, 4099), (1, 16 * MIB // 4), (1, 4 * MIB // 4), (2, 300_000)]:
        values = rng.random(shape, dtype=np.float32)
        np.testing.assert_array_equal(_identity(client, values), values)


def _identity_once_there_is_room(client: httpclient.InferenceServerClient, values: np.ndarray) -> np.ndarray:
    """``_identity``, retried while the arena has no room: on a loaded host the frontend may not
    yet have moved a held body out of its block (its hold ends on the frontend's own clock)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        try:
            return _identity(client, values)
        except InferenceServerException as e:
            if e.status() != "503" or "no room" not in e.message() or time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def test_a_slow_body_is_answered_and_others_go_on(server):
    """A body that stops half-way for longer than its block may be held is moved out of the arena
    (the arena is a FIFO: a held block stalls everyone's reuse of the space behind it); requests
    of other clients go on meanwhile, and the slow body is answered from its own bytes."""
    rng = np.random.default_rng(2)
    slow = rng.random((1, 4 * MIB), dtype=np.float32)  # 16 MiB
    http, body = _request(slow)
    client = server.client()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(http + body[:len(body) // 2])
        time.sleep(0.5)  # the frontend's hold: from here on the slow body may leave its block
        for _ in range(4):  # 4 x 16 MiB through a 40 MiB arena: the slow body's block is free again
            other = rng.random((1, 4 * MIB), dtype=np.float32)
            np.testing.assert_array_equal(_identity_once_there_is_room(client, other), other)
        sock.sendall(body[len(body) // 2:])
        status, headers, out = read_raw_response(sock.makefile("rb"))
    assert status == 200, out[:300]
    np.testing.assert_array_equal(_output(headers, out), slow.ravel())


def test_bodies_dropped_mid_way_give_their_room_back(server):
    """Clients that go away in the middle of large bodies (and one cut in its JSON header) leave
    no block behind: far more than the arena holds was dropped, and a full request still fits."""
    rng = np.random.default_rng(3)
    values = rng.random((1, 4 * MIB), dtype=np.float32)
    http, body = _request(values)
    for cut in [len(body) // 2, len(body) - 1, 10 * MIB, 100, len(body) // 3, 2 * MIB]:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(http + body[:cut])
            time.sleep(0.05)  # (the frontend reads the part before it sees the close)
    np.testing.assert_array_equal(_identity(server.client(), values), values)
    assert raw_request(server.port, "GET", "/v2/health/ready").status == 200


def test_pipelined_large_bodies_are_answered_in_order(server):
    """Three large requests written back to back on one connection (by a thread, while this one
    reads the answers, as a pipelining client does: the server holds back a request's reading
    until the one before is answered, and its answers' writing until the client reads): the later
    bodies arrive while the first is in flight, wait for their turn, and each answer holds its
    own request's bytes."""
    rng = np.random.default_rng(4)
    sent = [rng.random((1, n), dtype=np.float32) for n in (MIB, 3 * MIB, 2 * MIB)]
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        writer = threading.Thread(target=sock.sendall, args=(b"".join(b"".join(_request(v)) for v in sent),))
        writer.start()
        reader = sock.makefile("rb")
        for values in sent:
            status, headers, out = read_raw_response(reader)
            assert status == 200, out[:300]
            np.testing.assert_array_equal(_output(headers, out), values.ravel())
        writer.join(30)
        assert not writer.is_alive()


def test_bad_large_bodies_get_their_usual_errors(server):
    """A large body whose header the frontend refuses goes the ordinary way, with its words."""
    rng = np.random.default_rng(5)
    values = rng.random((1, MIB), dtype=np.float32)
    http, body = _request(values)
    head_len = int(http.split(b"Inference-Header-Content-Length: ")[1].split(b"\r\n")[0])
    headers = {"Inference-Header-Content-Length": str(head_len), "Content-Type": "application/octet-stream"}
    short = raw_request(server.port, "POST", "/v2/models/identity_all/infer", body[:-8], headers)
    assert short.status == 400 and "unexpected end of the request body" in short.json()["error"], short
    long = raw_request(server.port, "POST", "/v2/models/identity_all/infer", body + b"12345678", headers)
    assert long.status == 400 and "no input claims" in long.json()["error"], long
    broken = raw_request(server.port, "POST", "/v2/models/identity_all/infer", b"x" + body[1:], headers)
    assert broken.status == 400 and "failed to parse" in broken.json()["error"], broken
    unknown = raw_request(server.port, "POST", "/v2/models/nope/infer", body, headers)
    assert unknown.status == 404 and "Request for unknown model" in unknown.json()["error"], unknown
    ok = raw_request(server.port, "POST", "/v2/models/identity_all/infer", body, headers)
    assert ok.status == 200 and ok.body[-values.nbytes:] == values.tobytes(), ok


def test_a_large_compressed_body_goes_the_ordinary_way(server):
    """A compressed body's bytes are not the tensors': it is joined and decompressed as before."""
    rng = np.random.default_rng(6)
    values = rng.integers(0, 4, (1, 2 * MIB), dtype=np.int32).astype(np.float32)  # compressible
    http, body = _request(values)
    head_len = int(http.split(b"Inference-Header-Content-Length: ")[1].split(b"\r\n")[0])
    packed = gzip.compress(body, compresslevel=1)
    assert MIB < len(packed) < len(body)
    headers = {"Inference-Header-Content-Length": str(head_len), "Content-Encoding": "gzip",
               "Content-Type": "application/octet-stream"}
    ok = raw_request(server.port, "POST", "/v2/models/identity_all/infer", packed, headers)
    assert ok.status == 200 and ok.body[-values.nbytes:] == values.tobytes(), ok


def test_descriptors_of_every_length_keep_their_tensors_in_place(server):
    """The reserved block keeps room for the longest send time; a descriptor whose shorter send
    time would end its 64-byte room earlier is padded so the tensors stay where they were copied.
    Request ids of 0 to 63 characters put the descriptor's length at every offset in that room,
    so both ways are taken, each answered from its own bytes."""
    client = server.client()
    rng = np.random.default_rng(7)
    for n in range(64):
        values = rng.random((1, MIB // 4 + n), dtype=np.float32)  # just over 1 MiB of body
        i = httpclient.InferInput("IN_FP32", list(values.shape), "FP32")
        i.set_data_from_numpy(values, binary_data=True)
        result = client.infer("identity_all", [i], request_id="r" * n,
                              outputs=[httpclient.InferRequestedOutput("OUT_FP32", binary_data=True)])
        np.testing.assert_array_equal(result.as_numpy("OUT_FP32"), values)
