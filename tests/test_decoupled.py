"""Decoupled models against a real server: many responses per request (sent after execute
returned), over the generate/generate_stream endpoints and the local client's streams."""
from __future__ import annotations

import asyncio
import gc
import http.client
import json
import os
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from conftest import wait_until
from shmserve.shm.client import Client, InferenceServerError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(module_factory):
    return module_factory.start([Path(__file__).parent / "models" / "decoupled", ROOT / "model_repository"])


def post(server, path: str, body: dict) -> tuple[int, str, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read().decode()
    finally:
        conn.close()


def sse_events(text: str) -> list[dict]:
    return [json.loads(chunk[len("data: "):]) for chunk in text.split("\n\n") if chunk.startswith("data: ")]


def test_generate_stream_sends_each_response_as_an_event(server):
    status, ctype, text = post(server, "/v2/models/word_stream/generate_stream",
                               {"text_input": "shared memory all the way", "delay_ms": 20})
    assert status == 200 and ctype.startswith("text/event-stream")
    events = sse_events(text)
    assert [e["text_output"] for e in events] == ["shared", "memory", "all", "the", "way"]
    assert [e["index"] for e in events] == [0, 1, 2, 3, 4]
    assert all(e["model_name"] == "word_stream" for e in events)


def test_generate_stream_reports_an_error_event(server):
    status, _, text = post(server, "/v2/models/err_stream/generate_stream", {"N": 2})
    assert status == 200  # (its first event was a response)
    events = sse_events(text)
    assert [e.get("OUT") for e in events[:2]] == [0, 1]
    assert events[2] == {"error": "stream broke"}


def test_generate_stream_streams_a_model_error_and_answers_a_refusal_plainly(server):
    """As Triton 2.51 (measured): an error from a model that ran is an event of the stream, whose
    status is 400 when that error is its first event (200 when responses came before it,
    ``err_stream`` above); a request refused before its model ran (InferAsync failing) is a plain
    error."""
    status, ctype, text = post(server, "/v2/models/plain_fails/generate_stream", {"N": 1})
    assert status == 400 and ctype.startswith("text/event-stream")
    assert sse_events(text) == [{"error": "plain broke"}]
    status, ctype, text = post(server, "/v2/models/raises_decoupled/generate_stream", {"N": 1})
    assert status == 400 and ctype.startswith("text/event-stream")
    [event] = sse_events(text)
    assert event["error"].startswith("Failed to process the request(s) for model 'raises_decoupled_0', message: "
                                     "ValueError: decoupled boom"), event
    # The sequence batcher refuses a request without a sequence id before the model runs.
    status, ctype, text = post(server, "/v2/models/running_sum/generate_stream", {"VALUE": 1.0})
    assert status == 400 and ctype.startswith("application/json")
    assert "correlation ID" in json.loads(text)["error"]


def test_generate_answers_a_models_error_with_400_as_triton(server):
    """Measured against Triton 2.51: a model's error on ``generate`` is a 400 (``infer`` says 500),
    whether the model returned it or raised; a decoupled model that sent more than one response,
    an error among them, gets the one-response error (which Triton sends with a 200:
    docs/compatibility.md)."""
    status, _, text = post(server, "/v2/models/plain_fails/generate", {"N": 1})
    assert (status, json.loads(text)) == (400, {"error": "plain broke"})
    status, _, text = post(server, "/v2/models/raises_decoupled/generate", {"N": 1})
    assert status == 400 and "ValueError: decoupled boom" in json.loads(text)["error"]
    # whatever code the model gave its error (on infer: Triton's 404, 400, 501; measured)
    for n, infer_status in ((1, 404), (3, 400), (4, 501)):
        for endpoint in ("generate", "generate_stream"):
            status, _, text = post(server, f"/v2/models/coded_fails/{endpoint}", {"N": n})
            assert status == 400 and f"coded {n}" in text, (endpoint, n, status, text)
        status, _, _ = post(server, "/v2/models/coded_fails/infer",
                            {"inputs": [{"name": "N", "datatype": "INT32", "shape": [1], "data": [n]}]})
        assert status == infer_status
    status, _, text = post(server, "/v2/models/err_stream/generate", {"N": 2})
    assert status == 400 and json.loads(text)["error"].startswith("generate expects model to produce exactly 1 "
                                                                  "response")


def test_generate_single_response_and_its_limits(server):
    status, _, text = post(server, "/v2/models/word_stream/generate", {"text_input": "alone"})
    assert status == 200 and json.loads(text)["text_output"] == "alone"
    status, _, text = post(server, "/v2/models/word_stream/generate", {"text_input": "two words"})
    assert status == 400 and json.loads(text)["error"] == (  # Triton 2.51's text
        "generate expects model to produce exactly 1 response, use generate stream for model that generates "
        "various number of responses")
    status, _, text = post(server, "/v2/models/add_sub/generate", {"INPUT0": list(range(16)), "INPUT1": [1] * 16})
    assert status == 200 and json.loads(text)["OUTPUT0"] == [i + 1 for i in range(16)]
    status, _, text = post(server, "/v2/models/add_sub/generate", {"INPUT0": list(range(16))})
    assert status == 400 and json.loads(text)["error"] == (  # Triton 2.51's text: the model's input check
        "[request id: <id_unknown>] expected 2 inputs but got 1 inputs for model 'add_sub'. Got input(s) "
        "['INPUT0'], but missing required input(s) ['INPUT1']. Please provide all required input(s).")
    # A value of another JSON type: Triton's words (1.5 is not cut to 1; 2**63 is no JSON int64).
    for wrong in (1.5, 2 ** 63):
        status, _, text = post(server, "/v2/models/add_sub/generate", {"INPUT0": [wrong] * 16, "INPUT1": [1] * 16})
        assert status == 400 and json.loads(text)["error"] == (
            "Unable to parse 'data': attempt to access JSON non-signed-integer as signed-integer")
    for big in (2 ** 31, -2 ** 63):  # out of INT32's range (Triton would cut it): said so, not in Python's words
        status, _, text = post(server, "/v2/models/add_sub/generate", {"INPUT0": [big] * 16, "INPUT1": [1] * 16})
        assert status == 400 and json.loads(text)["error"] == (
            "unable to parse 'data' of input 'INPUT0' as INT32: a value is out of its range")
    status, _, text = post(server, "/v2/models/add_sub/generate", {"INPUT0": list(range(15)), "INPUT1": [1] * 16})
    assert status == 400
    assert json.loads(text)["error"] == "The schema can not convert input 'INPUT0' to tensor with proper shape"


def test_generate_shapes_values_by_the_config(server):
    """Values take the config's dimensions; a batching model's batch dimension takes the rest (so
    two values for running_sum's [1] are a batch of two, which its sequence batcher refuses)."""
    status, _, text = post(server, "/v2/models/running_sum/generate",
                           {"VALUE": [2.0, 3.0], "sequence_id": 9, "sequence_start": True})
    assert status == 400 and json.loads(text)["error"] == (
        "inference request to model 'running_sum' must specify batch-size 1 due to requirements of sequence batcher")
    # One value is a batch of one, [1, 1]; it passes the shape and batch checks and then fails, as in
    # Triton, for want of a correlation ID (the generate endpoint carries none).
    status, _, text = post(server, "/v2/models/running_sum/generate",
                           {"VALUE": 2.0, "sequence_id": 9, "sequence_start": True, "sequence_end": True})
    assert status == 400 and json.loads(text)["error"] == (
        "inference request to model 'running_sum' must specify a non-zero or non-empty correlation ID")


def test_infer_on_a_decoupled_model_is_refused(server):
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["x"]}]}
    status, _, text = post(server, "/v2/models/word_stream/infer", body)
    assert status == 501  # Triton's UNSUPPORTED, with its text
    assert json.loads(text)["error"] == "HTTP end point doesn't support models with decoupled transaction policy"
    body["inputs"][0]["name"] = "no_such_input"  # the policy is checked first, as in Triton
    status, _, text = post(server, "/v2/models/word_stream/infer", body)
    assert status == 501
    with Client(server.id) as client:  # (a local client is told what to call instead, not HTTP's words)
        with pytest.raises(InferenceServerError) as e:
            client.infer("word_stream", {"text_input": np.array([b"x"], dtype=object)})
        assert e.value.status == 501 and "call it with Client.stream() or stream_aio()" in e.value.message


def test_local_client_streams_in_order(server):
    with Client(server.id) as client:
        words = [r["text_output"][0].decode() for r in
                 client.stream("word_stream", {"text_input": np.array([b"a b c d e f g"], dtype=object)})]
        assert words == list("abcdefg")
        # Zero responses is a valid stream: it just ends.
        assert list(client.stream("word_stream", {"text_input": np.array([b""], dtype=object)})) == []
        # A model that answers once streams one response.
        once = list(client.stream("add_sub", {"INPUT0": np.ones(16, np.int32), "INPUT1": np.ones(16, np.int32)}))
        assert len(once) == 1 and once[0]["OUTPUT0"].tolist() == [2] * 16


def test_local_client_stream_error_and_recovery(server):
    with Client(server.id) as client:
        seen = []
        with pytest.raises(InferenceServerError) as e:
            for r in client.stream("err_stream", {"N": np.array([3], np.int32)}):
                seen.append(int(r["OUT"][0]))
        assert seen == [0, 1, 2] and "stream broke" in e.value.message
        words = [r["text_output"][0] for r in client.stream("word_stream", {"text_input": np.array([b"ok"], dtype=object)})]
        assert words == [b"ok"]


def test_local_client_async_stream(server):
    async def run() -> list[str]:
        with Client(server.id) as client:
            out = []
            async for r in client.stream_aio("word_stream", {"text_input": np.array([b"x y z"], dtype=object)}):
                out.append(r["text_output"][0].decode())
            return out

    assert asyncio.run(run()) == ["x", "y", "z"]

    async def misspelt() -> None:
        with Client(server.id) as client:
            async for _ in client.stream_aio("word_stream", {"text_input": np.array([b"x"], dtype=object)},
                                             sequence_idd=7):
                pass

    with pytest.raises(TypeError, match="sequence_idd"):  # (it was dropped without a word)
        asyncio.run(misspelt())


def success_count(server) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=60).read().decode()
    line = [ln for ln in text.splitlines()
            if ln.startswith('nv_inference_request_success{') and 'model="word_stream"' in ln][0]
    return float(line.rsplit(" ", 1)[1])


def ended_count(server) -> float:
    """word_stream's requests that ended: succeeded, or failed (a cancelled one that never ran)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=60).read().decode()
    failed = sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                 if ln.startswith('nv_inference_request_failure{') and 'model="word_stream"' in ln)
    return success_count(server) + failed


def test_streamed_requests_are_counted_once(server):
    # The worker counts a stream when it ends, just after it completed the request's slot: the
    # count may show a moment after the client has the last response. Wait for it, then check
    # that it counted once; a second stream, counted in its turn, shows no late second count.
    before = success_count(server)
    for n in (1, 2):
        post(server, "/v2/models/word_stream/generate_stream", {"text_input": "one two three"})
        wait_until(lambda: success_count(server) - before >= n, f"stream {n} counted")
        assert success_count(server) - before == n


def test_a_stream_is_sent_before_it_is_iterated(server):
    """stream() sends the request at once (as Triton's exec(decoupled=True) does): the model
    runs and finishes while the caller has not looked at the iterator yet."""
    with Client(server.id) as client:
        before = success_count(server)
        responses = client.stream("word_stream", {"text_input": np.array([b"sent early"], dtype=object)})
        wait_until(lambda: success_count(server) > before, "the stream run before it is iterated")
        assert success_count(server) == before + 1
        assert [r["text_output"][0] for r in responses] == [b"sent", b"early"]


# -- consumers that stop reading mid-stream ---------------------------------------------------------

# Arenas of 1 MiB: a block nobody gives back stalls such a FIFO arena after about 1 MiB of later
# traffic, which the checks below send several times over.
SMALL_ARENAS = ["--frontend-arena-mb", "1", "--worker-arena-mb", "1", "--http-workers", "1",
                "--model-control-mode", "explicit", "--load-model", "word_stream"]
LONG_TEXT = " ".join(f"w{i}" for i in range(200))  # 200 responses, spaced out: still streaming when left
BIG_WORD = "x" * 48_000  # one response of 48 kB from a request of 48 kB: 60 of them cross each arena twice


@pytest.fixture(scope="module")
def small_server(module_factory):
    return module_factory.start([ROOT / "model_repository"], SMALL_ARENAS)


def leave_stream_after_first_event(server) -> None:
    """POST a long generate_stream, read up to its first event, then drop the connection."""
    body = json.dumps({"text_input": LONG_TEXT, "delay_ms": 5}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v2/models/word_stream/generate_stream HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        seen = b""
        while b"data: " not in seen:
            chunk = sock.recv(4096)
            assert chunk, f"the server closed the stream before its first event: {seen!r}"
            seen += chunk
        assert seen.startswith(b"HTTP/1.1 200")


def test_generate_stream_clients_that_disconnect_leave_nothing_held(small_server):
    before = success_count(small_server)
    for _ in range(4):
        leave_stream_after_first_event(small_server)
    # The model finishes the streams nobody reads any more; what they sent must have been given back.
    wait_until(lambda: success_count(small_server) - before >= 4, "the abandoned streams finished")
    for i in range(60):
        status, _, text = post(small_server, "/v2/models/word_stream/generate_stream",
                               {"text_input": f"{BIG_WORD}{i}"})
        assert status == 200, (i, text[:300])
        assert [e.get("text_output", e) for e in sse_events(text)] == [f"{BIG_WORD}{i}"], i


def test_local_client_streams_left_early_leave_nothing_held(small_server):
    long_text = {"text_input": np.array([LONG_TEXT.encode()], dtype=object)}
    with Client(small_server.id, arena_bytes=1 << 20) as client:
        before = ended_count(small_server)
        for _ in range(3):
            for result in client.stream("word_stream", long_text, parameters={"delay_ms": 5}):
                assert result["text_output"][0] == b"w0"
                break  # the loop drops the iterator: what it still holds and what is still coming is freed
        del result  # (a result the caller keeps holds its own response, rightly)
        client.stream("word_stream", long_text, parameters={"delay_ms": 5})  # never iterated: it runs to its end
        responses = client.stream("word_stream", long_text, parameters={"delay_ms": 5})
        assert next(responses)["text_output"][0] == b"w0"
        responses.close()  # closed explicitly, as a generator is

        async def leave_async_stream() -> None:
            async for result in client.stream_aio("word_stream", long_text, parameters={"delay_ms": 5}):
                assert result["text_output"][0] == b"w0"
                break  # asyncio closes the dropped generator

        asyncio.run(leave_async_stream())
        wait_until(lambda: ended_count(small_server) - before >= 6, "the abandoned streams finished")
        for i in range(60):
            word = f"{BIG_WORD}{i}".encode()
            results = list(client.stream("word_stream", {"text_input": np.array([word], dtype=object)}))
            assert [r["text_output"][0] for r in results] == [word]


def test_word_stream_stops_when_its_client_disconnects(small_server):
    """The bundled streaming model checks is_cancelled(): a stream of 200 words 200 ms apart (40 s)
    whose client leaves ends within a word: its final flag is sent, which counts it."""
    before = success_count(small_server)
    body = json.dumps({"text_input": LONG_TEXT, "delay_ms": 200}).encode()
    with socket.create_connection(("127.0.0.1", small_server.port), timeout=30) as sock:
        sock.sendall(b"POST /v2/models/word_stream/generate_stream HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        seen = b""
        while b"data: " not in seen:
            chunk = sock.recv(4096)
            assert chunk, f"the server closed the stream before its first event: {seen!r}"
            seen += chunk
    wait_until(lambda: success_count(small_server) > before, "the abandoned stream ended", timeout=10)


# -- a worker that dies while its streams are open ------------------------------------------------

HELD_STREAM_MODEL = """import os, threading, time
import triton_python_backend_utils as pb_utils

REPO = {repo!r}


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()

            def later(sender=sender, x=x):  # answers once the test releases it (30 s at most)
                deadline = time.time() + 30
                while not os.path.exists(os.path.join(REPO, "release")) and time.time() < deadline:
                    time.sleep(0.01)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            threading.Thread(target=later, daemon=True).start()
        open(os.path.join(REPO, f"executed.{{os.getpid()}}"), "w").close()
        return None
"""
HELD_STREAM_CONFIG = """name: "held"
backend: "python"
max_batch_size: 4
model_transaction_policy { decoupled: true }
dynamic_batching { }
instance_group [ { count: 2 kind: KIND_CPU } ]
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""


def test_a_stream_open_past_its_batch_fails_with_its_worker_and_only_with_it(server_factory, tmp_path):
    """Two instances: the broker forms the batches and forgets each once its worker says it is
    done. A request whose model answers after ``execute`` returned is then named by its worker in
    its slot: the death of that worker fails it at once (it waited forever), the death of the
    other instance leaves it to be answered."""
    (tmp_path / "held" / "1").mkdir(parents=True)
    (tmp_path / "held" / "1" / "model.py").write_text(HELD_STREAM_MODEL.format(repo=str(tmp_path)))
    (tmp_path / "held" / "config.pbtxt").write_text(HELD_STREAM_CONFIG)
    s = server_factory.start([tmp_path])
    outcomes: list = []

    def stream(client: Client, value: float) -> threading.Thread:
        def run() -> None:
            try:
                inputs = {"IN": np.full((1, 1), value, np.float32)}
                outcomes.append([r["OUT"].tolist() for r in client.stream("held", inputs)])
            except InferenceServerError as e:
                outcomes.append(e)
        t = threading.Thread(target=run)
        t.start()
        return t

    def executed_by() -> int:
        wait_until(lambda: list(tmp_path.glob("executed.*")), "the model's execute returned", 30)
        [marker] = list(tmp_path.glob("executed.*"))
        marker.unlink()
        return int(marker.suffix[1:])

    with Client(s.id) as client:
        # The other instance dies: the open stream is answered once released.
        t = stream(client, 1.0)
        running = executed_by()
        [other] = [p for p in s.worker_pids("held") if p != running]
        os.kill(other, signal.SIGKILL)
        wait_until(lambda: len(s.worker_pids("held")) == 2 and other not in s.worker_pids("held"),
                   "the other instance restarted", 60)
        (tmp_path / "release").touch()
        t.join(30)
        assert outcomes.pop() == [[[1.0]]]
        (tmp_path / "release").unlink()
        # Its own worker dies: the open stream fails with that worker's death, not after 30 s.
        t = stream(client, 2.0)
        running = executed_by()
        os.kill(running, signal.SIGKILL)
        t.join(10)
        assert not t.is_alive(), "the stream still waits for a dead worker"
        [error] = outcomes
        assert isinstance(error, InferenceServerError) and "killed by SIGKILL" in str(error), error
    wait_until(lambda: "1 request(s) failed" in s.log(), "the death logged with the request it failed", 10)


STREAM_KID = """
import sys
import numpy as np
from shmserve import Client
client = Client(sys.argv[1])
words = np.array([b" ".join([b"w"] * 20)], dtype=object)
# Words 1.5 s apart: the worker lets go of the killed client's segment while the model sleeps.
for i, _ in enumerate(client.stream("word_stream", {"text_input": words}, parameters={"delay_ms": 1500})):
    print("streaming", flush=True)
"""


def test_a_stream_whose_client_was_killed_ends_quietly_in_the_model(server):
    """The model's sends after its client died (and the worker let go of the client's segment)
    are dropped: no exception reaches the model's thread, the stream is counted as ended, and
    the model serves on."""
    import subprocess
    import sys

    from conftest import pending_requests

    def ended() -> int:
        stats = server.client().get_inference_statistics("word_stream")["model_stats"][0]["inference_stats"]
        return stats["success"]["count"] + stats["fail"]["count"]

    before = ended()
    tracebacks = server.log().count("Traceback")  # (the module's server: earlier tests' faults)
    kids = [subprocess.Popen([sys.executable, "-c", STREAM_KID, server.id], stdout=subprocess.PIPE, text=True)
            for _ in range(3)]
    try:
        for kid in kids:
            assert kid.stdout.readline().strip() == "streaming"
    finally:
        for kid in kids:
            kid.kill()
            kid.wait(30)
            kid.stdout.close()
    wait_until(lambda: pending_requests(server, "word_stream") == 0, "the broker forgot the killed clients' streams")
    wait_until(lambda: ended() == before + 3, "the model ended the killed clients' streams")
    with Client(server.id) as client:
        words = np.array([b"one two"], dtype=object)
        assert len(list(client.stream("word_stream", {"text_input": words}))) >= 2
    assert server.log().count("Traceback") == tracebacks, server.log_tail(40)


STOPPED_READER = r"""
import os, sys
import numpy as np
from shmserve.shm.client import Client
n = int(sys.argv[2])
c = Client(sys.argv[1])
words = " ".join(f"w{i}" for i in range(n))
stream = c.stream("echo_llm", {"text_input": np.array([words.encode()], dtype=object),
                               "max_tokens": np.array([n], np.int32)})
print("SENT", flush=True)
os.kill(os.getpid(), 19)  # SIGSTOP: alive, reading nothing
"""


def _next_client_after_a_stopped_reader(server, kill: bool) -> float:
    """Seconds the next client of echo_llm waits for its stream while a local client that
    filled its stream's ring has stopped reading (``kill``: and was then killed)."""
    import signal
    import subprocess
    import sys
    import time

    reader = subprocess.Popen([sys.executable, "-c", STOPPED_READER, server.id, "5000"], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert reader.stdout.readline().strip() == "SENT"
        time.sleep(1)  # (its request reaches the model, whose sends fill the ring)
        if kill:
            reader.send_signal(signal.SIGKILL)
            reader.wait(30)
        started = time.monotonic()
        with Client(server.id) as client:
            parts = [r["text_output"][0] for r in client.stream("echo_llm", {"text_input": np.array([b"hello world"],
                                                                                                    dtype=object)})]
        took = time.monotonic() - started
    finally:
        reader.kill()
        reader.wait()
        reader.stdout.close()
    assert parts == [b"hello", b" world", b" [end]"], parts
    return took


def test_a_stream_whose_client_dies_does_not_hold_its_model(server):
    """A local client streams far more responses than its stream's ring holds and is killed
    with the ring full. The broker cancels its requests within a second, and the model's send
    waiting for room gives up then, not after RING_FULL_TIMEOUT_S (60 s): the model's next
    client is answered within seconds. (Before, a dead client held the model a minute, and so
    did a killed gRPC frontend with its streams.)"""
    took = _next_client_after_a_stopped_reader(server, kill=True)
    assert took < 20, took


def test_a_local_reader_that_stops_holds_its_model_once_not_per_response(server):
    """A local client streams far more responses than its stream's ring holds (64) and stops
    reading, alive. The model's sends wait for room for 60 s (RING_FULL_TIMEOUT_S) once: then
    that response and the rest are dropped and the request is cancelled, so the next client of
    the model is answered after about a minute. Before, each response past the ring waited its
    own 60 s, holding the model for (responses - 64) minutes."""
    from shmserve.workers.stream import RING_FULL_TIMEOUT_S

    took = _next_client_after_a_stopped_reader(server, kill=False)
    assert RING_FULL_TIMEOUT_S - 5 < took < RING_FULL_TIMEOUT_S + 30, took  # (it did wait: the reader held it)


def _worker_arena_use(server, model: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for _ in range(2):  # (the first scrape lets the broker see what was freed before it)
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    family = next(f for f in text_string_to_metric_families(text) if f.name == "shmserve_arena_bytes_in_use")
    return next(s.value for s in family.samples if s.labels.get("owner") == "worker" and s.labels.get("model") == model)


def test_closing_a_client_with_a_stream_unread_frees_what_its_ring_held(server):
    """A client that closes with a stream's responses unread on its ring: those blocks lie in
    the worker's arena, and the closing process lives on. They are freed at the close (and the
    worker drops what the cancelled stream would still send), not when the process exits: a
    program that opens a client per job and leaves streams early does not fill the model's
    arena for every other client."""
    words = np.array([" ".join(f"w{i}" for i in range(3000)).encode()], dtype=object)

    def one_word() -> None:
        with Client(server.id) as client:
            assert len(list(client.stream("echo_llm", {"text_input": np.array([b"x"], dtype=object)}))) >= 1

    one_word()
    before = _worker_arena_use(server, "echo_llm")
    for _ in range(12):
        client = Client(server.id)
        stream = client.stream("echo_llm", {"text_input": words, "max_tokens": np.array([3000], np.int32)})
        next(stream)
        client.close()  # (while the model still sends)
    del stream  # (what the last stream had taken from its ring is its own, freed with it)
    gc.collect()
    one_word()  # (the worker's next allocation reclaims what was freed)
    wait_until(lambda: _worker_arena_use(server, "echo_llm") <= before + 4096,
               "the closed clients' unread responses freed in the worker's arena")


def test_an_idle_models_arena_gauge_falls_to_what_is_still_held(server):
    """The gauge of a worker's arena was what it held after its last round: the responses of a
    stream still unread then were counted for as long as the model stayed idle, long after its
    client read and freed them (the next allocation reclaims them). An idle worker looks again
    within its periodic check (10 s)."""
    words = np.array([" ".join(f"w{i}" for i in range(200)).encode()], dtype=object)
    with Client(server.id) as client:
        parts = client.stream("echo_llm", {"text_input": words, "max_tokens": np.array([300], np.int32)})
        assert len([r["text_output"] for r in parts]) >= 200
    gc.collect()
    wait_until(lambda: _worker_arena_use(server, "echo_llm") == 0, "the idle worker's gauge says nothing is held", 30)


def test_a_closed_client_says_so_and_a_call_racing_its_close_ends(server):
    """A call on a closed client is a ValueError that says so (not a released-memory error or a
    'retry later'); a call racing ``close()`` on another thread either completes, fails as
    closed, or fails with the close's 503: it never waits for good."""
    import concurrent.futures

    x = {"text_input": np.array([b"a b"], dtype=object)}
    client = Client(server.id)
    client.close()
    with pytest.raises(ValueError, match="this client is closed"):
        client.infer("echo_llm", x)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for _ in range(60):
            client = Client(server.id)

            def calls(c: Client = client) -> None:
                for _ in range(50):
                    try:
                        list(c.stream("echo_llm", x))
                    except ValueError as e:
                        assert "this client is closed" in str(e)
                        return
                    except InferenceServerError as e:
                        assert "closed while the request was in flight" in str(e), e
                        return

            future = pool.submit(calls)
            time.sleep(0.002)
            client.close()
            future.result(timeout=30)


def test_a_client_closed_from_its_own_callback_closes(server):
    """A completion callback runs on the client's waiter thread; closing the client there ends
    that thread's work rather than joining it (which raised, leaving the close half done)."""
    client = Client(server.id)
    closed = threading.Event()

    def on_done(_future: object) -> None:
        client.close()
        closed.set()

    client.infer_async("echo_llm", {"text_input": np.array([b"a b"], dtype=object)}).add_done_callback(on_done)
    assert closed.wait(30), "close() from the callback did not return"
    with pytest.raises(ValueError, match="this client is closed"):
        client.infer("echo_llm", {"text_input": np.array([b"a"], dtype=object)})
