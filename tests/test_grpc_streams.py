"""Requests on one gRPC stream run side by side, as Triton runs them (server/grpc/stream.py):
requests pipelined on a stream batch together, a quick one is answered while a long one still
streams, a sequence's requests reach the model in the order sent, and a stream of many more
requests than run at once is answered whole."""
from __future__ import annotations

import queue
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from conftest import DEADLINE_S, TESTS, wait_until
from gates import Gate
from shmserve.server.grpc.stream import MAX_RUNNING

BATCHING = TESTS / "models" / "batching"
CANCEL = TESTS / "models" / "cancel"
SEQUENCES = TESTS / "models" / "sequences"
STREAMS = TESTS / "models" / "streams"


@pytest.fixture(scope="module")
def server(module_factory):
    return module_factory.start([BATCHING, CANCEL, SEQUENCES, STREAMS]).wait_grpc_ready()


class Stream:
    """One stream of tritonclient.grpc: what comes back, each with when it came."""

    def __init__(self, server) -> None:
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.got: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.got.put((time.monotonic(), error or result)))

    def send(self, model: str, inputs: list, **kw) -> None:
        self.client.async_stream_infer(model, inputs, **kw)

    def take(self, n: int, timeout: float = 60.0) -> list:
        return [self.got.get(timeout=timeout) for _ in range(n)]

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def _probe(rows: int = 1) -> list:
    x = grpcclient.InferInput("INPUT0", [rows, 2], "FP32")
    x.set_data_from_numpy(np.ones((rows, 2), np.float32))
    return [x]


def test_requests_pipelined_on_a_stream_batch_together(server):
    """probe batches 4 at once (its preferred size): four requests sent back to back on one stream
    run as one batch, where one after another each waited out the queue delay alone."""
    stream = Stream(server)
    try:
        for i in range(4):
            stream.send("probe", _probe(), request_id=f"r{i}")
        answers = [result for _, result in stream.take(4)]
    finally:
        stream.close()
    assert sorted(a.get_response().id for a in answers) == ["r0", "r1", "r2", "r3"]
    assert [int(a.as_numpy("REQS")[0, 0]) for a in answers] == [4, 4, 4, 4]


def test_a_quick_request_is_answered_while_a_long_one_streams(server):
    """ticker streams 400 responses 5 ms apart (2 s at least); probe, sent after it on the same
    stream, is answered long before the ticker's last response."""
    stream = Stream(server)
    try:
        n = grpcclient.InferInput("N", [1], "INT32")
        n.set_data_from_numpy(np.array([0], np.int32))
        stream.send("ticker", [n], request_id="long", parameters={"count": 400}, enable_empty_final_response=True)
        stream.send("probe", _probe(), request_id="quick")
        came = stream.take(402)
    finally:
        stream.close()
    ids = [result.get_response().id for _, result in came]
    assert ids.count("long") == 401 and ids.count("quick") == 1, ids
    quick = ids.index("quick")
    assert quick < 200, f"the quick request came after {quick} of the long one's responses"
    assert came[-1][0] - came[quick][0] > 0.5


def test_a_sequence_on_one_stream_reaches_the_model_in_the_order_sent(server):
    """A running sum over a stream whose requests are all sent before any answer came."""
    stream = Stream(server)
    values = list(range(1, 41))
    try:
        for i, v in enumerate(values):
            x = grpcclient.InferInput("VALUE", [1, 1], "INT32")
            x.set_data_from_numpy(np.array([[v]], np.int32))
            stream.send("seq_direct", [x], request_id=str(i), sequence_id=4242, sequence_start=i == 0,
                        sequence_end=i == len(values) - 1)
        answers = {r.get_response().id: int(r.as_numpy("SUM").reshape(-1)[0]) for _, r in stream.take(len(values))}
    finally:
        stream.close()
    assert [answers[str(i)] for i in range(len(values))] == list(np.cumsum(values))


def _pipelined(server, count: int) -> list:
    """``count`` requests to probe_unbatched sent on one stream before any answer is read; what
    came back, in the order it came."""
    stream = Stream(server)
    try:
        for i in range(count):
            stream.send("probe_unbatched", _probe(), request_id=str(i))
        return stream.take(count)
    finally:
        stream.close()


def test_responses_come_back_in_the_order_their_model_answered(server):
    """A client may read a stream's answers by position (tritonclient sets no request id by
    default): one instance answering the requests one by one, in the order sent, sends them back
    in that order, as Triton does, even when several are answered between two looks."""
    count = 300
    answers = _pipelined(server, count)
    ids = [int(r.get_response().id) for _, r in answers]
    ran = [int(r.as_numpy("ORDER")[0, 0]) for _, r in answers]
    assert ran == sorted(ran), [(ids[k], ran[k]) for k in range(count) if k and ran[k] < ran[k - 1]][:10]
    assert ids == list(range(count)), [k for k, i in enumerate(ids) if i != k][:10]


def test_answers_of_models_that_are_not_decoupled_come_in_the_order_sent(server, tmp_path):
    """Triton writes the one response of each request to a model that is not decoupled in the
    order the requests were read, a refusal's included: a quick request sent after a slow one
    on the same stream runs at once, and its answer waits for the slow one's."""
    gate = Gate(tmp_path / "gate")
    stream = Stream(server)
    try:
        stream.send("probe_unbatched", _probe(), request_id="slow", parameters={"gate": gate.param})
        gate.wait_started(1)
        ran = executions(server, "probe_prio")
        stream.send("probe_prio", _probe(), request_id="quick")
        stream.send("no_such_model", _probe(), request_id="refused")
        wait_until(lambda: executions(server, "probe_prio") == ran + 1, "the quick request ran")
        time.sleep(0.2)  # (its answer, were it sent, would be in by now)
        assert stream.got.empty(), "an answer overtook the slow request's"
        gate.open()
        came = stream.take(3)
    finally:
        gate.open()
        stream.close()
    assert [getattr(r, "get_response", lambda: None)() is not None for _, r in came] == [True, True, False]
    assert [r.get_response().id for _, r in came[:2]] == ["slow", "quick"]
    assert "Request for unknown model: 'no_such_model'" in str(came[2][1])


def test_a_model_loaded_decoupled_after_a_stream_asked_streams_all_its_responses(server_factory):
    """A stream asks once whether a model is decoupled; asked before the model was loaded, it is
    told no, and a request to it waits its turn. Loaded then as decoupled, the model sends five
    responses to one request: the first spends the request's turn, the rest go as they come (they
    used to wait for a turn that would never come again, and the stream never ended)."""
    s = server_factory.start([STREAMS], ["--model-control-mode", "explicit"]).wait_grpc_ready()
    stream = Stream(s)
    n = grpcclient.InferInput("N", [1], "INT32")
    n.set_data_from_numpy(np.array([0], np.int32))
    try:
        stream.send("burst", [n], request_id="before")
        [(_, refused)] = stream.take(1)
        assert "Request for unknown model" in str(refused), refused
        with grpcclient.InferenceServerClient(s.grpc_url) as c:
            c.load_model("burst")
        stream.send("burst", [n], request_id="after", parameters={"count": 5})
        came = stream.take(5, timeout=DEADLINE_S)
    finally:
        stream.close()
    assert [(r.get_response().id, int(r.as_numpy("T")[0])) for _, r in came] == [("after", k) for k in range(5)]


def executions(server, model: str) -> int:
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        return int(c.get_inference_statistics(model).model_stats[0].execution_count)


@pytest.mark.parametrize("empty_final", [False, True])
def test_a_decoupled_models_responses_to_one_request_come_before_those_to_the_next(server, empty_final):
    """burst sends each request's responses at once, one request after another: they come back
    in that order, not interleaved request by request, as Triton writes them, and a request's
    empty final response (which comes through its slot, not its ring) before the next's."""
    for _ in range(3):
        stream = Stream(server)
        n = grpcclient.InferInput("N", [1], "INT32")
        n.set_data_from_numpy(np.array([0], np.int32))
        try:
            for i in range(6):
                stream.send("burst", [n], request_id=f"r{i}", parameters={"count": 5},
                            enable_empty_final_response=empty_final)
            came = stream.take(36 if empty_final else 30)
        finally:
            stream.close()
        got = [(r.get_response().id, None if r.as_numpy("T") is None else int(r.as_numpy("T")[0]))
               for _, r in came]
        want = [(f"r{i}", k) for i in range(6) for k in [*range(5), *([None] if empty_final else [])]]
        assert got == want, [(k, g, w) for k, (g, w) in enumerate(zip(got, want)) if g != w][:8]


def test_many_more_requests_than_run_at_once_are_all_answered(server):
    count = 3 * MAX_RUNNING
    answers = _pipelined(server, count)
    assert sorted(int(r.get_response().id) for _, r in answers) == list(range(count))


def test_requests_past_the_frontends_room_wait_for_the_streams_own(server_factory):
    """20 requests of 4 MiB pipelined on one stream through a 16 MiB frontend arena, each running
    20 ms: those that find no room wait for the stream's own requests to end, and every one is
    answered, as when a stream ran one request at a time (and as in Triton)."""
    s = server_factory.start([BATCHING], ["--frontend-arena-mb", "16"]).wait_grpc_ready()
    stream = Stream(s)
    count = 20
    try:
        for i in range(count):
            x = grpcclient.InferInput("INPUT0", [1024, 1024], "FP32")
            x.set_data_from_numpy(np.full((1024, 1024), i, np.float32))
            stream.send("probe_unbatched", [x], request_id=str(i), parameters={"sleep_s": 0.02})
        answers = stream.take(count)
    finally:
        stream.close()
    errors = [r for _, r in answers if isinstance(r, Exception)]
    assert not errors, errors[:3]
    assert sorted(int(r.get_response().id) for _, r in answers) == list(range(count))


def test_sequences_waiting_past_the_streams_running_requests_do_not_hold_the_step_that_frees_them(server):
    """One slot, held by sequence 600; more one-step sequences than a stream runs at once
    (MAX_RUNNING) wait in the backlog, then 600's END comes on the same stream. Triton reads it
    and answers everything at once (checked with reference-triton 2.51: 140 sequences within a
    second). The stream's reading stopped once MAX_RUNNING of them waited, so the END was read
    only once the holder's idle time (seq_one_slot: 60 s) lost it its slot, and then refused
    for want of START."""
    def step(value: int) -> list:
        x = grpcclient.InferInput("VALUE", [1, 1], "INT32")
        x.set_data_from_numpy(np.array([[value]], np.int32))
        return [x]

    count = MAX_RUNNING + 12
    stream = Stream(server)
    try:
        stream.send("seq_one_slot", step(1), request_id="start", sequence_id=600, sequence_start=True)
        assert int(stream.take(1)[0][1].as_numpy("SUM")[0, 0]) == 1
        for i in range(count):
            stream.send("seq_one_slot", step(i), request_id=str(i), sequence_id=601 + i,
                        sequence_start=True, sequence_end=True)
        stream.send("seq_one_slot", step(2), request_id="end", sequence_id=600, sequence_end=True)
        answers = stream.take(count + 1, timeout=30)
    finally:
        stream.close()
    errors = [r for _, r in answers if isinstance(r, Exception)]
    assert not errors, errors[:3]
    sums = {r.get_response().id: int(r.as_numpy("SUM")[0, 0]) for _, r in answers}
    assert sums == {"end": 3, **{str(i): i for i in range(count)}}


def test_requests_naming_a_sequence_of_a_model_without_one_count_among_those_run_at_once(server, tmp_path):
    """Only a request of a sequence (an id, to a sequence-batched model) counts apart from the
    MAX_RUNNING a stream runs at once: any request carrying a sequence_id was let through, so a
    client could have a stream read without bound (each read request a task and a slot of the
    frontend, shared with every other client). Past MAX_RUNNING the stream is not read, and
    every request is answered once they end."""
    from conftest import pending_requests

    gate = Gate(tmp_path / "gate")
    x = grpcclient.InferInput("X", [1], "INT32")
    x.set_data_from_numpy(np.array([1], np.int32))
    count = MAX_RUNNING + 20
    stream = Stream(server)
    try:
        for i in range(count):
            stream.send("held", [x], request_id=str(i), sequence_id=7, parameters={"gate": gate.param})
        wait_until(lambda: pending_requests(server, "held") >= MAX_RUNNING, "the first requests submitted")
        time.sleep(0.5)  # (were more read, they would be submitted by now)
        assert pending_requests(server, "held") == MAX_RUNNING
        gate.open()
        answers = stream.take(count)
    finally:
        gate.open()
        stream.close()
    errors = [r for _, r in answers if isinstance(r, Exception)]
    assert not errors, errors[:3]
    assert sorted(int(r.get_response().id) for _, r in answers) == list(range(count))
