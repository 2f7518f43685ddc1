"""The response sender of a non-decoupled Python model (Triton's python backend 24.06+), against a
real server: one response and the final flag, in one ``send`` or two, during ``execute`` or from a
thread after it returned, over HTTP, gRPC and the local client; a dynamic batch answered out of
order from threads; Triton's refusals and their texts; a model that never sends the final flag
leaves the client's timeout working and nothing held; and a few hundred such requests leave the
worker's memory and arena where they were."""
from __future__ import annotations

import concurrent.futures
import queue
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import TESTS, stat_fields, wait_until
from shmserve import Client
from shmserve.shm.client import InferenceServerError
from shmserve.workers.late_answers import ABANDONED
from shmserve.workers.python_backend.sender import CLOSED, FINAL_FIRST, MORE_THAN_ONE, NO_RESPONSE, \
    NOT_RETURNED, UNSUPPORTED_FLAG
from test_ensembles import arena_use
from test_untrusted_clients import rss_kb

MODEL = "sender_modes"
ANSWERED = ["one_call", "two_calls", "thread", "thread_one_call", "list_none"]


@pytest.fixture(scope="module")
def server(module_factory):
    return module_factory.start([TESTS / "models" / "sender"], [
        "--model-control-mode", "explicit", "--load-model", MODEL, "--load-model", "sender_batch",
        "--http-workers", "1", "--frontend-arena-mb", "1"])


def http_y(server, mode: str, x: list[int], **params) -> list[int]:
    client = httpclient.InferenceServerClient(server.url, network_timeout=120)
    try:
        inp = httpclient.InferInput("X", [len(x)], "INT32")
        inp.set_data_from_numpy(np.array(x, np.int32))
        return client.infer(MODEL, [inp], parameters={"mode": mode, **params}).as_numpy("Y").tolist()
    finally:
        client.close()


def grpc_y(server, mode: str, x: list[int], **params) -> list[int]:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        inp = grpcclient.InferInput("X", [len(x)], "INT32")
        inp.set_data_from_numpy(np.array(x, np.int32))
        return client.infer(MODEL, [inp], parameters={"mode": mode, **params}).as_numpy("Y").tolist()
    finally:
        client.close()


def local_y(server, mode: str, x: list[int], **params) -> list[int]:
    with Client(server.id) as client:
        return client.infer(MODEL, {"X": np.array(x, np.int32)}, parameters={"mode": mode, **params})["Y"].tolist()


CALLERS = {"http": http_y, "grpc": grpc_y, "local": local_y}


@pytest.mark.parametrize("protocol", sorted(CALLERS))
def test_one_response_and_the_final_flag_however_sent(server, protocol):
    """In one call or two, in execute or from a thread 0.3 s after it returned (execute returning
    None, or None in its list): the client gets the one response."""
    call = CALLERS[protocol]
    for i, mode in enumerate(ANSWERED):
        assert call(server, mode, [i, 7], delay_ms=300) == [2 * i, 14], mode


def test_streaming_calls_get_the_late_answer_as_their_one_response(server):
    """The local client's ``stream()`` and gRPC's ModelStreamInfer to such a model: one response,
    sent from a thread after execute returned, then the stream ends."""
    with Client(server.id) as client:
        once = list(client.stream(MODEL, {"X": np.array([3], np.int32)}, parameters={"mode": "thread"}))
        assert [r["Y"].tolist() for r in once] == [[6]]
    got: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        c.start_stream(callback=lambda result, error: got.put(error if error is not None else result))
        for i in range(3):
            inp = grpcclient.InferInput("X", [1], "INT32")
            inp.set_data_from_numpy(np.array([i], np.int32))
            c.async_stream_infer(MODEL, [inp], parameters={"mode": "thread", "delay_ms": 100 * (3 - i)})
        c.stop_stream()  # (waits for every answer)
    results = [got.get_nowait() for _ in range(got.qsize())]
    assert sorted(r.as_numpy("Y").tolist() for r in results) == [[0], [2], [4]]


def test_a_late_answer_does_not_hold_up_other_requests(server):
    """While a thread of the model still has a request to answer, the worker runs the next ones."""
    late: dict[str, list[int]] = {}
    waiting = threading.Thread(target=lambda: late.setdefault("y", local_y(server, "thread", [5], delay_ms=4000)))
    waiting.start()
    try:
        started = time.monotonic()
        assert [http_y(server, "one_call", [i]) for i in range(5)] == [[2 * i] for i in range(5)]
        assert time.monotonic() - started < 3.5 and "y" not in late
    finally:
        waiting.join(60)
    assert late["y"] == [10]


def test_a_dynamic_batch_answered_out_of_order_from_threads(server):
    """Four requests form one batch (preferred size 4); each is answered from its own thread, the
    last first, after execute returned, and each client gets its own answer."""
    with Client(server.id) as client:
        futures = [client.infer_async("sender_batch", {"X": np.array([[i]], np.int32)}) for i in range(4)]
        assert [f.result(60)["Y"].tolist() for f in futures] == [[[4000 + i]] for i in range(4)]
    clients = [grpcclient.InferenceServerClient(server.grpc_url) for _ in range(4)]
    try:
        def call(i: int) -> list:
            inp = grpcclient.InferInput("X", [1, 1], "INT32")
            inp.set_data_from_numpy(np.array([[i]], np.int32))
            return clients[i].infer("sender_batch", [inp]).as_numpy("Y").tolist()

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(call, range(4))) == [[[4000 + i]] for i in range(4)]
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("mode,text", [("twice", MORE_THAN_ONE), ("final_first", FINAL_FIRST),
                                       ("sent_and_returned", MORE_THAN_ONE)])
def test_what_triton_refuses_fails_the_request_with_its_text(server, mode, text):
    with pytest.raises(InferenceServerException, match=text.replace(".", r"\.")):
        http_y(server, mode, [1])
    with pytest.raises(InferenceServerException, match=text.replace(".", r"\.")):
        grpc_y(server, mode, [1])
    with pytest.raises(InferenceServerError, match=text.replace(".", r"\.")) as e:
        local_y(server, mode, [1])
    assert e.value.status == 500
    assert http_y(server, "one_call", [3]) == [6]  # the instance serves on


def test_each_refused_send_raises_tritons_text_in_the_model(server):
    """From a thread after execute returned: the sends Triton refuses raise its texts in the
    model, before the answer and after the final flag; the answer itself goes through."""
    with Client(server.id) as client:
        result = client.infer(MODEL, {"X": np.array([4], np.int32)}, parameters={"mode": "probe"})
        assert result["Y"].tolist() == [8]
        assert [e.decode() for e in result["ERRORS"].tolist()] == [UNSUPPORTED_FLAG, NO_RESPONSE, FINAL_FIRST]

        def after_final() -> list[str]:
            report = client.infer(MODEL, {"X": np.array([0], np.int32)}, parameters={"mode": "report"})
            return [e.decode() for e in report["ERRORS"].tolist()]

        wait_until(lambda: len(after_final()) == 3, "the probe's sends after its final flag")
        assert after_final() == [MORE_THAN_ONE, CLOSED, MORE_THAN_ONE]


def test_a_sender_released_without_the_final_flag_answers_an_error(server):
    """execute returned None and the model kept neither the request nor its sender: no response
    can come any more, and the client hears so at once instead of waiting forever."""
    for call in CALLERS.values():
        started = time.monotonic()
        with pytest.raises((InferenceServerException, InferenceServerError), match=ABANDONED):
            call(server, "abandon", [1])
        assert time.monotonic() - started < 30


def test_a_model_that_returns_none_and_never_took_the_sender_is_told_it_returned_nothing(server):
    """The newcomer's missing `return` in execute: not the sender's jargon but what to return
    (Triton leaves the client waiting); the instance serves on."""
    assert "returns a list of one pb_utils.InferenceResponse per request" in NOT_RETURNED
    for call in CALLERS.values():
        started = time.monotonic()
        with pytest.raises((InferenceServerException, InferenceServerError)) as e:
            call(server, "forgot_return", [1])
        assert NOT_RETURNED in str(e.value) and ABANDONED not in str(e.value), e.value
        assert time.monotonic() - started < 30
    assert http_y(server, "one_call", [3]) == [6]


def test_a_model_that_never_sends_the_final_flag(server):
    """The client's own timeout ends its call (the server then answers the kept request as
    cancelled, so its slot and its block in the client's 1 MiB arena come back: 40 requests of
    100 kB cross that arena four times after it; over HTTP, the frontend's), and the model still
    holds the senders. When it lets go of them later, the worker has nothing left to answer and
    sleeps on."""
    with Client(server.id, arena_bytes=1 << 20) as client:
        for _ in range(2):
            with pytest.raises(InferenceServerError, match="Deadline Exceeded"):
                client.infer(MODEL, {"X": np.arange(10, dtype=np.int32)}, parameters={"mode": "never"},
                             client_timeout=0.5)
        # (answered as cancelled once the worker hears of the timeout: under load that may take a
        # moment, and until then their blocks are held, as they must be)
        wait_until(lambda: not client._conn._slots.inflight, "the kept requests answered as cancelled", 30)
        x = np.arange(25_000, dtype=np.int32)
        for _ in range(40):
            assert client.infer(MODEL, {"X": x}, parameters={"mode": "one_call"})["Y"][-1] == 2 * x[-1]
        assert release(client) == 2  # the model held both senders meanwhile
    pid = server.worker_pids(MODEL)[0]
    time.sleep(0.5)
    used = cpu_ticks(pid)
    time.sleep(2)
    assert cpu_ticks(pid) - used < 50, "the worker kept running with nothing to do"
    # An HTTP client that gives up disconnects: the frontend cancels, and its 1 MiB arena, which
    # held the 100 kB request, comes back too.
    http = httpclient.InferenceServerClient(server.url, network_timeout=1)
    try:
        inp = httpclient.InferInput("X", [len(x)], "INT32")
        inp.set_data_from_numpy(x)
        with pytest.raises(Exception):
            http.infer(MODEL, [inp], parameters={"mode": "never"})
    finally:
        http.close()
    http = httpclient.InferenceServerClient(server.url, network_timeout=120)
    try:
        for _ in range(40):
            assert http.infer(MODEL, [inp], parameters={"mode": "one_call"}).as_numpy("Y")[-1] == 2 * x[-1]
    finally:
        http.close()
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        inp = grpcclient.InferInput("X", [1], "INT32")
        inp.set_data_from_numpy(np.array([1], np.int32))
        with pytest.raises(InferenceServerException, match="Deadline Exceeded"):
            grpc.infer(MODEL, [inp], parameters={"mode": "never"}, client_timeout=0.5)
    finally:
        grpc.close()
    with Client(server.id) as client:
        assert release(client) == 2


def release(client: Client) -> int:
    """How many senders of "never" requests the model held; it lets go of them."""
    report = client.infer(MODEL, {"X": np.array([0], np.int32)}, parameters={"mode": "release"})
    return int(report["ERRORS"][0])


def test_hundreds_of_late_answers_leave_nothing_behind(server):
    """300 requests answered from threads after execute returned (20 in flight at a time): the
    worker's memory does not grow past a warm-up, its output arena comes back, and each request
    counts once as a success."""
    pid = server.worker_pids(MODEL)[0]
    x = np.arange(1000, dtype=np.int32)

    def rounds(n: int) -> None:
        with Client(server.id) as client:
            for _ in range(n // 20):
                futures = [client.infer_async(MODEL, {"X": x}, parameters={"mode": "thread"}) for _ in range(20)]
                for f in futures:
                    assert f.result(60)["Y"][-1] == 2 * x[-1]

    rounds(100)
    before = rss_kb(pid)
    successes = stats_success(server)
    rounds(300)
    assert stats_success(server) - successes == 300
    assert rss_kb(pid) - before < 8 * 1024
    assert arena_use(server)[("worker", MODEL)] < 256 << 10


def cpu_ticks(pid: int) -> int:
    fields = stat_fields(pid)
    assert fields is not None
    return int(fields[11]) + int(fields[12])


def stats_success(server) -> int:
    client = httpclient.InferenceServerClient(server.url)
    try:
        stats = client.get_inference_statistics(MODEL)["model_stats"][0]
        return int(stats["inference_stats"]["success"]["count"])
    finally:
        client.close()


def test_a_worker_that_dies_fails_the_requests_it_kept(server):
    """A batch the broker forwarded is done for the broker once execute returns; if the worker then
    dies before its thread answers, the broker still fails the request (its slot names the
    worker), and the restarted instance serves."""
    with Client(server.id) as client:
        with pytest.raises(InferenceServerError) as e:
            client.infer("sender_batch", {"X": np.array([[-1]], np.int32)}, client_timeout=60)
        assert e.value.status == 500 and "sender_batch" in e.value.message, e.value.message
        wait_until(lambda: ready(server, "sender_batch"), "sender_batch ready again")
        futures = [client.infer_async("sender_batch", {"X": np.array([[i]], np.int32)}) for i in range(4)]
        assert [f.result(60)["Y"].tolist() for f in futures] == [[[4000 + i]] for i in range(4)]


def test_unloading_answers_what_the_model_never_finished(server):
    """The instance stops with a request still kept: it is answered with a 500 naming the instance
    (the model held its sender and never sent the final flag; not a 503, which clients retry, and
    the request ran), and the model loads again."""
    http = httpclient.InferenceServerClient(server.url, network_timeout=120)
    try:
        with Client(server.id) as client:
            executions = stats_executions(server)
            kept = client.infer_async(MODEL, {"X": np.array([1], np.int32)}, parameters={"mode": "never"})
            wait_until(lambda: stats_executions(server) > executions, "the never-answered request ran")
            http.unload_model(MODEL)
            with pytest.raises(InferenceServerError) as e:
                kept.result(60)
            assert e.value.status == 500 and "stopped before its model sent the request's final response" in \
                e.value.message and "retry" not in e.value.message, e.value.message
        http.load_model(MODEL)
        assert http_y(server, "one_call", [2]) == [4]
    finally:
        http.close()


def ready(server, model: str) -> bool:
    client = httpclient.InferenceServerClient(server.url)
    try:
        return client.is_model_ready(model)
    finally:
        client.close()


def stats_executions(server) -> int:
    client = httpclient.InferenceServerClient(server.url)
    try:
        return int(client.get_inference_statistics(MODEL)["model_stats"][0]["execution_count"])
    finally:
        client.close()
