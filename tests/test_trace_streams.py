"""Triton's trace extension for streamed requests: each request on a gRPC ModelStreamInfer stream
and each HTTP generate / generate_stream request is a trace, with a send pair per response sent
(see docs/flags.md#tracing)."""
from __future__ import annotations

import json
import queue
import socket
import time

import numpy as np
import tritonclient.grpc as grpcclient

from conftest import DEADLINE_S, raw_request
from shmserve.shm.trace import GRPC_STAMPS, STAMPS
from test_trace import assert_ordered, records, stamps, start


def stream(url: str, requests: list[tuple[str, list, dict]]) -> list:
    """Send each (model, inputs, keyword arguments) on one gRPC stream; what came back, in order,
    once the stream is closed (which waits for every answer)."""
    got: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(url) as c:
        c.start_stream(callback=lambda result, error: got.put(error if error is not None else result))
        for model, inputs, kw in requests:
            c.async_stream_infer(model, inputs, **kw)
        c.stop_stream()
    return [got.get_nowait() for _ in range(got.qsize())]


def words(text: str) -> list:
    t = grpcclient.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
    return [t]


def grpc_add_sub() -> list:
    inputs = [grpcclient.InferInput("INPUT0", [16], "INT32"), grpcclient.InferInput("INPUT1", [16], "INT32")]
    for i in inputs:
        i.set_data_from_numpy(np.arange(16, dtype=np.int32))
    return inputs


def assert_streamed(record: dict, names: tuple[str, ...], responses: int) -> None:
    """One trace of one streamed request: every stamp of ``names`` once and in its order, except
    the frontend's INFER_RESPONSE_COMPLETE and send pair, which come once per response sent, each
    after the model's output started (as Triton's stream handlers stamp them); the whole list in
    the order the stamps were taken."""
    listed = [(t["name"], t["ns"]) for t in record["timestamps"]]
    assert [ns for _, ns in listed] == sorted(ns for _, ns in listed), record
    made, send_start, send_end = names[-3], names[-2], names[-1]
    assert made == "INFER_RESPONSE_COMPLETE"
    made_at = [ns for name, ns in listed if name == made]
    starts = [ns for name, ns in listed if name == send_start]
    ends = [ns for name, ns in listed if name == send_end]
    assert len(made_at) == len(starts) == len(ends) == responses, record
    for i, (ready, begun, done) in enumerate(zip(made_at, starts, ends)):
        assert ready <= begun <= done, record
        assert i + 1 == responses or done <= made_at[i + 1], record
    once = {name: ns for name, ns in listed if name not in (made, send_start, send_end)}
    assert list(once) == [n for n in names[:-3]] and len(listed) == len(names) - 3 + 3 * responses, record
    assert list(once.values()) == sorted(once.values()), record
    assert once["COMPUTE_OUTPUT_START"] <= starts[0], record


def test_each_request_on_a_grpc_stream_is_its_own_trace(server_factory, tmp_path):
    """Triton's stream handler: a trace per request, GRPC_WAITREAD_* around its read, a
    GRPC_SEND_* pair for every message sent (each response of a decoupled model, its empty final
    response when asked for one), the model's timestamps on the final answer."""
    path = tmp_path / "trace.json"
    s = start(server_factory, path, "level=TIMESTAMPS", "rate=1", models=("word_stream",))
    results = stream(s.grpc_url, [("word_stream", words("one two three"), {"request_id": "words"}),
                                  ("add_sub", grpc_add_sub(), {"request_id": "plain"}),
                                  ("word_stream", words("x y"), {"request_id": "empty_final",
                                                                 "enable_empty_final_response": True})])
    assert not [r for r in results if isinstance(r, Exception)] and len(results) == 7
    found = {r["request_id"]: r for r in records(path, 3)}
    assert sorted(found) == ["empty_final", "plain", "words"]
    assert sorted(r["id"] for r in found.values()) == [1, 2, 3]
    assert {(r["model_name"], r["model_version"]) for r in found.values()} == {("word_stream", 1), ("add_sub", 1)}
    assert_streamed(found["words"], GRPC_STAMPS, 3)
    assert_streamed(found["plain"], GRPC_STAMPS, 1)
    assert_streamed(found["empty_final"], GRPC_STAMPS, 3)
    # The requests of one stream are read in turn: each read after the one before.
    read = [stamps(found[r])["GRPC_WAITREAD_END"] for r in ("words", "plain", "empty_final")]
    assert read == sorted(read)


def test_grpc_streams_follow_rate_and_count(server_factory, tmp_path):
    """The rate samples the requests of a stream as it samples single calls, and the count ends
    tracing in the middle of a stream; a stream nothing in is sampled writes nothing."""
    path = tmp_path / "trace.json"
    s = start(server_factory, path, "level=TIMESTAMPS", "rate=3")
    stream(s.grpc_url, [("add_sub", grpc_add_sub(), {"request_id": f"r{i}"}) for i in range(7)])
    assert sorted(r["request_id"] for r in records(path, 2)) == ["r2", "r5"]  # every third
    with grpcclient.InferenceServerClient(s.grpc_url) as g:
        g.update_trace_settings(settings={"trace_rate": "1", "trace_count": "2"})
    stream(s.grpc_url, [("add_sub", grpc_add_sub(), {"request_id": f"c{i}"}) for i in range(4)])
    found = records(path, 5, timeout=2.0)
    assert sorted(r["request_id"] for r in found) == ["c0", "c1", "r2", "r5"]
    for r in found:
        assert_streamed(r, GRPC_STAMPS, 1)
    stream(s.grpc_url, [("add_sub", grpc_add_sub(), {}) for _ in range(3)])  # the count is spent
    assert len(records(path, 5, timeout=1.0)) == 4


def test_untraced_streams_write_nothing(server_factory, tmp_path):
    path = tmp_path / "trace.json"
    s = start(server_factory, path, models=("word_stream",))  # level OFF
    results = stream(s.grpc_url, [("word_stream", words("a b"), {}), ("add_sub", grpc_add_sub(), {})])
    assert len(results) == 3
    assert sse(raw_request(s.port, "POST", "/v2/models/word_stream/generate_stream", b'{"text_input": "a b"}'))
    time.sleep(0.3)
    assert not path.exists()


def sse(r) -> list[dict]:
    assert r.status == 200, r
    return [json.loads(chunk[len("data: "):]) for chunk in r.body.decode().split("\n\n") if chunk.startswith("data: ")]


def test_http_generate_and_generate_stream_are_traced(server_factory, tmp_path):
    """Triton's generate handler: HTTP_RECV_* as /infer's, and an HTTP_SEND_* pair for each event
    of generate_stream (generate's one answer has one: its record is an /infer record's). A
    request refused before a version's scheduler had it (by the frontend, or by the model's input
    checks) is not traced, as Triton's core writes no record for it."""
    path = tmp_path / "trace.json"
    s = start(server_factory, path, "level=TIMESTAMPS", "rate=1", models=("word_stream",))
    events = sse(raw_request(s.port, "POST", "/v2/models/word_stream/generate_stream",
                             b'{"text_input": "one two three four", "id": "streamed"}'))
    assert [e["text_output"] for e in events] == ["one", "two", "three", "four"]
    r = raw_request(s.port, "POST", "/v2/models/word_stream/generate", b'{"text_input": "alone", "id": "single"}')
    assert r.status == 200 and r.json()["text_output"] == "alone"
    r = raw_request(s.port, "POST", "/v2/models/word_stream/generate", b'{"nothing": 1}')
    assert r.status == 400  # refused by the model's input checks: not traced
    r = raw_request(s.port, "POST", "/v2/models/add_sub/generate", b'{"INPUT0": [1.5]}')
    assert r.status == 400  # refused by the frontend: not traced
    found = records(path, 2)
    assert len(found) == 2
    by_id = {r.get("request_id", ""): r for r in found}
    assert sorted(by_id) == ["single", "streamed"]
    assert_streamed(by_id["streamed"], STAMPS, 4)
    assert_ordered(by_id["single"])
    assert all(r["model_name"] == "word_stream" for r in found)
    assert by_id["streamed"]["model_version"] == by_id["single"]["model_version"] == 1
    recv = stamps(by_id["streamed"])
    assert recv["HTTP_RECV_START"] <= recv["HTTP_RECV_END"] <= recv["REQUEST_START"]


def test_a_stream_the_client_leaves_is_still_written(server_factory, tmp_path):
    """A gRPC stream cancelled and a generate_stream connection closed in the middle of a
    decoupled model's responses: each trace is written with what was sent, every send pair whole."""
    path = tmp_path / "trace.json"
    s = start(server_factory, path, "level=TIMESTAMPS", "rate=1", models=("word_stream",))
    text = "a b c d e f g h"
    got: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(s.grpc_url) as c:
        c.start_stream(callback=lambda result, error: got.put(error if error is not None else result))
        c.async_stream_infer("word_stream", words(text), request_id="grpc", parameters={"delay_ms": 100})
        assert got.get(timeout=DEADLINE_S).as_numpy("text_output").tolist() == [b"a"]
        c.stop_stream(cancel_requests=True)
    body = json.dumps({"text_input": text, "delay_ms": 100, "id": "http"}).encode()
    with socket.create_connection(("127.0.0.1", s.port), timeout=DEADLINE_S) as sock:
        sock.sendall(b"POST /v2/models/word_stream/generate_stream HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        received = b""
        while b"data: " not in received:
            received += sock.recv(4096)
    found = {r["request_id"]: r for r in records(path, 2)}
    assert sorted(found) == ["grpc", "http"]
    for record, names in ((found["grpc"], GRPC_STAMPS), (found["http"], STAMPS)):
        listed = [t["name"] for t in record["timestamps"]]
        sends = listed.count(names[-2])
        assert 1 <= sends < 8 and listed.count(names[-1]) == sends == listed.count("INFER_RESPONSE_COMPLETE"), record
        assert listed[:4] == list(names[:4]), record  # read, submitted
        assert "COMPUTE_END" not in listed, record  # the model's final flag never reached the client
