"""Ensembles with a decoupled step, against a real server: each response of the decoupled step
goes on through the later steps and reaches the client as a response of its own (gRPC
ModelStreamInfer, HTTP generate_stream, the local client's stream), the final flag after the last
(zero responses too), an error ends the stream, streams do not mix, a single-answer request is
refused in Triton's words, and ``max_inflight_requests`` bounds a step's calls in flight."""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import queue
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from shmserve.shm.client import Client, InferenceServerError

MODELS = Path(__file__).parent / "models" / "decens"
LOADED = ["repeat_pipe", "repeat_limited", "repeat_outer", "plain_pipe"]


@pytest.fixture(scope="module")
def server(module_factory):
    args = ["--model-control-mode", "explicit"]
    for name in LOADED:
        args += ["--load-model", name]
    return module_factory.start([MODELS], args)


def n_input(n: int, module=grpcclient) -> list:
    t = module.InferInput("N", [1], "INT32")
    t.set_data_from_numpy(np.array([n], np.int32))
    return [t]


def grpc_stream(server, model: str, n: int, parameters: dict | None = None) -> list:
    """What one request on a gRPC stream gets, in order: each response's W, an error, and
    "final" once the final flag came (on the last response, or alone: the empty final response,
    asked for so that the end is seen either way)."""
    got: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        try:
            client.async_stream_infer(model, n_input(n), parameters=parameters, enable_empty_final_response=True)
            out: list = []
            while True:
                result, error = got.get(timeout=120)
                if error is not None:
                    out.append(error)
                    return out
                response = result.get_response()
                if response.outputs:
                    out.append(int(result.as_numpy("W")[0]))
                if response.parameters["triton_final_response"].bool_param:
                    out.append("final")
                    return out
        finally:
            client.stop_stream()


def overlap(log: Path) -> int:
    """The most executions the log's (start, end) lines show running at once."""
    events = []
    for line in log.read_text().splitlines():
        start, end, _ = line.split()
        events += [(float(start), 1), (float(end), -1)]
    most = now = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):
        now += step
        most = max(most, now)
    return most


def test_config_says_decoupled_as_triton_fills_it_in(server):
    client = server.client()
    try:
        assert client.get_model_config("repeat_pipe")["model_transaction_policy"] == {"decoupled": True}
        assert client.get_model_config("repeat_outer")["model_transaction_policy"] == {"decoupled": True}
        # No decoupled step: not decoupled, whatever its own config said.
        assert client.get_model_config("plain_pipe")["model_transaction_policy"] == {"decoupled": False}
    finally:
        client.close()


def test_each_response_flows_through_the_later_steps_on_a_grpc_stream(server):
    got = grpc_stream(server, "repeat_pipe", 5)
    assert got[-1] == "final"
    assert sorted(got[:-1]) == [2 * (500 + i) for i in range(5)]


def stream_messages(server, model: str, n: int, empty_final: bool, parameters: dict | None = None) -> list:
    """Every message one request on a gRPC stream gets, as (W or None, final flag), read until
    the final flag (or for 5 s more once none came for 5 s: a stream that never ends)."""
    got: queue.Queue = queue.Queue()
    out: list = []
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        try:
            client.async_stream_infer(model, n_input(n), parameters=parameters,
                                      enable_empty_final_response=empty_final)
            while True:
                try:
                    result, error = got.get(timeout=5)
                except queue.Empty:
                    return out
                assert error is None, error
                response = result.get_response()
                final = response.parameters["triton_final_response"].bool_param
                out.append((int(result.as_numpy("W")[0]) if response.outputs else None, final))
                if final:
                    try:  # nothing follows the final flag
                        result, error = got.get(timeout=0.5)
                        out.append(("after final", result, error))
                    except queue.Empty:
                        pass
                    return out
        finally:
            client.stop_stream()


@pytest.mark.parametrize("empty_final", [False, True])
def test_the_last_response_carries_the_final_flag_as_in_triton(server, empty_final):
    """Triton's ensemble marks a response final when no step is left to run: here the decoupled
    step's final flag comes while its last response is still in the slow later step, so that
    response carries it, and no empty final response follows (whatever the request asked). A
    client that reads until the final flag ends with the data, as with a decoupled model."""
    got = stream_messages(server, "repeat_pipe", 3, empty_final, parameters={"sleep_ms": 200})
    assert sorted(w for w, _ in got) == [600, 602, 604]  # (the later step's instances may answer in any order)
    assert [final for _, final in got] == [False, False, True]


def test_zero_responses_send_only_the_final_flag(server):
    assert grpc_stream(server, "repeat_pipe", 0) == ["final"]


def test_a_nested_decoupled_ensemble_streams_through_the_outer_one(server):
    got = grpc_stream(server, "repeat_outer", 3)
    assert got[-1] == "final"
    assert sorted(got[:-1]) == [4 * (300 + i) for i in range(3)]


def test_an_error_mid_stream_ends_it_with_the_error(server):
    got = grpc_stream(server, "repeat_pipe", -2)
    error = got[-1]
    assert isinstance(error, InferenceServerException)
    assert error.message() == "in ensemble 'repeat_pipe', repeat broke"
    # Responses whose later step had not answered when the error came are not sent (as in Triton).
    assert set(got[:-1]) <= {400, 402}


def test_concurrent_streams_do_not_mix(server):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        runs = {n: pool.submit(grpc_stream, server, "repeat_pipe", n) for n in (3, 4, 6, 7)}
        for n, run in runs.items():
            got = run.result()
            assert got[-1] == "final"
            assert sorted(got[:-1]) == [2 * (100 * n + i) for i in range(n)]


def test_a_single_answer_request_is_refused_as_triton_refuses_it(server):
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        with pytest.raises(InferenceServerException) as e:
            client.infer("repeat_pipe", n_input(2))
        assert e.value.status() == "StatusCode.UNIMPLEMENTED"
        assert e.value.message() == "ModelInfer RPC doesn't support models with decoupled transaction policy"
    client = server.client()
    try:
        with pytest.raises(InferenceServerException) as e:
            client.infer("repeat_pipe", n_input(2, httpclient))
        assert e.value.message() == "HTTP end point doesn't support models with decoupled transaction policy"
        with pytest.raises(InferenceServerException) as plain:  # the same as for the decoupled model itself
            client.infer("repeat", n_input(2, httpclient))
        assert (e.value.status(), e.value.message()) == (plain.value.status(), plain.value.message())
        # A single-answer ensemble still answers once.
        v = httpclient.InferInput("V", [1], "INT32")
        v.set_data_from_numpy(np.array([21], np.int32))
        assert client.infer("plain_pipe", [v]).as_numpy("W").tolist() == [42]
    finally:
        client.close()


def post(server, path: str, body: dict) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def test_http_generate_stream_sends_each_response_as_an_event(server):
    status, text = post(server, "/v2/models/repeat_pipe/generate_stream", {"N": 3})
    assert status == 200
    events = [json.loads(chunk[len("data: "):]) for chunk in text.split("\n\n") if chunk.startswith("data: ")]
    assert sorted(e["W"] for e in events) == [600, 602, 604]
    assert all(e["model_name"] == "repeat_pipe" for e in events)
    status, text = post(server, "/v2/models/repeat_pipe/generate_stream", {"N": -1})
    events = [json.loads(chunk[len("data: "):]) for chunk in text.split("\n\n") if chunk.startswith("data: ")]
    assert events[-1] == {"error": "in ensemble 'repeat_pipe', repeat broke"}
    # generate takes a decoupled ensemble's one response, and refuses more in Triton's words.
    status, text = post(server, "/v2/models/repeat_pipe/generate", {"N": 1})
    assert status == 200 and json.loads(text)["W"] == 200
    status, text = post(server, "/v2/models/repeat_pipe/generate", {"N": 2})
    assert status == 400 and json.loads(text)["error"].startswith("generate expects model to produce exactly 1 response")


def test_the_local_client_streams_a_decoupled_ensemble(server):
    with Client(server.id) as client:
        got = [int(r["W"][0]) for r in client.stream("repeat_pipe", {"N": np.array([4], np.int32)})]
        assert sorted(got) == [2 * (400 + i) for i in range(4)]
        assert list(client.stream("repeat_pipe", {"N": np.array([0], np.int32)})) == []
        seen = []
        with pytest.raises(InferenceServerError) as e:
            for r in client.stream("repeat_pipe", {"N": np.array([-1], np.int32)}):
                seen.append(int(r["W"][0]))
        assert "in ensemble 'repeat_pipe', repeat broke" in str(e.value)
        assert set(seen) <= {200}


def test_max_inflight_requests_bounds_the_consumer_of_a_fast_producer(server, tmp_path):
    # The producer sends its 6 responses at once; the consumer has 3 instances and takes 150 ms.
    # Unbounded, its calls run side by side; with max_inflight_requests 1 one at a time, across
    # both concurrent requests, and every response still arrives.
    unbounded, bounded = tmp_path / "unbounded.log", tmp_path / "bounded.log"
    got = grpc_stream(server, "repeat_pipe", 6, {"sleep_ms": 150, "log": str(unbounded)})
    assert sorted(got[:-1]) == [2 * (600 + i) for i in range(6)]
    assert overlap(unbounded) >= 2
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(grpc_stream, server, "repeat_limited", n, {"sleep_ms": 150, "log": str(bounded)})
                for n in (5, 6)]
        results = [r.result() for r in runs]
    for n, got in zip((5, 6), results):
        assert got[-1] == "final"
        assert sorted(got[:-1]) == [2 * (100 * n + i) for i in range(n)]
    assert len(bounded.read_text().splitlines()) == 11
    assert overlap(bounded) == 1


def test_steps_fed_by_different_decoupled_models_are_refused_at_load(server):
    client = server.client()
    try:
        with pytest.raises(InferenceServerException) as e:
            client.load_model("mixed_origins")
        assert ("in ensemble mixed_origins, step of model 'mixed_origins' receives inputs originated from "
                "different decoupled models") in e.value.message()
    finally:
        client.close()


def broker_pid(server) -> int:
    return next(pid for pid, title in server.titles().items() if "shmserve broker" in title)


def test_a_stream_given_up_early_cancels_the_run_and_frees_it(server):
    broker = broker_pid(server)
    with Client(server.id) as client:
        for _ in range(3):
            stream = client.stream("repeat_pipe", {"N": np.array([40], np.int32)}, parameters={"sleep_ms": 20})
            first = next(stream)
            assert int(first["W"][0]) in {2 * (4000 + i) for i in range(40)}
            stream.cancel()
        got = [int(r["W"][0]) for r in client.stream("repeat_pipe", {"N": np.array([2], np.int32)})]
        assert sorted(got) == [400, 402]
    assert broker_pid(server) == broker  # no restart: the broker kept serving
    stats = server.client().get_inference_statistics("repeat_pipe")["model_stats"][0]["inference_stats"]
    assert stats["fail"]["count"] >= 3  # the cancelled runs, counted as failed requests


def test_a_single_answer_ensemble_on_a_stream_answers_once_as_final(server):
    got: queue.Queue = queue.Queue()
    v = grpcclient.InferInput("V", [1], "INT32")
    v.set_data_from_numpy(np.array([5], np.int32))
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        try:
            client.async_stream_infer("plain_pipe", [v], enable_empty_final_response=True)
            result, error = got.get(timeout=60)
        finally:
            client.stop_stream()
    assert error is None and result.as_numpy("W").tolist() == [10]
    assert result.get_response().parameters["triton_final_response"].bool_param
    assert got.empty()


def test_a_bounded_consumer_holds_back_the_producer_s_sends(server, tmp_path):
    # 100 responses, far more than a response ring holds (64): with one consumer call at a time,
    # the producer's sends wait for the consumer (its last returns only once most of the
    # consumer's calls have ended), and every response still arrives, none lost.
    n, log = 100, tmp_path / "consumer.log"
    got = grpc_stream(server, "repeat_limited", n, {"sleep_ms": 5, "log": str(log)})
    assert got[-1] == "final"
    assert sorted(got[:-1]) == [2 * (100 * n + i) for i in range(n)]
    ended_when_sent = int(Path(f"{log}.sent").read_text())
    assert ended_when_sent >= n - 64 - 2  # the ring's 64, the call in flight, the one taken
    assert overlap(log) == 1
    # Unbounded, the producer is never held back: it sends all before the consumer is done.
    free_log = tmp_path / "free.log"
    got = grpc_stream(server, "repeat_pipe", n, {"sleep_ms": 5, "log": str(free_log)})
    assert sorted(got[:-1]) == [2 * (100 * n + i) for i in range(n)]
    assert int(Path(f"{free_log}.sent").read_text()) < n - 64 - 2


def test_a_bounded_run_that_fails_or_is_given_up_lets_go_of_its_bound(server):
    # Calls waiting for the bound are dropped with their run, and the bound's count comes back:
    # later requests run (the bound is shared, so a leaked count would stall them for good).
    got = grpc_stream(server, "repeat_limited", -5, {"sleep_ms": 30})
    assert isinstance(got[-1], InferenceServerException)
    assert got[-1].message() == "in ensemble 'repeat_limited', repeat broke"
    with Client(server.id) as client:
        for _ in range(2):
            stream = client.stream("repeat_limited", {"N": np.array([30], np.int32)}, parameters={"sleep_ms": 30})
            next(stream)
            stream.cancel()
    got = grpc_stream(server, "repeat_limited", 3)
    assert got[-1] == "final" and sorted(got[:-1]) == [600, 602, 604]


def test_a_producer_that_dies_mid_stream_ends_the_stream_with_an_error(server):
    # The worker of the decoupled step is killed between its responses, sent from a thread after
    # execute returned (its batch is done): the stream ends with the death, and the step serves
    # again once restarted.
    import os
    import re
    import signal
    import time

    with Client(server.id) as client:
        stream = client.stream("repeat_pipe", {"N": np.array([20], np.int32)}, parameters={"pause_ms": 300, "later": True}, wait_s=60)
        assert int(next(stream)["W"][0]) in {2 * (2000 + i) for i in range(20)}
        worker = next(pid for pid, title in server.titles().items() if "shmserve worker repeat v1" in title)
        os.kill(worker, signal.SIGKILL)
        with pytest.raises(InferenceServerError) as e:
            for _ in stream:
                pass
        # the supervisor's words for its instance, or the broker's for the step whose instance is gone
        assert re.match(r"in ensemble 'repeat_pipe', (model 'repeat' version 1 instance 'repeat_0' was killed|"
                        r"step 'repeat' failed: the instance that ran this step is gone)", str(e.value))
        deadline = time.monotonic() + 120
        while True:
            try:
                got = [int(r["W"][0]) for r in client.stream("repeat_pipe", {"N": np.array([2], np.int32)})]
                break
            except InferenceServerError:
                assert time.monotonic() < deadline
                time.sleep(0.5)
        assert sorted(got) == [400, 402]


CLIENT = """
import json, sys
import numpy as np
from shmserve.shm.client import Client
with Client(sys.argv[1]) as client:
    got = []
    for r in client.stream("repeat_pipe", {"N": np.array([int(sys.argv[2])], np.int32)}, wait_s=120):
        got.append(int(r["W"][0]))
        if len(got) == 1:
            print("first", flush=True)
    print(json.dumps(got), flush=True)
"""


def test_a_client_that_stops_reading_for_a_while_loses_nothing(server):
    # The client is stopped after its first response: the ensemble's responses wait for room on
    # its ring (64), then the producer's on its own ring, then its sends; all arrive once it reads.
    import os
    import signal
    import subprocess
    import sys
    import time

    n = 200
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, server.id, str(n)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "first"
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(2.5)
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
    assert sorted(json.loads(out)) == [2 * (100 * n + i) for i in range(n)]
