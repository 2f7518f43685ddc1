"""Binary bodies from ``ingest.MIN_BODY_BYTES`` on, which the frontend reads from the socket straight
into their block in its arena (server/frontend/ingest.py, ``BODY_SINK`` in protocol.py): sizes
on either side of the threshold and of the connection's 64 KiB parsed reads, bodies that arrive slowly in
pieces (cut inside the JSON header too) or stall past the block's hold, and connections cut
mid-body. The arena is small (2 MiB, three 600 KB bodies): one block that were never given back
stalls it (a FIFO), and the requests after it would get 503."""
from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest

from conftest import TEST_MODELS, read_raw_response
from shmserve.server.frontend.ingest import HOLD_S, MIN_BODY_BYTES

KB = 1 << 10


@pytest.fixture(scope="module")
def server(module_factory):
    return module_factory.start([TEST_MODELS], ["--model-control-mode", "explicit", "--load-model", "identity_all",
                                                "--frontend-arena-mb", "2", "--http-workers", "1"])


def _request(values: np.ndarray) -> bytes:
    """The whole HTTP request of an identity_all call with ``values`` (UINT8) as binary data."""
    head = json.dumps({"inputs": [{"name": "IN_UINT8", "datatype": "UINT8", "shape": [1, values.size],
                                   "parameters": {"binary_data_size": values.size}}],
                       "outputs": [{"name": "OUT_UINT8", "parameters": {"binary_data": True}}]}).encode()
    return (f"POST /v2/models/identity_all/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(head) + values.size}\r\n"
            f"Inference-Header-Content-Length: {len(head)}\r\n\r\n").encode() + head + values.tobytes()


def _values_for_body(body_len: int, seed: int) -> np.ndarray:
    """Random bytes whose request body (JSON header and tensor) is exactly ``body_len`` long."""
    n = body_len
    while True:
        values = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
        request = _request(values)
        got = len(request) - request.index(b"\r\n\r\n") - 4
        if got == body_len:
            return values
        n -= got - body_len


def _answered(reader, values: np.ndarray) -> None:
    status, headers, body = read_raw_response(reader)
    assert status == 200, body[:300]
    out = np.frombuffer(body[int(headers["inference-header-content-length"]):], dtype=np.uint8)
    np.testing.assert_array_equal(out, values)


def _send_in_pieces(sock: socket.socket, data: bytes, cuts: list[int], pause_s: float) -> None:
    at = 0
    for cut in [*cuts, len(data)]:
        sock.sendall(data[at:cut])
        at = cut
        time.sleep(pause_s)


SIZES = sorted({MIN_BODY_BYTES - 1, MIN_BODY_BYTES, MIN_BODY_BYTES + 1, 5 * 64 * KB - 1, 5 * 64 * KB,
                5 * 64 * KB + 1, 600_171, 1 << 20})


def test_bodies_around_the_threshold_come_back_whole(server):
    """Back to back on one keep-alive connection, each sent whole: every size answers its own
    bytes, many times the arena's size in all."""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        reader = sock.makefile("rb")
        for round_ in range(3):
            for i, size in enumerate(SIZES):
                values = _values_for_body(size, seed=round_ * 100 + i)
                sock.sendall(_request(values))
                _answered(reader, values)


@pytest.mark.parametrize("pause_s", [0.002, 0.05])
def test_bodies_arriving_in_pieces(server, pause_s):
    """Pieces of odd sizes with pauses between them: cut in the HTTP head, in the JSON header,
    right after it and at uneven places in the tensor."""
    for i, size in enumerate((MIN_BODY_BYTES + 1, 600_171)):
        values = _values_for_body(size, seed=10 + i)
        request = _request(values)
        body_at = request.index(b"\r\n\r\n") + 4
        cuts = [40, body_at + 10, body_at + 300, body_at + 65_537, body_at + 200_003, len(request) - 1]
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            _send_in_pieces(sock, request, [c for c in cuts if c < len(request)], pause_s)
            _answered(sock.makefile("rb"), values)


def test_a_body_stalled_past_its_hold_is_answered_and_others_go_on(server):
    """A body that stops half-way for longer than ``HOLD_S`` leaves its block (the connection goes
    on reading the rest into it, now in process memory); other bodies go through the arena meanwhile."""
    slow = _values_for_body(600_171, seed=20)
    request = _request(slow)
    with socket.create_connection(("127.0.0.1", server.port)) as sock, \
            socket.create_connection(("127.0.0.1", server.port)) as other:
        sock.sendall(request[:len(request) // 2])
        time.sleep(HOLD_S + 0.5)
        reader = other.makefile("rb")
        for i in range(6):  # twice the arena: the slow body holds no block
            values = _values_for_body(600_171, seed=30 + i)
            other.sendall(_request(values))
            _answered(reader, values)
        sock.sendall(request[len(request) // 2:])
        _answered(sock.makefile("rb"), slow)


def test_bodies_cut_mid_way_give_their_blocks_back(server):
    """Connections closed in the JSON header, right after it, mid-tensor and one byte short:
    none keeps its block, so requests through the whole arena, several times over, still pass."""
    values = _values_for_body(600_171, seed=40)
    request = _request(values)
    body_at = request.index(b"\r\n\r\n") + 4
    for cut in (body_at + 20, body_at + 400, body_at + 70_000, len(request) // 2, len(request) - 1) * 2:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(request[:cut])
            time.sleep(0.05)  # (the frontend takes the part in before it sees the close)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        reader = sock.makefile("rb")
        for i in range(8):
            values = _values_for_body(600_171, seed=50 + i)
            sock.sendall(_request(values))
            _answered(reader, values)
