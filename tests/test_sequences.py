"""The sequence batcher against a real server: interleaved sequences keep their state apart under
both strategies, control inputs carry what Triton's do, idle sequences expire, and a request for
a sequence that never started is refused."""
from __future__ import annotations

import concurrent.futures as cf
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import pending_requests, wait_pending, wait_until
from gates import Gate

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(module_factory):
    return module_factory.start([Path(__file__).parent / "models" / "sequences", ROOT / "model_repository"])


def send(url: str, model: str, seq, value, start: bool = False, end: bool = False, dtype: str = "INT32",
         gate: Gate | None = None, timeout_us: int | None = None):
    np_type = {"INT32": np.int32, "INT64": np.int64, "FP32": np.float32}[dtype]
    client = httpclient.InferenceServerClient(url)
    try:
        x = httpclient.InferInput("VALUE", [1, 1], dtype)
        x.set_data_from_numpy(np.array([[value]], dtype=np_type))
        return client.infer(model, [x], sequence_id=seq, sequence_start=start, sequence_end=end, timeout=timeout_us,
                            parameters={"gate": gate.param} if gate is not None else None)
    finally:
        client.close()


def info(result) -> dict:
    return json.loads(result.as_numpy("INFO").reshape(-1)[0])


def run_sequence(url: str, model: str, seq, values: list[int], dtype: str = "INT32", out: str = "SUM") -> list:
    totals = []
    for i, v in enumerate(values):
        r = send(url, model, seq, v, start=i == 0, end=i == len(values) - 1, dtype=dtype)
        totals.append(int(r.as_numpy(out).reshape(-1)[0]))
        time.sleep(0.005)
    return totals


@pytest.mark.parametrize("model,dtype,out", [("seq_direct", "INT32", "SUM"), ("seq_oldest", "INT64", "TOTAL")])
def test_interleaved_sequences_keep_their_state_apart(server, model, dtype, out):
    plans = {seq: [seq * 10 + i for i in range(6)] for seq in range(1, 9)}
    with cf.ThreadPoolExecutor(8) as pool:
        futures = {seq: pool.submit(run_sequence, server.url, model, seq, vals, dtype, out)
                   for seq, vals in plans.items()}
        for seq, fut in futures.items():
            assert fut.result() == list(np.cumsum(plans[seq])), f"sequence {seq}"


def test_string_correlation_ids(server):
    assert run_sequence(server.url, "seq_oldest", "alpha", [1, 2, 3], "INT64", "TOTAL") == [1, 3, 6]
    assert run_sequence(server.url, "seq_oldest", "beta", [5, 5], "INT64", "TOTAL") == [5, 10]


def test_a_string_id_for_an_integer_correlation_control_is_refused_in_words(server):
    """Triton would pass a string id's bytes read as a UINT64; here it is a 400 naming the
    control, and so is an id past the control's type. The sequence's instance keeps serving."""
    with pytest.raises(InferenceServerException) as e:
        send(server.url, "seq_direct", "abc", 1, start=True, end=True)
    assert (e.value.status(), e.value.message()) == (
        "400", "sequence id 'abc' is a string, but the model takes its correlation id in control input 'CORRID' "
               "as TYPE_UINT64: send an integer sequence id")
    r = send(server.url, "seq_direct", 77, 5, start=True, end=True)
    assert int(r.as_numpy("SUM").reshape(-1)[0]) == 5


def test_config_shows_what_tritons_normalization_fills(server):
    """An Oldest sequence batcher with no preferred size shows max_batch_size, as Triton's config
    endpoint does; an ensemble shows no max_inflight_requests (a field 2.51 does not have)."""
    c = httpclient.InferenceServerClient(server.url)
    try:
        oldest = c.get_model_config("seq_oldest")["sequence_batching"]["oldest"]
        assert oldest["preferred_batch_size"] == [c.get_model_config("seq_oldest")["max_batch_size"]]
        assert "max_inflight_requests" not in c.get_model_config("digits_pipeline")["ensemble_scheduling"]
    finally:
        c.close()


def test_control_inputs_carry_start_end_ready_and_corrid(server):
    infos = []
    for i, (start, end) in enumerate([(True, False), (False, False), (False, True)]):
        r = send(server.url, "seq_direct", 4242, i + 1, start=start, end=end)
        infos.append(json.loads(r.as_numpy("INFO").reshape(-1)[0]))
    assert [(i["start"], i["end"], i["ready"], i["corr"]) for i in infos] == [
        (1, 0, 1, 4242), (0, 0, 1, 4242), (0, 1, 1, 4242)]


def test_concurrent_sequences_share_batches(server, tmp_path):
    """Steps of different sequences on one instance, sent while it runs another step, wait
    together and then run in one execute()."""
    seqs = range(100, 108)
    pid_of = {seq: info(send(server.url, "seq_direct", seq, 1, start=True))["pid"] for seq in seqs}
    mine = [seq for seq in seqs if pid_of[seq] == pid_of[seqs[0]]]  # the sequences on one instance
    assert len(mine) >= 3, pid_of
    gate = Gate(tmp_path / "gate")
    with cf.ThreadPoolExecutor(len(mine)) as pool:
        try:
            busy = pool.submit(send, server.url, "seq_direct", mine[0], 1, gate=gate)
            gate.wait_started(1)
            queued = [pool.submit(send, server.url, "seq_direct", seq, 1) for seq in mine[1:]]
            wait_pending(server, "seq_direct", len(mine))
        finally:
            gate.open()
        assert info(busy.result())["batch"] == 1
        ran = [info(f.result()) for f in queued]
    assert len({i["execution"] for i in ran}) == 1  # requests of different sequences ran in one execute()
    # (with a null request in each slot below the highest that sent nothing: the busy one's)
    assert all(i["batch"] >= len(mine) for i in ran), ran
    for seq in seqs:
        assert int(send(server.url, "seq_direct", seq, 1, end=True).as_numpy("SUM")[0, 0]) == (3 if seq in mine else 2)


def test_request_without_start_is_refused(server):
    with pytest.raises(InferenceServerException) as e:
        send(server.url, "seq_direct", 987654, 1)
    assert e.value.status() == "400"
    assert "must specify the START flag" in e.value.message()


def test_missing_correlation_id_is_refused(server):
    client = httpclient.InferenceServerClient(server.url)
    x = httpclient.InferInput("VALUE", [1, 1], "INT32")
    x.set_data_from_numpy(np.array([[1]], np.int32))
    with pytest.raises(InferenceServerException) as e:
        client.infer("seq_direct", [x])
    assert "correlation ID" in e.value.message()


@pytest.mark.parametrize("seq", [None, 31337], ids=["no-sequence-id", "with-sequence-id"])
def test_a_batch_of_several_is_refused(server, seq):
    """One request is one step of one sequence: Triton refuses a batch of more (before it looks at
    the correlation ID), with this text."""
    client = httpclient.InferenceServerClient(server.url)
    x = httpclient.InferInput("VALUE", [2, 1], "INT32")
    x.set_data_from_numpy(np.array([[1], [2]], np.int32))
    kwargs = {"sequence_id": seq, "sequence_start": True} if seq else {}
    with pytest.raises(InferenceServerException) as e:
        client.infer("seq_direct", [x], **kwargs)
    client.close()
    assert e.value.status() == "400"
    assert e.value.message() == ("inference request to model 'seq_direct' must specify batch-size 1 due to "
                                 "requirements of sequence batcher")
    assert run_sequence(server.url, "seq_direct", 31337, [4, 5]) == [4, 9]  # the id was never started


def test_idle_sequence_expires(server):
    # (seq_idle is seq_direct with a 400 ms idle time; a pause of the host between two steps may
    # be that long, so no step here depends on the sequence still being alive.)
    assert int(send(server.url, "seq_idle", 555, 1, start=True).as_numpy("SUM")[0, 0]) == 1
    time.sleep(1.5)  # at least the idle time, and the broker's timer to notice
    with pytest.raises(InferenceServerException) as e:
        send(server.url, "seq_idle", 555, 1)
    assert "must specify the START flag" in e.value.message()
    assert run_sequence(server.url, "seq_idle", 555, [7]) == [7]  # a new START works


def test_bundled_running_sum_example(server):
    totals = []
    for i, v in enumerate([1.5, 2.0, 0.5]):
        r = send(server.url, "running_sum", 31, v, start=i == 0, end=i == 2, dtype="FP32")
        totals.append(float(r.as_numpy("SUM").reshape(-1)[0]))
        # The state tensor is the server's business, not the client's.
        assert [o["name"] for o in r.get_response()["outputs"]] == ["SUM"]
    assert totals == [1.5, 3.5, 4.0]


def test_an_id_past_an_int32_correlation_control_is_refused():
    """An INT32 CORRID takes ids that fit it; numpy's OverflowError never escapes the worker."""
    from shmserve.workers.requests import RequestError
    from shmserve.workers.sequence import SequenceSupport

    config = {"sequence_batching": {"control_input": [
        {"name": "CORRID", "control": [{"kind": "CONTROL_SEQUENCE_CORRID", "data_type": "TYPE_INT32"}]}]}}
    support = SequenceSupport(config, Path("."))
    inputs: dict = {}
    support.augment(inputs, 2**31 - 1, 0)
    assert inputs["CORRID"].tolist() == [2**31 - 1]
    with pytest.raises(RequestError, match=r"sequence id 2147483648 does not fit the model's correlation id "
                                           r"control input 'CORRID' \(TYPE_INT32\)"):
        support.augment(inputs, 2**31, 0)


def test_a_cancelled_queued_request_ends_its_sequence_as_in_triton(server, tmp_path):
    """A step cancelled while it waits behind its sequence's running step never runs, and ends
    the sequence: the next step needs START, as Triton's sequence batcher answers."""
    from shmserve import Client

    seq, gate = 4242, Gate(tmp_path / "gate")
    send(server.url, "seq_direct", seq, 1, start=True)
    with Client(server.id) as client, cf.ThreadPoolExecutor(1) as pool:
        try:
            busy = pool.submit(send, server.url, "seq_direct", seq, 2, gate=gate)
            gate.wait_started(1)
            queued = client.infer_async("seq_direct", {"VALUE": np.array([[4]], np.int32)}, sequence_id=seq)
            wait_pending(server, "seq_direct", 2)
            assert queued.cancel()
            wait_until(lambda: pending_requests(server, "seq_direct") == 1, "the broker dropped the cancelled step")
        finally:
            gate.open()
        assert int(busy.result().as_numpy("SUM")[0, 0]) == 3
    with pytest.raises(InferenceServerException) as e:
        send(server.url, "seq_direct", seq, 8, end=True)
    assert e.value.status() == "400" and "must specify the START flag" in e.value.message()
    assert int(send(server.url, "seq_direct", seq, 5, start=True, end=True).as_numpy("SUM")[0, 0]) == 5


def rows_of(result) -> dict:
    return json.loads(result.as_numpy("ROWS").reshape(-1)[0])


def test_direct_batch_rows_are_slots_with_null_requests(server):
    """Triton's direct strategy: a sequence's batch slot is its row of every execution, and each
    slot below the highest that sent nothing holds a null request (READY, START and END off,
    CORRID 0, zero data), whose answer is dropped. The null rows count in the execution's batch
    size, not in the inference count (as Triton 2.51 counts them)."""
    model = "seq_direct_rows"
    before = httpclient.InferenceServerClient(server.url).get_inference_statistics(model)["model_stats"][0]
    null = {"ready": 0, "start": 0, "end": 0, "corr": 0, "value": 0}
    a = rows_of(send(server.url, model, 11, 1, start=True))
    b = rows_of(send(server.url, model, 22, 2, start=True))
    c = rows_of(send(server.url, model, 33, 3, start=True))
    assert (a["row"], b["row"], c["row"]) == (0, 1, 2)
    assert c["rows"] == [null, null, {"ready": 1, "start": 1, "end": 0, "corr": 33, "value": 3}]
    alone = rows_of(send(server.url, model, 33, 4))
    assert alone == {"row": 2, "rows": [null, null, {"ready": 1, "start": 0, "end": 0, "corr": 33, "value": 4}]}
    b_end = rows_of(send(server.url, model, 22, 5, end=True))
    assert b_end["rows"] == [null, {"ready": 1, "start": 0, "end": 1, "corr": 22, "value": 5}]
    d = rows_of(send(server.url, model, 44, 7, start=True))  # takes the slot B's end freed
    assert d["row"] == 1 and d["rows"][0] == null
    for seq, value in ((11, 1), (33, 1), (44, 1)):
        send(server.url, model, seq, value, end=True)
    after = httpclient.InferenceServerClient(server.url).get_inference_statistics(model)["model_stats"][0]

    def sizes(stats: dict) -> dict:
        return {b["batch_size"]: int(b["compute_infer"]["count"]) for b in stats["batch_stats"]}
    assert int(after["inference_count"]) - int(before["inference_count"]) == 9
    assert int(after["execution_count"]) - int(before["execution_count"]) == 9
    grown = {size: n - sizes(before).get(size, 0) for size, n in sizes(after).items()}
    # rows: 1, 2, 3, 3, 2, 2 (D at slot 1), then the ends: A alone (1), C (3: rows 0 and 1 are
    # A's freed slot, now empty, and D's), D (2)
    assert {size: n for size, n in grown.items() if n} == {1: 2, 2: 4, 3: 3}, grown


def test_direct_batch_waits_for_its_slot_utilization(server):
    """``direct { max_queue_delay_microseconds minimum_slot_utilization }``, by Triton's rule: a
    batch goes once that share of the instance's slots (2 of 4 here) has a request, and a lone
    request only after the delay (1.5 s)."""
    model = "seq_direct_delay"

    def timed(seq, value, start=False, end=False):
        began = time.monotonic()
        result = rows_of(send(server.url, model, seq, value, start=start, end=end))
        return result, time.monotonic() - began

    with cf.ThreadPoolExecutor(2) as pool:
        pair = [pool.submit(timed, seq, 1, True) for seq in (51, 52)]
        (a, _), (b, _) = (f.result() for f in pair)
    assert len(a["rows"]) == len(b["rows"]) == 2 and {a["row"], b["row"]} == {0, 1}, (a, b)
    alone, alone_s = timed(51, 2)
    assert alone_s >= 1.2, alone_s  # one slot of four has a request: it waited for the delay
    assert alone["rows"][alone["row"]]["corr"] == 51
    with cf.ThreadPoolExecutor(2) as pool:
        ends = [pool.submit(timed, seq, 3, False, True) for seq in (51, 52)]
        results = [f.result() for f in ends]
    for r, _ in results:  # together, in one execution
        assert sorted(row["corr"] for row in r["rows"]) == [51, 52], results


def test_a_decoupled_direct_batch_whose_execute_raises_fails_every_real_stream(server):
    """A decoupled model's ``async def execute`` that raises, in a direct batch with a null row
    before the real one: the real request's stream ends with the error (a null row's stream is
    nobody's and takes the failure quietly), and the server serves on."""
    import queue

    import tritonclient.grpc as grpcclient

    model = "seq_direct_async"
    got: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        c.start_stream(callback=lambda result, error: got.put(error if error is not None else result))

        def step(seq: int, value: int, start: bool = False, end: bool = False):
            x = grpcclient.InferInput("VALUE", [1, 1], "INT32")
            x.set_data_from_numpy(np.array([[value]], np.int32))
            c.async_stream_infer(model, [x], sequence_id=seq, sequence_start=start, sequence_end=end)
            return got.get(timeout=30)

        first = step(61, 1, start=True)
        assert rows_of(first) == {"row": 0, "values": [1]}
        failed = step(62, -1, start=True)  # slot 1, behind slot 0's null row
        assert isinstance(failed, InferenceServerException) and "told to raise" in failed.message(), failed
        again = step(61, 5, end=True)
        assert rows_of(again) == {"row": 0, "values": [5]}
        c.stop_stream()


def test_an_unset_idle_time_shows_as_tritons_default(server):
    """A sequence batcher without max_sequence_idle_microseconds: the config endpoints show the
    1 s Triton fills in (and applies), not 0."""
    config = httpclient.InferenceServerClient(server.url).get_model_config("seq_default_idle")
    assert int(config["sequence_batching"]["max_sequence_idle_microseconds"]) == 1_000_000


EXPIRED = "timeout of the corresponding sequence has been expired"


def rejected(server, model: str) -> tuple[int, float]:
    """The version's failure count in its statistics, and its REJECTED failures in the metrics."""
    stats = httpclient.InferenceServerClient(server.url).get_inference_statistics(model)["model_stats"][0]
    head = f'nv_inference_request_failure{{model="{model}",reason="REJECTED",'
    metric = [float(line.rsplit(" ", 1)[1]) for line in server.metrics_text().splitlines() if line.startswith(head)]
    return int(stats["inference_stats"]["fail"]["count"]), sum(metric)


def grpc_send(url: str, model: str, seq, value, start: bool = False, end: bool = False,
              timeout_us: int | None = None):
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(url) as c:
        x = grpcclient.InferInput("VALUE", [1, 1], "INT32")
        x.set_data_from_numpy(np.array([[value]], np.int32))
        return c.infer(model, [x], sequence_id=seq, sequence_start=start, sequence_end=end, timeout=timeout_us)


def test_a_backlogged_sequence_whose_timeout_expires_is_refused_as_in_triton(server):
    """One slot, held by sequence 71: sequence 72 waits in the backlog. A request ``timeout`` on
    any of 72's queued requests (here its second) ends the wait of them all when it expires, as
    in Triton 2.51 (its reaper's backlog expiry): each is refused with 503 / UNAVAILABLE and counted
    as a REJECTED failure, 72 is forgotten (its next step needs START), and 71 keeps its slot."""
    model = "seq_one_slot"
    fails_before, metric_before = rejected(server, model)
    send(server.url, model, 71, 1, start=True)
    with cf.ThreadPoolExecutor(2) as pool:
        first = pool.submit(send, server.url, model, 72, 1, start=True)  # no timeout of its own
        wait_pending(server, model, 1)
        began = time.monotonic()
        second = pool.submit(grpc_send, server.grpc_url, model, 72, 2, timeout_us=300_000)
        with pytest.raises(InferenceServerException) as http_error:
            first.result()
        with pytest.raises(InferenceServerException) as grpc_error:
            second.result()
    assert time.monotonic() - began < 30  # (not the slot holder's 60 s idle time)
    assert (http_error.value.status(), http_error.value.message()) == ("503", EXPIRED)
    assert (grpc_error.value.status(), grpc_error.value.message()) == ("StatusCode.UNAVAILABLE", EXPIRED)
    fails, metric = rejected(server, model)
    assert (fails - fails_before, metric - metric_before) == (2, 2)
    with pytest.raises(InferenceServerException) as e:
        send(server.url, model, 72, 3)
    assert e.value.status() == "400" and "must specify the START flag" in e.value.message()
    assert int(send(server.url, model, 71, 2, end=True).as_numpy("SUM")[0, 0]) == 3  # 71 kept its slot


def test_a_backlogged_sequence_that_gets_a_slot_in_time_runs(server):
    """The timeout bounds only the wait in the backlog: 74's START, with a minute's timeout, runs
    once 73 ends. Behind 76's START+END in the backlog, 76's next START begins another wait, with
    no timeout of its own (Triton's separate backlog queue): the first expires, the second runs."""
    model = "seq_one_slot"
    send(server.url, model, 73, 1, start=True)
    with cf.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(send, server.url, model, 74, 5, start=True, timeout_us=60_000_000)
        wait_pending(server, model, 1)
        send(server.url, model, 73, 1, end=True)
        assert int(waiting.result().as_numpy("SUM")[0, 0]) == 5
    with cf.ThreadPoolExecutor(2) as pool:
        whole = pool.submit(send, server.url, model, 76, 1, start=True, end=True, timeout_us=2_000_000)
        wait_pending(server, model, 1)
        again = pool.submit(send, server.url, model, 76, 7, start=True)
        wait_pending(server, model, 2)  # (were this later than 2 s, the START would wait alone: the same end)
        with pytest.raises(InferenceServerException) as e:
            whole.result()
        assert (e.value.status(), e.value.message()) == ("503", EXPIRED)
        send(server.url, model, 74, 1, end=True)
        assert int(again.result().as_numpy("SUM")[0, 0]) == 7
    assert int(send(server.url, model, 76, 1, end=True).as_numpy("SUM")[0, 0]) == 8


def test_sequences_waiting_for_a_slot_on_a_stream_take_it_as_soon_as_it_frees(server):
    """One slot, held by sequence 90; ten one-step sequences sent on one gRPC stream wait in the
    backlog. Once 90's END is sent, each takes the slot as soon as the one before it ends: Triton
    2.51 (checked with reference-triton) answered all ten within 30 ms of the END. (They were let
    go one per second: sending a sequence's END freed its slot, and nothing woke the broker to
    give it to the next.)"""
    import queue

    import tritonclient.grpc as grpcclient

    model = "seq_one_slot"
    send(server.url, model, 90, 1, start=True)
    got: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        c.start_stream(callback=lambda result, error: got.put(error if error is not None else result))
        for seq in range(91, 101):
            x = grpcclient.InferInput("VALUE", [1, 1], "INT32")
            x.set_data_from_numpy(np.array([[seq]], np.int32))
            c.async_stream_infer(model, [x], request_id=str(seq), sequence_id=seq, sequence_start=True,
                                 sequence_end=True)
        wait_pending(server, model, 10)
        began = time.monotonic()
        assert int(send(server.url, model, 90, 1, end=True).as_numpy("SUM")[0, 0]) == 2
        answers = [got.get(timeout=60) for _ in range(10)]
        took = time.monotonic() - began
        c.stop_stream()
    assert not any(isinstance(a, Exception) for a in answers), answers
    assert [int(a.as_numpy("SUM")[0, 0]) for a in answers] == list(range(91, 101))
    assert took < 4, took  # (one a second: 9 s and more)


def test_a_sequence_whose_start_waited_in_the_backlog_past_the_idle_time_goes_on(server_factory, tmp_path):
    """A sequence's idle time counts from when its last request went to its instance (Triton's,
    from its arrival: a difference, compatibility.md). 82's START waits in the backlog behind 81
    longer than the idle limit (here 3 s; the same as a START that waits for its only instance to
    restart); before, it ran, and then was released as idle at once, so its next step, sent right
    after the answer, was refused for want of the START it had sent."""
    model = "seq_one_slot"
    folder = tmp_path / "repo" / model
    shutil.copytree(Path(__file__).parent / "models" / "sequences" / model, folder)
    config = folder / "config.pbtxt"
    config.write_text(config.read_text().replace("max_sequence_idle_microseconds: 60000000",
                                                 "max_sequence_idle_microseconds: 3000000"))
    server = server_factory.start([tmp_path / "repo"])
    send(server.url, model, 81, 1, start=True)
    with cf.ThreadPoolExecutor(1) as pool:
        began = time.monotonic()
        waiting = pool.submit(send, server.url, model, 82, 10, start=True)
        wait_pending(server, model, 1)
        time.sleep(1.5)
        send(server.url, model, 81, 2)  # 81 is not idle either
        time.sleep(max(0.0, began + 3.5 - time.monotonic()))
        assert not waiting.done()
        assert int(send(server.url, model, 81, 3, end=True).as_numpy("SUM")[0, 0]) == 6
        assert int(waiting.result().as_numpy("SUM")[0, 0]) == 10
    time.sleep(0.3)  # (a client's pause between steps, well within the idle limit)
    assert int(send(server.url, model, 82, 5).as_numpy("SUM")[0, 0]) == 15
    assert int(send(server.url, model, 82, 1, end=True).as_numpy("SUM")[0, 0]) == 16
