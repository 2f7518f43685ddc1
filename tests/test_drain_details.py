"""What the server says while it cannot serve, against a real server.

- During the drain after SIGTERM the OpenAI routes answer 503 with Retry-After in OpenAI's error
  form (a stream too: its status, not a 200 whose stream holds the error), and the ``openai``
  package waits what Retry-After says before it retries. A stream whose client leaves before its
  first response is still cancelled.
- During the drain the repository index is refused as Triton refuses it while it exits
  (UNAVAILABLE, "Server not ready"), over HTTP (503, Retry-After) and gRPC; it no longer lists
  models as READY while readiness already fails.
- An ensemble is ready only while each of its steps is, nested ensembles included: not while its
  step's only instance is dead and fails to restart, nor while the step is unloaded.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import time
from typing import Iterator

import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import DEADLINE_S, PRODUCT_MODELS, TESTS, pending_requests, raw_request, shm_entries, wait_pending, \
    wait_until
from gates import Gate
from test_cancellation import (CANCEL_MODELS, assert_stopped_after_one_word, cross_arenas, frontend_barrier,
                               raw_post, read_until)
from test_readiness import READINESS_MODELS, call, wait_for

ENSEMBLE_MODELS = TESTS / "models" / "ensemble_readiness"
ENSEMBLES = ("ens_relapse", "ens_nested")


@contextlib.contextmanager
def draining(server, tmp_path) -> Iterator[None]:
    """SIGTERM while a request to 'relapse' is held at a gate: the server drains until the block
    ends (the gate opens, also when the block fails), then it must stop cleanly."""
    gate = Gate(tmp_path / "gate")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(call, server.url, gate)
        try:
            gate.wait_started(1)
            server.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: raw_request(server.port, "GET", "/v2/health/ready").status != 200,
                     "readiness failing after SIGTERM", timeout=10)
            yield
            assert server.proc.poll() is None  # still draining: the held request is in flight
        finally:
            gate.open()
        assert held.result() > 0
    assert server.wait_exit(DEADLINE_S) == 0, server.log_tail()
    assert shm_entries(server.id) == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_whole_process_group_drains_as_one_to_the_launcher(server_factory, tmp_path, signum):
    """``kill -TERM -- -PGID``, Ctrl-C in a terminal and systemd's default KillMode signal every
    process of the server at once: a worker must not leave before the broker's drain is done, or
    the requests queued for it fail ("exited unexpectedly"), nor a frontend, or a request that
    comes during the drain hangs in its accept queue instead of getting a 503 with Retry-After."""
    server = server_factory.start([READINESS_MODELS], ["--exit-timeout-secs", "60"])
    gate = Gate(tmp_path / "gate")
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        held = pool.submit(call, server.url, gate)
        try:
            gate.wait_started(1)
            queued = [pool.submit(call, server.url, gate) for _ in range(2)]  # behind it, one instance
            wait_pending(server, "relapse", 3)
            os.killpg(server.pid, signum)
            wait_for(lambda: raw_request(server.port, "GET", "/v2/health/ready").status != 200,
                     "readiness failing after the signal", timeout=10)
            assert server.proc.poll() is None  # draining: three requests are in flight
            body = b'{"inputs": [{"name": "X", "shape": [1], "datatype": "INT32", "data": [0]}]}'
            late = raw_request(server.port, "POST", "/v2/models/relapse/infer", body, timeout=10)
            assert (late.status, late.headers.get("retry-after")) == (503, "1"), late
            assert b"Server is exiting" in late.body
        finally:
            gate.open()
        assert [f.result() > 0 for f in (held, *queued)] == [True] * 3
    assert server.wait_exit(DEADLINE_S) == 0, server.log_tail()
    assert "exited unexpectedly" not in server.log()
    assert shm_entries(server.id) == []


def assert_retry_later(e: openai.APIStatusError) -> None:
    assert e.status_code == 503, e
    assert e.response.headers.get("retry-after") == "1", dict(e.response.headers)
    assert isinstance(e.body, dict) and e.body.get("type") == "server_error", e.body  # OpenAI's error form


def test_openai_routes_answer_503_with_retry_after_during_a_drain(server_factory, tmp_path):
    args = ["--model-control-mode=explicit", "--exit-timeout-secs", "60"]
    for model in ("relapse", "echo_llm", "text_embedding"):
        args += ["--load-model", model]
    server = server_factory.start([READINESS_MODELS, PRODUCT_MODELS], args)
    base = f"http://{server.url}/v1"
    with openai.OpenAI(base_url=base, api_key="unused", max_retries=0) as oai:
        assert oai.completions.create(model="echo_llm", prompt="before the stop").choices[0].text
        with draining(server, tmp_path):
            with pytest.raises(openai.APIStatusError) as e:
                oai.completions.create(model="echo_llm", prompt="after the stop")
            assert_retry_later(e.value)
            assert "Server is exiting" in e.value.message
            with pytest.raises(openai.APIStatusError) as e:  # refused before the stream began: its status
                list(oai.chat.completions.create(model="echo_llm", messages=[{"role": "user", "content": "x"}],
                                                 stream=True))
            assert_retry_later(e.value)
            with pytest.raises(openai.APIStatusError) as e:
                oai.embeddings.create(model="text_embedding", input="after the stop")
            assert_retry_later(e.value)
            with pytest.raises(openai.APIStatusError) as e:  # the index it reads is refused (Server not ready)
                oai.models.list()
            assert_retry_later(e.value)

            # The openai package honours Retry-After: one retry a second later (its own back-off
            # would wait 0.5 s at most).
            with openai.OpenAI(base_url=base, api_key="unused", max_retries=1) as retrying:
                started = time.monotonic()
                with pytest.raises(openai.APIStatusError) as e:
                    retrying.completions.create(model="echo_llm", prompt="after the stop")
                assert_retry_later(e.value)
                assert time.monotonic() - started >= 1.0


def test_the_repository_index_is_refused_as_triton_does_during_a_drain(server_factory, tmp_path):
    server = server_factory.start([READINESS_MODELS], ["--exit-timeout-secs", "60"])
    http = httpclient.InferenceServerClient(server.url, network_timeout=DEADLINE_S)
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    assert {e["name"]: e["state"] for e in http.get_model_repository_index()}["relapse"] == "READY"
    with draining(server, tmp_path):
        for body in (b"{}", b'{"ready": true}'):
            answer = raw_request(server.port, "POST", "/v2/repository/index", body)
            assert answer.status == 503, answer
            assert answer.headers.get("retry-after") == "1", answer.headers
            assert answer.json() == {"error": "Server not ready"}
        with pytest.raises(InferenceServerException, match="Server not ready"):
            http.get_model_repository_index()
        with pytest.raises(InferenceServerException, match="Server not ready") as e:
            grpc.get_model_repository_index()
        assert e.value.status() == "StatusCode.UNAVAILABLE"
    http.close()
    grpc.close()


def index_states(port: int) -> dict[str, dict]:
    answer = raw_request(port, "POST", "/v2/repository/index", b"{}")
    assert answer.status == 200, answer
    return {e["name"]: e for e in answer.json()}


def ready_names(port: int) -> set[str]:
    answer = raw_request(port, "POST", "/v2/repository/index", b'{"ready": true}')
    assert answer.status == 200, answer
    return {e["name"] for e in answer.json()}


def test_an_ensemble_is_not_ready_while_its_step_has_no_live_instance(server_factory, monkeypatch, tmp_path):
    block = tmp_path / "block"
    monkeypatch.setenv("SHMSERVE_TEST_RELAPSE_BLOCK", str(block))
    server = server_factory.start([READINESS_MODELS, ENSEMBLE_MODELS])
    http = server.client()
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    assert all(http.is_model_ready(m) and grpc.is_model_ready(m) for m in ENSEMBLES)

    block.touch()  # from now on relapse's restarts fail in initialize(): it has no live instance
    for pid in server.worker_pids("relapse"):
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: server.log().count("failed to restart") >= 1, "a restart that failed")
    for model in ENSEMBLES:
        assert not http.is_model_ready(model) and not grpc.is_model_ready(model), model
    index = index_states(server.port)
    for model in ENSEMBLES:
        assert index[model]["state"] == "UNAVAILABLE", index[model]
        assert index[model]["reason"] == "ensemble 'ens_relapse' depends on 'relapse' which is not ready"
    assert not ready_names(server.port) & {"relapse", *ENSEMBLES}
    assert raw_request(server.port, "GET", "/v2/health/ready").status != 200  # strict readiness: relapse

    block.unlink()  # the next restart serves: the ensembles are ready again and answer
    wait_for(lambda: all(http.is_model_ready(m) for m in ENSEMBLES), "ensembles ready again")
    assert all(grpc.is_model_ready(m) for m in ENSEMBLES)
    assert {"relapse", *ENSEMBLES} <= ready_names(server.port)
    assert call(server.url, model="ens_nested") in server.worker_pids("relapse")
    http.close()
    grpc.close()


def test_an_ensemble_is_not_ready_while_its_step_is_unloaded(server_factory):
    server = server_factory.start([READINESS_MODELS, ENSEMBLE_MODELS],
                                  ["--model-control-mode=explicit", "--load-model", "ens_nested"])
    http = server.client()
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    assert all(http.is_model_ready(m) for m in ENSEMBLES)  # the ensemble brought its steps

    http.unload_model("relapse")
    wait_for(lambda: not http.is_model_ready("relapse"), "relapse unloaded")
    for model in ENSEMBLES:
        assert not http.is_model_ready(model) and not grpc.is_model_ready(model), model
    index = index_states(server.port)
    for model in ENSEMBLES:
        assert index[model]["state"] == "UNAVAILABLE", index[model]
        assert index[model]["reason"] == "ensemble 'ens_relapse' depends on 'relapse' which has no loaded version"
    assert not ready_names(server.port) & {"relapse", *ENSEMBLES}
    # As in Triton (where the ensemble is unloaded with its step), a model unloaded on purpose
    # does not fail the server's strict readiness.
    assert raw_request(server.port, "GET", "/v2/health/ready").status == 200

    http.load_model("relapse")
    assert all(http.is_model_ready(m) and grpc.is_model_ready(m) for m in ENSEMBLES)
    assert {"relapse", *ENSEMBLES} <= ready_names(server.port)
    assert call(server.url, model="ens_nested") in server.worker_pids("relapse")
    http.close()
    grpc.close()


@pytest.fixture(scope="module")
def cancel_server(module_factory):
    return module_factory.start([CANCEL_MODELS], ["--http-workers", "1", "--frontend-arena-mb", "1",
                                                  "--worker-arena-mb", "1"])


def test_a_queued_openai_stream_whose_client_disconnects_before_its_first_response_never_runs(cancel_server,
                                                                                               tmp_path):
    """An OpenAI stream's status waits for its first response (so that a refusal gets its own):
    a client that leaves meanwhile still cancels it, and nothing stays held."""
    server = cancel_server
    running, queued = tmp_path / "running", tmp_path / "queued"
    running.mkdir()
    queued.mkdir()
    chat = {"model": "slow_words", "stream": True}
    first = raw_post(server, "/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": str(running)}]})
    try:
        read_until(first, b"word0")
        second = raw_post(server, "/v1/chat/completions",
                          {**chat, "messages": [{"role": "user", "content": str(queued)}]})
        wait_pending(server, "slow_words", 2)  # behind the running one (one instance): no status sent yet
        second.close()
        frontend_barrier(server)
    finally:
        first.close()
    assert_stopped_after_one_word(running)
    wait_until(lambda: pending_requests(server, "slow_words") == 0, "nothing pending")
    assert not list(queued.iterdir()), "the cancelled queued stream ran"
    cross_arenas(server, Gate(tmp_path / "gate"))
