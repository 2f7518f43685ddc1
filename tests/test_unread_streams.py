"""A network client that reads its stream slowly, or not at all, against a real server: the
responses it has not read wait in its frontend's heap, not in the model's arena, so the model's
other clients are served; past the frontend's bound (``--frontend-arena-mb``) its stream is ended
with an error and its request cancelled (shm/streams.py ``SpillRoom``)."""
from __future__ import annotations

import json
import socket
import time

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from conftest import edge_refusals, wait_until

CHATTER_MODEL = """import os, threading, time
import numpy as np
import triton_python_backend_utils as pb_utils

REPO = {repo!r}


class TritonPythonModel:
    \"\"\"COUNT responses of SIZE bytes each, a few thousand a second (no faster than a loaded
    frontend takes them off its ring); then it writes how many it sent and whether its request
    was cancelled to REPO/sent.ID.\"\"\"

    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy().reshape(-1)[0])
            size = int(pb_utils.get_input_tensor_by_name(request, "SIZE").as_numpy().reshape(-1)[0])
            threading.Thread(target=self._send, args=(request.request_id(), count, size,
                                                     request.get_response_sender()), daemon=True).start()
        return None

    @staticmethod
    def _send(request_id, count, size, sender):
        sent, cancelled = 0, False
        for i in range(count):
            if sender.is_cancelled():
                cancelled = True
                break
            out = pb_utils.Tensor("OUT", np.full([size], i % 251, dtype=np.uint8))
            sender.send(pb_utils.InferenceResponse([out, pb_utils.Tensor("INDEX", np.array([i], dtype=np.int32))]))
            sent += 1
            time.sleep(0.0003)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        with open(os.path.join(REPO, f"sent.{{request_id}}.tmp"), "w") as f:
            f.write(f"{{sent}} {{int(cancelled)}}")
        os.rename(os.path.join(REPO, f"sent.{{request_id}}.tmp"), os.path.join(REPO, f"sent.{{request_id}}"))
"""
CHATTER_CONFIG = """name: "chatter"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] },
        { name: "SIZE" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_UINT8 dims: [ -1 ] },
         { name: "INDEX" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""
SIZE = 1024
# A worker arena of 4 MiB (one extent) holds under 4,000 such responses; the frontend keeps 16 MiB
# of unread ones.
ARENAS = ["--worker-arena-mb", "4", "--frontend-arena-mb", "16", "--http-workers", "1"]
HELD = 6000  # about 7 MiB: more than the worker's arena (with what the sockets take), under the frontend's bound
TOO_MANY = 20000  # about 23 MiB: past the frontend's bound


@pytest.fixture(scope="module")
def chatter_server(module_factory, tmp_path_factory):
    repo = tmp_path_factory.mktemp("unread")
    (repo / "chatter" / "1").mkdir(parents=True)
    (repo / "chatter" / "1" / "model.py").write_text(CHATTER_MODEL.format(repo=str(repo)))
    (repo / "chatter" / "config.pbtxt").write_text(CHATTER_CONFIG)
    server = module_factory.start([repo], ARENAS)
    server.repo = repo
    return server


def _request(request_id: str, count: int) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="chatter", id=request_id)
    for name in ("COUNT", "SIZE"):
        request.inputs.add(name=name, datatype="INT32", shape=[1])
    request.raw_input_contents.extend([np.int32(count).tobytes(), np.int32(SIZE).tobytes()])
    return request


def _sent(server, request_id: str) -> tuple[int, bool]:
    """(responses the model sent, whether it saw its request cancelled), once it is done."""
    path = server.repo / f"sent.{request_id}"
    wait_until(path.exists, f"the model is done with {request_id}")
    sent, cancelled = path.read_text().split()
    return int(sent), cancelled == "1"


def _unread_grpc_stream(server, request_id: str, count: int) -> tuple[grpc.Channel, object]:
    """A stream of ``count`` responses that nobody reads yet: the client's gRPC library takes
    messages only when asked (``next``), and its window does not grow (no BDP probing)."""
    channel = grpc.insecure_channel(server.grpc_url, options=[("grpc.http2.bdp_probe", 0)])
    responses = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter([_request(request_id, count)]))
    return channel, responses


def _unread_sse_stream(server, request_id: str, count: int) -> socket.socket:
    """A generate_stream of ``count`` responses over a socket that reads nothing yet."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connecting: the window stays small)
    sock.settimeout(60)
    sock.connect(("127.0.0.1", server.port))
    body = json.dumps({"id": request_id, "COUNT": [count], "SIZE": [SIZE]}).encode()
    sock.sendall(b"POST /v2/models/chatter/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def _sse_events(sock: socket.socket, pause_s: float = 0.0) -> list[dict]:
    """Every event of the stream, read to its end (``pause_s`` between reads)."""
    data = b""
    while not data.endswith(b"0\r\n\r\n"):  # the last chunk
        chunk = sock.recv(1 << 20)
        assert chunk, f"the stream ended early: {data[-300:]!r}"
        data += chunk
        time.sleep(pause_s)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    text = b""
    while body:  # de-chunk
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        text, body = text + rest[:n], rest[n + 2:]
    return [json.loads(e[len(b"data: "):]) for e in text.split(b"\n\n") if e.startswith(b"data: ")]


def _served(server, request_id: str) -> None:
    """Another client of the model is served in full while the unread stream is open."""
    with grpc.insecure_channel(server.grpc_url) as channel:
        responses = list(service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
            iter([_request(request_id, 50)]), timeout=60))
    assert [r.error_message for r in responses] == [""] * 50, responses[0].error_message
    assert [np.frombuffer(r.infer_response.raw_output_contents[1], np.int32)[0] for r in responses] == list(range(50))


def test_a_grpc_stream_nobody_reads_holds_nothing_of_its_models_arena(chatter_server):
    channel, responses = _unread_grpc_stream(chatter_server, "held-grpc", HELD)
    try:
        assert _sent(chatter_server, "held-grpc") == (HELD, False)  # every response found room
        _served(chatter_server, "other-grpc")
        got = list(responses)  # read now: every response, in order
        assert [r.error_message for r in got if r.error_message] == []
        assert [np.frombuffer(r.infer_response.raw_output_contents[1], np.int32)[0] for r in got] == list(range(HELD))
        assert all(r.infer_response.raw_output_contents[0] == bytes([i % 251]) * SIZE for i, r in enumerate(got))
    finally:
        channel.close()


def test_an_sse_stream_nobody_reads_holds_nothing_of_its_models_arena(chatter_server):
    sock = _unread_sse_stream(chatter_server, "held-sse", HELD)
    with sock:
        assert _sent(chatter_server, "held-sse") == (HELD, False)
        _served(chatter_server, "other-sse")
        events = _sse_events(sock)
    assert [(i, e) for i, e in enumerate(events) if "error" in e] == [], len(events)
    assert [e["INDEX"] for e in events] == list(range(HELD))


def test_a_grpc_stream_read_too_slowly_is_ended_with_resource_exhausted(chatter_server):
    channel, responses = _unread_grpc_stream(chatter_server, "ended-grpc", TOO_MANY)
    try:
        sent, cancelled = _sent(chatter_server, "ended-grpc")
        assert cancelled and sent < TOO_MANY  # the frontend cancelled it past its bound
        _served(chatter_server, "after-grpc")
        got = list(responses)
        errors = [r.error_message for r in got if r.error_message]
        assert len(errors) == 1 and got[-1].error_message == errors[0], errors
        assert "read too slowly" in errors[0] and "--frontend-arena-mb" in errors[0], errors[0]
        wait_until(lambda: edge_refusals(chatter_server).get(("grpc", "slow-reader"), 0) >= 1, "the cut counted")
        indexes = [np.frombuffer(r.infer_response.raw_output_contents[1], np.int32)[0] for r in got[:-1]]
        assert indexes == list(range(len(indexes)))  # those it read came in order, none twice
    finally:
        channel.close()


def test_an_sse_stream_read_too_slowly_ends_with_an_error_event(chatter_server):
    sock = _unread_sse_stream(chatter_server, "ended-sse", TOO_MANY)
    with sock:
        sent, cancelled = _sent(chatter_server, "ended-sse")
        assert cancelled and sent < TOO_MANY
        _served(chatter_server, "after-sse")
        events = _sse_events(sock)
    assert "error" in events[-1] and "read too slowly" in events[-1]["error"], events[-1]
    assert [e["INDEX"] for e in events[:-1]] == list(range(len(events) - 1))
    wait_until(lambda: edge_refusals(chatter_server).get(("http", "slow-reader"), 0) >= 1, "the cut counted")


def test_the_stream_ended_is_the_one_holding_the_most(chatter_server):
    """Two slow readers: the one whose responses pass the bound holds more than the other, and
    only it is ended; the other still gets every response."""
    small_channel, small = _unread_grpc_stream(chatter_server, "small", HELD)
    big_channel, big = _unread_grpc_stream(chatter_server, "big", TOO_MANY)
    try:
        assert _sent(chatter_server, "small") == (HELD, False)
        assert _sent(chatter_server, "big")[1]  # cancelled
        got = list(small)
        assert [r.error_message for r in got if r.error_message] == []
        assert len(got) == HELD
        assert "read too slowly" in list(big)[-1].error_message
    finally:
        small_channel.close()
        big_channel.close()


def test_a_response_larger_than_the_bound_is_left_in_its_arena(server_factory, tmp_path):
    """A frontend that keeps less of unread responses (1 MiB) than one response takes (2 MiB)
    leaves such responses where the model wrote them rather than end the stream for them."""
    (tmp_path / "chatter" / "1").mkdir(parents=True)
    (tmp_path / "chatter" / "1" / "model.py").write_text(CHATTER_MODEL.format(repo=str(tmp_path)))
    (tmp_path / "chatter" / "config.pbtxt").write_text(CHATTER_CONFIG)
    server = server_factory.start([tmp_path], ["--frontend-arena-mb", "1", "--worker-arena-mb", "16"])
    server.repo = tmp_path
    request = _request("large", 3)
    request.raw_input_contents[1] = np.int32(2 << 20).tobytes()
    channel = grpc.insecure_channel(server.grpc_url, options=[("grpc.http2.bdp_probe", 0)])
    try:
        responses = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter([request]))
        assert _sent(server, "large") == (3, False)
        got = list(responses)
        assert [r.error_message for r in got] == [""] * 3
        assert [len(r.infer_response.raw_output_contents[0]) for r in got] == [2 << 20] * 3
    finally:
        channel.close()


def test_an_sse_stream_read_slowly_but_steadily_outlives_the_send_timeout(server_factory, tmp_path):
    """A client that reads its stream a little at a time, for several times --http-send-timeout-secs
    in all, is never cut: each drain of the connection counts as reading (the stream's chunks
    are written after each one, so the bytes left unsent alone would not show it)."""
    repo = tmp_path / "repo"
    (repo / "chatter" / "1").mkdir(parents=True)
    (repo / "chatter" / "1" / "model.py").write_text(CHATTER_MODEL.format(repo=str(repo)))
    (repo / "chatter" / "config.pbtxt").write_text(CHATTER_CONFIG)
    server = server_factory.start([repo], [*ARENAS, "--http-send-timeout-secs", "1"])
    server.repo = repo
    count = 3000  # events of about 3.7 KB (OUT as JSON numbers): 11 MB, more than the kernel buffers
    sock = _unread_sse_stream(server, "steady", count)
    began = time.monotonic()
    with sock:
        events = _sse_events(sock, pause_s=0.002)  # (4 KiB a read)
    took = time.monotonic() - began
    assert took > 2, f"read in {took:.1f} s: faster than the test means to"
    assert [e["INDEX"] for e in events] == list(range(count))
    assert "(--http-send-timeout-secs)" not in server.log()
