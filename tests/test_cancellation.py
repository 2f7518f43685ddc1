"""Request cancellation, Triton's semantics: a request whose client went away (an HTTP client that
disconnects, a local caller's cancel or timeout, a BLS iterator's ``cancel()``) never runs if it
has not started, a running model sees ``is_cancelled()`` (request and response sender) and may
stop, and nothing is left held: the worker serves the next request, and requests that cross the
frontend's and the worker's arenas (1 MiB each) several times find them free (a block held for
good would stall these FIFO arenas)."""
from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from shmserve.server.frontend.asgi import WATCH_AFTER_S
from conftest import TESTS, pending_requests, wait_pending, wait_until
from gates import Gate
from shmserve import Client
from shmserve.shm.client import InferenceServerError

CANCEL_MODELS = TESTS / "models" / "cancel"


@pytest.fixture(scope="module")
def server(module_factory):
    return module_factory.start([CANCEL_MODELS], ["--http-workers", "1", "--frontend-arena-mb", "1",
                                                  "--worker-arena-mb", "1"])


def cross_arenas(server, gate: Gate) -> None:
    """60 requests of 48 kB and their 48 kB answers through an open gate: each arena crosses
    about three times, which it can only while every earlier block was given back."""
    gate.open()
    client = httpclient.InferenceServerClient(server.url, network_timeout=120)
    try:
        for i in range(60):
            inp = httpclient.InferInput("X", [12_000], "INT32")
            inp.set_data_from_numpy(np.full(12_000, i, np.int32))
            out = client.infer("held", [inp], parameters={"gate": gate.param}).as_numpy("Y")
            assert out.shape == (12_000,) and int(out[-1]) == i
    finally:
        client.close()


def held_infer(server, gate: Gate, x: int, request_id: str = "") -> int:
    """One tritonclient call of ``held`` (blocks while its gate is shut); its Y."""
    client = httpclient.InferenceServerClient(server.url, network_timeout=120)
    try:
        inp = httpclient.InferInput("X", [1], "INT32")
        inp.set_data_from_numpy(np.array([x], np.int32))
        result = client.infer("held", [inp], request_id=request_id, parameters={"gate": gate.param})
        return int(result.as_numpy("Y")[0])
    finally:
        client.close()


def raw_post(server, path: str, body: dict) -> socket.socket:
    """A POST sent whole on a connection of its own, left open for the caller to drop."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (path.encode(), len(data), data))
    return sock


def frontend_barrier(server) -> None:
    """A request through the (one) frontend after a disconnect: its loop has run since, so it has
    seen the connection close and cancelled what was in flight on it. The frontend watches a
    connection only once its answer is late (``WATCH_AFTER_S``): that long first, so the watch has
    begun before the requests that the barrier's answers follow."""
    time.sleep(2 * WATCH_AFTER_S)
    for _ in range(2):
        assert server.http_status("/v2/health/ready") == 200


def cancelled_count(server, model: str) -> int:
    """Triton's failure counter for the reason CANCELED."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30).read().decode()
    head = f'nv_inference_request_failure{{model="{model}",'
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(head) and 'reason="CANCELED"' in line]
    assert values, f"no CANCELED failure count for {model}"
    return int(sum(values))


def test_a_queued_http_request_whose_client_disconnects_never_runs(server, tmp_path):
    gate = Gate(tmp_path / "gate")
    cancelled = cancelled_count(server, "held")
    first: dict[str, int] = {}
    running = threading.Thread(target=lambda: first.setdefault("y", held_infer(server, gate, 1)))
    running.start()
    gate.wait_started(1)
    sock = raw_post(server, "/v2/models/held/infer", {
        "inputs": [{"name": "X", "shape": [1], "datatype": "INT32", "data": [2]}], "parameters": {"gate": gate.param}})
    wait_pending(server, "held", 2)  # queued on the worker's lane behind the running one
    sock.close()
    frontend_barrier(server)
    gate.open()
    running.join(120)
    assert first == {"y": 1}
    assert held_infer(server, gate, 3) == 3  # the worker serves on; the lane's order puts it after the dropped one
    assert len(gate.started()) == 2, "the cancelled request ran"
    assert cancelled_count(server, "held") == cancelled + 1  # answered with the cancelled error, counted as Triton does
    assert pending_requests(server, "held") == 0
    cross_arenas(server, gate)


def test_a_running_stream_stops_when_its_http_client_disconnects(server, tmp_path):
    gate = Gate(tmp_path / "gate")
    sock = raw_post(server, "/v2/models/ticker/generate_stream", {"N": 1, "gate": gate.param})
    seen = b""
    while b"data: " not in seen:
        chunk = sock.recv(4096)
        assert chunk, f"the stream closed before its first event: {seen!r}"
        seen += chunk
    sock.close()
    wait_until(lambda: any(gate.folder.glob("stopped-*")), "the model saw is_cancelled() and stopped")
    with Client(server.id) as client:  # the worker serves the next request
        results = [int(r["T"][0]) for r in client.stream("ticker", {"N": np.array([1], np.int32)},
                                                         parameters={"count": 3})]
    assert results == [0, 1, 2]
    cross_arenas(server, gate)


def test_local_client_cancel_and_timeout(server, tmp_path):
    gate = Gate(tmp_path / "gate")
    x = {"X": np.array([7], np.int32)}
    with Client(server.id, arena_bytes=1 << 20) as client:
        running = client.infer_async("held", x, request_id="running", parameters={"gate": gate.param})
        gate.wait_started(1)
        queued = client.infer_async("held", x, request_id="queued", parameters={"gate": gate.param})
        wait_pending(server, "held", 2)
        assert queued.cancel()  # queued: it never runs
        assert running.cancel()  # running: its model sees is_cancelled() and returns
        wait_until(lambda: (gate.folder / "saw-cancel-running").exists(), "the running model saw the cancel")
        # A caller's deadline cancels the same way.
        with pytest.raises(InferenceServerError) as e:
            client.infer("held", x, request_id="late", parameters={"gate": gate.param}, client_timeout=2.0)
        assert e.value.status == 504
        wait_until(lambda: (gate.folder / "saw-cancel-late").exists(), "the model saw the caller's deadline")
        gate.open()
        assert int(client.infer("held", x, parameters={"gate": gate.param})["Y"][0]) == 7
        assert len(gate.started()) == 3, "the cancelled queued request ran"  # running, late, the last one
        # A stream's cancel() stops its model.
        stream_gate = Gate(tmp_path / "stream")
        responses = client.stream("ticker", {"N": np.array([1], np.int32)}, parameters={"gate": stream_gate.param})
        assert int(next(responses)["T"][0]) == 0
        responses.cancel()
        wait_until(lambda: any(stream_gate.folder.glob("stopped-*")), "the streaming model stopped")
        for i in range(60):  # the client's own arena (1 MiB) and the worker's, crossed as in cross_arenas
            big = np.full(12_000, i, np.int32)
            assert int(client.infer("held", {"X": big}, parameters={"gate": gate.param})["Y"][-1]) == i
    assert pending_requests(server, "held") == 0


@pytest.mark.parametrize("use_async", [False, True], ids=["exec", "async_exec"])
def test_bls_stream_iterator_cancel_stops_the_callee(server, tmp_path, use_async):
    gate = Gate(tmp_path / "gate")
    client = httpclient.InferenceServerClient(server.url, network_timeout=120)
    try:
        n = httpclient.InferInput("N", [1], "INT32")
        n.set_data_from_numpy(np.array([1], np.int32))
        result = client.infer("ticker_caller", [n], parameters={"gate": gate.param, "async": use_async})
    finally:
        client.close()
    assert int(result.as_numpy("READ")[0]) == 1
    wait_until(lambda: any(gate.folder.glob("stopped-*")), "the callee saw is_cancelled() and stopped")
    with Client(server.id) as local:
        assert len(list(local.stream("ticker", {"N": np.array([1], np.int32)}, parameters={"count": 2}))) == 2
    cross_arenas(server, gate)


def test_a_request_cancelled_in_the_brokers_queue_is_dropped_there(server, tmp_path):
    gate = Gate(tmp_path / "gate")
    x = {"X": np.array([[5]], np.int32)}
    with Client(server.id) as client:
        running = [client.infer_async("held_pair", x, parameters={"gate": gate.param}) for _ in range(2)]
        gate.wait_started(2)
        queued = client.infer_async("held_pair", x, parameters={"gate": gate.param})
        wait_pending(server, "held_pair", 3)
        assert queued.cancel()
        # Answered by the broker at once, while both instances still run: no longer pending.
        wait_until(lambda: pending_requests(server, "held_pair") == 2, "the broker dropped the cancelled request",
                   timeout=30)
        gate.open()
        assert [int(f.result(60)["Y"][0][0]) for f in running] == [5, 5]
        assert int(client.infer("held_pair", x, parameters={"gate": gate.param})["Y"][0][0]) == 5
    assert len(gate.started()) == 3, "the cancelled request ran"
    # (the pending count is the broker's, which learns of the last answer just after its client)
    wait_until(lambda: pending_requests(server, "held_pair") == 0, "nothing pending")
    assert cancelled_count(server, "held_pair") == 1


# A disconnect must reach a model that is between two responses (a long prefill, a slow token): the
# frontend listens for it while it waits, not only when it next sends. "Soon" is far below the 30 s
# the model waits between words, and generous for a loaded host.
STOPPED_WITHIN_S = 10.0


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    seen = b""
    while marker not in seen:
        chunk = sock.recv(4096)
        assert chunk, f"the stream closed before {marker!r}: {seen!r}"
        seen += chunk
    return seen


def assert_stopped_after_one_word(folder: Path) -> None:
    wait_until(lambda: any(folder.glob("stopped-*")), "the model saw is_cancelled() and stopped",
               timeout=STOPPED_WITHIN_S)
    assert sorted(p.name for p in folder.glob("sent-*")) == ["sent-0"]


def test_a_slow_generate_stream_stops_when_its_client_disconnects(server, tmp_path):
    sock = raw_post(server, "/v2/models/slow_words/generate_stream", {"text_input": str(tmp_path)})
    try:
        assert b"word0" in read_until(sock, b"word0")
    finally:
        sock.close()
    assert_stopped_after_one_word(tmp_path)
    cross_arenas(server, Gate(tmp_path / "gate"))


def test_a_slow_openai_chat_stream_stops_when_its_client_disconnects(server, tmp_path):
    import openai

    with openai.OpenAI(base_url=f"http://{server.url}/v1", api_key="unused", max_retries=0) as client:
        stream = client.chat.completions.create(model="slow_words", stream=True,
                                                messages=[{"role": "user", "content": str(tmp_path)}])
        text = ""
        for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            if "word0" in text:
                break
        stream.close()  # an unread response: httpx drops its connection
    assert_stopped_after_one_word(tmp_path)
    cross_arenas(server, Gate(tmp_path / "gate"))


@pytest.mark.parametrize("path, body", [
    ("/v2/models/slow_words/generate", lambda folder: {"text_input": folder}),
    ("/v1/chat/completions", lambda folder: {"model": "slow_words", "messages": [{"role": "user", "content": folder}]}),
    ("/v1/completions", lambda folder: {"model": "slow_words", "prompt": folder}),
], ids=["generate", "chat", "completion"])
def test_a_slow_answer_collected_whole_stops_when_its_client_disconnects(server, tmp_path, path, body):
    """The routes that collect a model's responses into one answer send nothing until the end:
    the frontend listens for the disconnect while it waits."""
    sock = raw_post(server, path, body(str(tmp_path)))
    try:
        wait_until(lambda: (tmp_path / "sent-0").exists(), "the model sent its first word")
    finally:
        sock.close()
    assert_stopped_after_one_word(tmp_path)
    cross_arenas(server, Gate(tmp_path / "gate"))


def test_a_queued_stream_whose_client_disconnects_never_runs(server, tmp_path):
    running, queued, after = (tmp_path / name for name in ("running", "queued", "after"))
    for folder in (running, queued, after):
        folder.mkdir()
    first = raw_post(server, "/v2/models/slow_words/generate_stream", {"text_input": str(running)})
    try:
        read_until(first, b"word0")
        second = raw_post(server, "/v2/models/slow_words/generate_stream", {"text_input": str(queued)})
        wait_pending(server, "slow_words", 2)  # behind the running one (one instance)
        second.close()
        frontend_barrier(server)
    finally:
        first.close()
    assert_stopped_after_one_word(running)
    third = raw_post(server, "/v2/models/slow_words/generate_stream", {"text_input": str(after)})
    try:
        read_until(third, b"word0")  # the model serves on: whatever came before it is over
    finally:
        third.close()
    assert_stopped_after_one_word(after)
    assert not list(queued.iterdir()), "the cancelled queued stream ran"
    wait_until(lambda: pending_requests(server, "slow_words") == 0, "nothing pending")


def test_a_slow_grpc_stream_stops_when_its_client_cancels_it(server, tmp_path):
    import queue

    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([str(tmp_path).encode()], dtype=object))
        client.async_stream_infer("slow_words", [text])
        result, error = results.get(timeout=60)
        assert error is None and result.as_numpy("text_output")[0] == b"word0 "
        client.stop_stream(cancel_requests=True)  # the RPC ends as it does when the client's connection drops
    finally:
        client.close()
    assert_stopped_after_one_word(tmp_path)
