"""Triton's trace extension (TIMESTAMPS): --trace-config, GET/POST v2[/models/<m>]/trace/setting,
and the records frontends, broker and workers write together (see shm/trace.py)."""
from __future__ import annotations

import importlib.util
import json
import queue
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import DEADLINE_S, PYTHON, ROOT, TESTS, raw_request
from shmserve.shm.trace import GRPC_STAMPS, STAMPS, read_trace_file

REPOS = [TESTS / "models" / "batching", ROOT / "model_repository"]
MODELS = ["--model-control-mode", "explicit", "--load-model", "add_sub", "--load-model", "probe"]


def otel_installed() -> bool:
    try:
        return importlib.util.find_spec("opentelemetry.sdk.trace") is not None
    except ModuleNotFoundError:
        return False


def start(factory, path: Path, *config: str, workers: int = 1, models: tuple[str, ...] = ()):
    args = [*MODELS, "--http-workers", str(workers), "--trace-config", f"triton,file={path}"]
    for m in models:
        args += ["--load-model", m]
    for c in config:
        args += ["--trace-config", c]
    return factory.start(REPOS, args)


def add_sub(client: httpclient.InferenceServerClient, request_id: str = "") -> None:
    a = httpclient.InferInput("INPUT0", [16], "INT32")
    a.set_data_from_numpy(np.arange(16, dtype=np.int32))
    b = httpclient.InferInput("INPUT1", [16], "INT32")
    b.set_data_from_numpy(np.ones(16, dtype=np.int32))
    result = client.infer("add_sub", [a, b], request_id=request_id)
    assert result.as_numpy("OUTPUT0").tolist() == list(range(1, 17))


def probe(client: httpclient.InferenceServerClient) -> None:
    x = httpclient.InferInput("INPUT0", [1, 2], "FP32")
    x.set_data_from_numpy(np.ones((1, 2), dtype=np.float32))
    client.infer("probe", [x])


def stamps(record: dict) -> dict[str, int]:
    return {t["name"]: t["ns"] for t in record["timestamps"]}


def records(path: Path, expected: int, timeout: float = DEADLINE_S) -> list[dict]:
    """The file's records once it holds ``expected`` (a record is written after its response),
    and what else came in the 0.2 s after."""
    deadline = time.monotonic() + timeout
    found: list[dict] = []
    while time.monotonic() < deadline:
        found = read_trace_file(str(path)) if path.exists() else []
        if len(found) >= expected:
            break
        time.sleep(0.05)
    time.sleep(0.2)  # nothing more may arrive
    return read_trace_file(str(path)) if path.exists() else []


def assert_ordered(record: dict, names: tuple[str, ...] = STAMPS) -> None:
    ts = stamps(record)
    assert list(ts) == list(names), record
    values = [ts[name] for name in names]
    assert values == sorted(values), record


# -- the file -------------------------------------------------------------------------------------
def test_every_request_traced_at_rate_1(server_factory, tmp_path):
    path = tmp_path / "trace.json"
    s = start(server_factory, path, "level=TIMESTAMPS", "rate=1")
    client = s.client()
    assert "trace" in client.get_server_metadata()["extensions"]
    for i in range(6):
        add_sub(client, f"req{i}")
    found = records(path, 6)
    assert len(found) == 6
    assert sorted(r["id"] for r in found) == list(range(1, 7))
    for r in found:
        assert r["model_name"] == "add_sub" and r["model_version"] == 1
        assert_ordered(r)
    assert sorted(r["request_id"] for r in found) == [f"req{i}" for i in range(6)]
    assert s.stop() == 0
    with open(path) as f:  # a complete JSON array once the server stopped, as Triton's
        assert len(json.load(f)) == 6


def test_rate_and_count(server_factory, tmp_path):
    path = tmp_path / "trace.json"
    s = start(server_factory, path, "level=TIMESTAMPS", "rate=2")
    client = s.client()
    for _ in range(8):
        add_sub(client)
    assert len(records(path, 4)) == 4  # every second request
    client.update_trace_settings(settings={"trace_rate": "1", "trace_count": "3"})
    for _ in range(6):
        add_sub(client)
    assert len(records(path, 7)) == 7  # three more, then the count is spent
    assert client.get_trace_settings()["trace_count"] == "0"


def test_count_at_start_and_defaults(server_factory, tmp_path):
    path = tmp_path / "trace.json"
    s = start(server_factory, path, "level=TIMESTAMPS", "rate=1", "count=3")
    client = s.client()
    assert client.get_trace_settings() == {"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "3",
                                           "log_frequency": "0", "trace_file": str(path), "trace_mode": "triton"}
    for _ in range(5):
        add_sub(client)
    assert len(records(path, 3)) == 3


def test_untraced_by_default(server_factory, tmp_path):
    path = tmp_path / "trace.json"
    s = start(server_factory, path)
    client = s.client()
    assert client.get_trace_settings()["trace_level"] == ["OFF"]
    assert client.get_trace_settings()["trace_rate"] == "1000"  # Triton's default
    for _ in range(3):
        add_sub(client)
    assert not path.exists()


# -- settings -------------------------------------------------------------------------------------
def test_per_model_settings_override_and_clear(server_factory, tmp_path):
    path = tmp_path / "trace.json"
    s = start(server_factory, path)  # level OFF globally
    client = s.client()
    answer = client.update_trace_settings(model_name="add_sub", settings={"trace_level": ["TIMESTAMPS"],
                                                                         "trace_rate": "1"})
    assert answer["trace_level"] == ["TIMESTAMPS"] and answer["trace_rate"] == "1"
    assert client.get_trace_settings()["trace_level"] == ["OFF"]
    for _ in range(3):
        add_sub(client)
        probe(client)
    found = records(path, 3)
    assert [r["model_name"] for r in found] == ["add_sub"] * 3
    # The keys the model does not set follow the global ones.
    client.update_trace_settings(settings={"log_frequency": "0", "trace_count": "-1", "trace_rate": "7"})
    assert client.get_trace_settings(model_name="add_sub")["trace_rate"] == "1"
    # null clears a key of the model: its level falls back on the global OFF.
    answer = client.update_trace_settings(model_name="add_sub", settings={"trace_level": None})
    assert answer["trace_level"] == ["OFF"] and answer["trace_rate"] == "1"
    for _ in range(3):
        add_sub(client)
    assert len(records(path, 4, timeout=1.0)) == 3  # (none of the three traced: no fourth record comes)
    answer = client.update_trace_settings(model_name="add_sub", settings={"trace_rate": None})
    assert answer == client.get_trace_settings()  # nothing of its own left


def test_runtime_change_reaches_every_frontend_and_count_is_exact(server_factory, tmp_path):
    path = tmp_path / "trace.json"
    s = start(server_factory, path, "level=TIMESTAMPS", "rate=1", "count=5", workers=2)

    def one(i: int) -> None:
        add_sub(httpclient.InferenceServerClient(s.url))  # a new connection: either frontend

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(40)))
    found = records(path, 5)
    assert sorted(r["id"] for r in found) == [1, 2, 3, 4, 5]
    s.client().update_trace_settings(settings={"trace_count": "4"})
    time.sleep(0.6)  # the other frontend follows within a quarter second
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(40)))
    found = records(path, 9)
    assert sorted(r["id"] for r in found) == list(range(1, 10))
    for r in found:
        assert_ordered(r)


def test_log_frequency_starts_new_files(server_factory, tmp_path):
    path = tmp_path / "trace.json"
    s = start(server_factory, path, "level=TIMESTAMPS", "rate=1", "triton,log-frequency=2")
    client = s.client()
    assert client.get_trace_settings()["log_frequency"] == "2"
    for _ in range(5):
        add_sub(client)
    first = Path(f"{path}.0")
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline and not Path(f"{path}.2").exists():
        time.sleep(0.05)
    for k in (0, 1):  # full files are complete JSON arrays at once
        with open(f"{path}.{k}") as f:
            assert len(json.load(f)) == 2
    assert first.exists() and not path.exists()
    assert s.stop() == 0
    with open(f"{path}.2") as f:
        assert len(json.load(f)) == 1
    ids = [r["id"] for k in range(3) for r in json.load(open(f"{path}.{k}"))]
    assert sorted(ids) == [1, 2, 3, 4, 5]


def test_trace_file_changes_only_inside_its_directory(server_factory, tmp_path):
    path = tmp_path / "trace.json"
    s = start(server_factory, path, "level=TIMESTAMPS", "rate=1")
    client = s.client()
    other = tmp_path / "other.json"
    assert client.update_trace_settings(settings={"trace_file": str(other)})["trace_file"] == str(other)
    add_sub(client)
    assert len(records(other, 1)) == 1
    for bad in ("/tmp/elsewhere.json", str(tmp_path / "sub" / "x.json"), str(tmp_path / ".." / "x.json")):
        with pytest.raises(InferenceServerException, match="trace_file"):
            client.update_trace_settings(settings={"trace_file": bad})


@pytest.mark.parametrize("body,needle", [
    ({"trace_rate": "abc"}, "trace_rate"),
    ({"trace_rate": "0"}, "trace_rate"),
    ({"trace_count": "-2"}, "trace_count"),
    ({"log_frequency": "-1"}, "log_frequency"),
    ({"trace_level": ["TENSORS"]}, "TENSORS"),
    ({"trace_level": ["LOUD"]}, "LOUD"),
    ({"trace_level": "TIMESTAMPS", "trace_file": ""}, "trace file"),
    ({"trace_mode": "opentelemetry"}, "trace_mode"),
    ({"trace_colour": "red"}, "trace_colour"),
    ({"trace_rate": None}, "cannot be cleared"),
    ([1, 2], "JSON object"),
])
def test_bad_values_are_400(bad_values_server, body, needle):
    s = bad_values_server
    r = raw_request(s.port, "POST", "/v2/trace/setting", json.dumps(body).encode())
    assert r.status == 400 and needle in r.json()["error"], r


@pytest.fixture(scope="module")
def bad_values_server(module_factory, tmp_path_factory):
    """One server for the parametrized checks (bad values change nothing)."""
    s = start(module_factory, tmp_path_factory.mktemp("trace") / "trace.json")
    yield s
    assert s.client().get_trace_settings()["trace_rate"] == "1000"


def test_unknown_model_and_bad_json(server_factory, tmp_path):
    s = start(server_factory, tmp_path / "trace.json")
    r = raw_request(s.port, "POST", "/v2/models/nope/trace/setting", b'{"trace_rate": "1"}')
    assert r.status == 400 and r.json() == {"error": "Request for unknown model : nope"}  # Triton 2.51's
    r = raw_request(s.port, "POST", "/v2/trace/setting", b"{not json")
    assert r.status == 400
    assert s.client().get_trace_settings()["trace_rate"] == "1000"


# -- what each process adds --------------------------------------------------------------------------
def test_batched_and_direct_requests_are_timed_end_to_end(server_factory, tmp_path):
    path = tmp_path / "trace.json"
    s = start(server_factory, path, "level=TIMESTAMPS", "rate=1")
    client = s.client()
    add_sub(client)  # direct: frontend -> worker
    probe(client)  # dynamic batching: through the broker, which holds it up to 0.3 s for a batch
    found = {r["model_name"]: r for r in records(path, 2)}
    assert set(found) == {"add_sub", "probe"}
    for r in found.values():
        assert_ordered(r)
        ts = stamps(r)
        assert ts["QUEUE_START"] <= ts["COMPUTE_START"] <= ts["COMPUTE_END"] <= ts["REQUEST_END"]
    batched = stamps(found["probe"])
    assert batched["COMPUTE_START"] - batched["QUEUE_START"] > 0.2e9  # the broker's queue, not the lane's
    assert batched["QUEUE_START"] > batched["REQUEST_START"]


def test_grpc_inferences_are_traced_with_grpc_timestamps(server_factory, tmp_path):
    """gRPC ModelInfer calls share the server's trace ids and count with HTTP requests; their
    records name the frontend's stamps as Triton's gRPC frontend does. A TraceSetting call applies
    in the gRPC frontend at once."""
    path = tmp_path / "trace.json"
    s = start(server_factory, path, "level=TIMESTAMPS", "rate=1")
    add_sub(s.client(), "http")
    a = np.arange(16, dtype=np.int32)
    inputs = [grpcclient.InferInput("INPUT0", [16], "INT32"), grpcclient.InferInput("INPUT1", [16], "INT32")]
    for i in inputs:
        i.set_data_from_numpy(a)
    with grpcclient.InferenceServerClient(s.grpc_url) as g:
        for i in range(2):
            g.infer("add_sub", inputs, request_id=f"grpc{i}")
        g.update_trace_settings(settings={"trace_count": "1"})  # one more trace
        for i in range(2, 5):
            g.infer("add_sub", inputs, request_id=f"grpc{i}")
    found = records(path, 4)
    assert sorted(r["id"] for r in found) == [1, 2, 3, 4]
    by_request = {r["request_id"]: r for r in found}
    assert sorted(by_request) == ["grpc0", "grpc1", "grpc2", "http"]
    assert_ordered(by_request["http"])
    for name in ("grpc0", "grpc1", "grpc2"):
        assert by_request[name]["model_name"] == "add_sub" and by_request[name]["model_version"] == 1
        assert_ordered(by_request[name], GRPC_STAMPS)


# -- streamed requests ---------------------------------------------------------------------------------
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
    the frontend's send pair, which comes once per response sent, each pair after the model's
    output started; the whole list in the order the stamps were taken."""
    listed = [(t["name"], t["ns"]) for t in record["timestamps"]]
    assert [ns for _, ns in listed] == sorted(ns for _, ns in listed), record
    send_start, send_end = names[-2], names[-1]
    starts = [ns for name, ns in listed if name == send_start]
    ends = [ns for name, ns in listed if name == send_end]
    assert len(starts) == len(ends) == responses, record
    for i, (begun, done) in enumerate(zip(starts, ends)):
        assert begun <= done, record
        assert i + 1 == responses or done <= starts[i + 1], record
    once = {name: ns for name, ns in listed if name not in (send_start, send_end)}
    assert list(once) == [n for n in names[:-2]] and len(listed) == len(names) - 2 + 2 * responses, record
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
    request refused before it reaches the model is not traced."""
    path = tmp_path / "trace.json"
    s = start(server_factory, path, "level=TIMESTAMPS", "rate=1", models=("word_stream",))
    events = sse(raw_request(s.port, "POST", "/v2/models/word_stream/generate_stream",
                             b'{"text_input": "one two three four", "id": "streamed"}'))
    assert [e["text_output"] for e in events] == ["one", "two", "three", "four"]
    r = raw_request(s.port, "POST", "/v2/models/word_stream/generate", b'{"text_input": "alone", "id": "single"}')
    assert r.status == 200 and r.json()["text_output"] == "alone"
    r = raw_request(s.port, "POST", "/v2/models/word_stream/generate", b'{"nothing": 1}')
    assert r.status == 400  # refused by the model: it reached the model, so it is traced
    r = raw_request(s.port, "POST", "/v2/models/add_sub/generate", b'{"INPUT0": [1.5]}')
    assert r.status == 400  # refused by the frontend: not traced
    found = records(path, 3)
    assert len(found) == 3
    by_id = {r.get("request_id", ""): r for r in found}
    assert sorted(by_id) == ["", "single", "streamed"]
    assert_streamed(by_id["streamed"], STAMPS, 4)
    assert_ordered(by_id["single"])
    assert_ordered(by_id[""], tuple(n for n in STAMPS if not n.startswith("COMPUTE")))  # it never ran
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
        assert 1 <= sends < 8 and listed.count(names[-1]) == sends, record
        assert listed[:4] == list(names[:4]), record  # read, submitted
        assert "COMPUTE_END" not in listed, record  # the model's final flag never reached the client


def test_traced_requests_with_large_bodies_and_answers(server_factory, tmp_path):
    """Traced requests take the ASGI path, where a large answer joined on both cores arrives as a
    memoryview: 8 MiB each way, in the body and back, byte for byte, and timed."""
    path = tmp_path / "trace.json"
    s = server_factory.start([TESTS / "models" / "main"], ["--model-control-mode", "explicit", "--load-model",
                                                           "identity_all", "--trace-config", f"triton,file={path}",
                                                           "--trace-config", "level=TIMESTAMPS",
                                                           "--trace-config", "rate=1"])
    client = s.client()
    data = np.random.default_rng(3).random((2, 1 << 20), dtype=np.float32)
    for binary in (True, False):  # the answer as binary data, and as JSON (a large body all the same)
        x = httpclient.InferInput("IN_FP32", list(data.shape), "FP32")
        x.set_data_from_numpy(data)
        result = client.infer("identity_all", [x], outputs=[httpclient.InferRequestedOutput("OUT_FP32",
                                                                                             binary_data=binary)])
        np.testing.assert_array_equal(result.as_numpy("OUT_FP32"), data)
    found = records(path, 2)
    assert len(found) == 2
    for r in found:
        assert r["model_name"] == "identity_all"
        assert_ordered(r)


# -- flags and OpenTelemetry -----------------------------------------------------------------------------
@pytest.mark.parametrize("flag,needle", [
    ("rate=0", "trace_rate"),
    ("level=TENSORS", "TENSORS"),
    ("colour=red", "unknown setting 'colour'"),
    ("jaeger,url=x", "unknown mode"),
    ("level", "expected"),
])
def test_bad_flags_are_one_line_errors(flag, needle, tmp_path):
    cmd = [PYTHON, "-m", "shmserve", "--model-repository", str(ROOT / "model_repository"), "--trace-config", flag]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and needle in p.stderr, p.stderr


def test_timestamps_without_file_is_refused():
    cmd = [PYTHON, "-m", "shmserve", "--model-repository", str(ROOT / "model_repository"),
           "--trace-config", "level=TIMESTAMPS"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "triton,file=" in p.stderr


def test_opentelemetry_mode_without_the_sdk_exits_2(tmp_path):
    """The dev set-up installs the SDK; a package first on the path that refuses to import hides
    it, as on a host where it was never installed."""
    import os

    hidden = tmp_path / "opentelemetry"
    hidden.mkdir()
    (hidden / "__init__.py").write_text("raise ImportError('opentelemetry is not installed here')\n")
    cmd = [PYTHON, "-m", "shmserve", "--model-repository", str(ROOT / "model_repository"),
           "--trace-config", "mode=opentelemetry", "--trace-config", "level=TIMESTAMPS"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30, env=env)
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and "OpenTelemetry SDK" in p.stderr, p.stderr


class _Collector(BaseHTTPRequestHandler):
    bodies: list[bytes] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.path == "/v1/traces":
            _Collector.bodies.append(body)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_opentelemetry_spans_reach_an_otlp_collector(server_factory):
    assert otel_installed(), "the dev set-up installs shmserve[trace]"
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    collector = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
        s = server_factory.start(REPOS, [*MODELS, "--trace-config", "mode=opentelemetry", "--trace-config",
                                         "level=TIMESTAMPS", "--trace-config", "rate=1", "--trace-config",
                                         f"opentelemetry,url={url}"])
        client = s.client()
        assert client.get_trace_settings()["trace_mode"] == "opentelemetry"
        for _ in range(3):
            add_sub(client)
        spans = []
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline and len(spans) < 3:
            time.sleep(0.2)
            spans = []
            for body in list(_Collector.bodies):
                req = ExportTraceServiceRequest.FromString(body)
                spans += [sp for rs in req.resource_spans for ss in rs.scope_spans for sp in ss.spans]
        assert len(spans) == 3
        for sp in spans:
            assert sp.name == "InferRequest"
            assert [e.name for e in sp.events] == list(STAMPS)
            times = [e.time_unix_nano for e in sp.events]
            assert times == sorted(times)
            attrs = {a.key: a.value for a in sp.attributes}
            assert attrs["triton.model_name"].string_value == "add_sub"
    finally:
        collector.shutdown()
