"""Readiness that tells the truth, and a graceful stop under Kubernetes, against a real server.

A model whose only instance is dead or fails to restart is not ready (HTTP ready, gRPC ModelReady,
the repository index) and is ready again once an instance serves; its version is not failed for
good by a restart that fails. On SIGTERM, readiness says no at once, requests in flight finish,
and requests that arrive during the drain get 503 with Retry-After; the drain lasts at most
``--exit-timeout-secs``.
"""
from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import DEADLINE_S, PYTHON, TESTS, pid_alive, raw_request, shm_entries
from gates import Gate

READINESS_MODELS = TESTS / "models" / "readiness"


def call(url: str, gate: Gate | None = None, timeout: float = DEADLINE_S, model: str = "relapse") -> int:
    """PID of the worker of 'relapse' that answered (held at ``gate`` until it opens)."""
    client = httpclient.InferenceServerClient(url, network_timeout=timeout, connection_timeout=timeout)
    try:
        t = httpclient.InferInput("X", [1], "INT32")
        t.set_data_from_numpy(np.array([0], dtype=np.int32))
        parameters = {"gate": gate.param} if gate is not None else None
        return int(client.infer(model, [t], parameters=parameters).as_numpy("PID")[0])
    finally:
        client.close()


def wait_for(predicate, what: str, timeout: float = DEADLINE_S) -> None:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"{what} not within {timeout} s"
        time.sleep(0.05)


def index_entry(port: int, ready: bool = False) -> list[dict]:
    answer = raw_request(port, "POST", "/v2/repository/index", b'{"ready": true}' if ready else b"{}")
    assert answer.status == 200, answer
    return [e for e in answer.json() if e["name"] == "relapse"]


def infer_body() -> bytes:
    return b'{"inputs": [{"name": "X", "shape": [1], "datatype": "INT32", "data": [0]}]}'


def test_a_model_whose_instance_fails_to_restart_is_not_ready_until_one_serves(server_factory, monkeypatch,
                                                                               tmp_path):
    block = tmp_path / "block"
    monkeypatch.setenv("SHMSERVE_TEST_RELAPSE_BLOCK", str(block))
    server = server_factory.start([READINESS_MODELS]).wait_ready()
    http = server.client()
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    assert http.is_model_ready("relapse") and grpc.is_model_ready("relapse")
    assert index_entry(server.port)[0]["state"] == "READY"

    block.touch()  # from now on its restarts fail in initialize()
    for pid in server.worker_pids("relapse"):
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not http.is_model_ready("relapse"), "not ready once its only instance died")
    wait_for(lambda: server.log().count("failed to restart") >= 2, "two restarts that failed")
    assert not http.is_model_ready("relapse") and not grpc.is_model_ready("relapse")
    entry = index_entry(server.port)
    assert entry[0]["state"] == "UNAVAILABLE" and "restarting" in entry[0]["reason"], entry
    assert index_entry(server.port, ready=True) == []

    block.unlink()  # the next restart (within the 10 s back-off at most) serves again
    wait_for(lambda: http.is_model_ready("relapse"), "ready again once an instance serves")
    assert grpc.is_model_ready("relapse") and index_entry(server.port)[0]["state"] == "READY"
    assert call(server.url) in server.worker_pids("relapse")
    http.close()
    grpc.close()


def test_sigterm_drains_answering_503_with_retry_after_and_failing_readiness(server_factory, tmp_path):
    server = server_factory.start([READINESS_MODELS], ["--exit-timeout-secs", "60"]).wait_ready()
    tree = server.tree()
    gate = Gate(tmp_path / "gate")
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    # A keep-alive connection opened before the stop, as a load balancer's pool holds one.
    pooled = httpclient.InferenceServerClient(server.url, network_timeout=DEADLINE_S)
    assert pooled.is_server_ready()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        held = pool.submit(call, server.url, gate)
        relayed = pool.submit(call, server.url, gate, model="relay")  # its BLS call comes after SIGTERM
        gate.wait_started(2)
        server.proc.send_signal(signal.SIGTERM)

        wait_for(lambda: raw_request(server.port, "GET", "/v2/health/ready").status != 200,
                 "readiness failing after SIGTERM", timeout=10)
        assert raw_request(server.port, "GET", "/v2/models/relapse/ready").status == 400
        assert not grpc.is_server_ready() and not grpc.is_model_ready("relapse")
        assert raw_request(server.port, "GET", "/v2/health/live").status == 200  # alive: not to be killed

        refused = raw_request(server.port, "POST", "/v2/models/relapse/infer", infer_body())
        assert refused.status == 503, refused
        assert refused.headers.get("retry-after") == "1", refused.headers
        assert "Server is exiting" in refused.json()["error"], refused
        with pytest.raises(InferenceServerException, match="Server is exiting") as e:
            t = grpcclient.InferInput("X", [1], "INT32")
            t.set_data_from_numpy(np.array([0], dtype=np.int32))
            grpc.infer("relapse", [t])
        assert e.value.status() == "StatusCode.UNAVAILABLE"
        with pytest.raises(InferenceServerException, match="Server is exiting"):
            t = httpclient.InferInput("X", [1], "INT32")
            t.set_data_from_numpy(np.array([0], dtype=np.int32))
            pooled.infer("relapse", [t])
        assert server.proc.poll() is None  # still draining: the held request is in flight
        gate.open()
        assert held.result() > 0  # what was in flight finished
        assert relayed.result() == held.result()  # its BLS call too (relapse's one instance answered)
    assert server.wait_exit(DEADLINE_S) == 0, server.log_tail()
    assert shm_entries(server.id) == []
    wait_for(lambda: not any(pid_alive(p) for p in tree), "every process gone")
    grpc.close()
    pooled.close()


def test_the_drain_lasts_at_most_exit_timeout_secs(server_factory, tmp_path):
    server = server_factory.start([READINESS_MODELS], ["--exit-timeout-secs", "2"]).wait_ready()
    gate = Gate(tmp_path / "gate")  # never opened: the request would run for the model's 120 s
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(call, server.url, gate)
        gate.wait_started(1)
        stopped = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait_exit(DEADLINE_S) == 0, server.log_tail()
        took = time.monotonic() - stopped
        with pytest.raises(Exception):  # noqa: B017 - cut off: the connection ends without an answer
            held.result()
    assert 2 <= took < 20, took
    assert "still in flight after 2 s (--exit-timeout-secs)" in server.log()
    assert shm_entries(server.id) == []


def test_is_ready_of_a_python_model_decides_its_readiness_off_the_request_path(server_factory, monkeypatch,
                                                                               tmp_path):
    doubt = tmp_path / "doubt"
    doubt.mkdir()
    monkeypatch.setenv("SHMSERVE_TEST_DOUBT_DIR", str(doubt))
    server = server_factory.start([READINESS_MODELS]).wait_ready()
    http = server.client()
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    x = httpclient.InferInput("X", [1], "INT32")
    x.set_data_from_numpy(np.array([0], dtype=np.int32))

    def verdict_becomes(ready: bool) -> None:  # each check answers with the verdict of the one before
        wait_for(lambda: http.is_model_ready("doubtful") == ready, f"is_ready() verdict {ready}")
        assert grpc.is_model_ready("doubtful") == ready

    verdict_becomes(True)
    for cause in ("no", "raise", "text"):
        (doubt / cause).touch()
        verdict_becomes(False)
        assert http.infer("doubtful", [x]).as_numpy("PID")[0] > 0  # readiness only: requests still run
        (doubt / cause).unlink()
        verdict_becomes(True)
    assert "is_ready() raised RuntimeError('the feature store is unreachable')" in server.log()
    assert "is_ready() must return a boolean value" in server.log()
    assert http.is_server_ready()  # the server's readiness is the models' load state, as Triton's

    (doubt / "hang").touch()  # a check that never returns: not ready after 5 s, inference unharmed
    http.is_model_ready("doubtful")
    started = time.monotonic()
    while time.monotonic() - started < 4:
        begin = time.monotonic()
        assert http.infer("doubtful", [x]).as_numpy("PID")[0] > 0
        assert time.monotonic() - begin < 2.0  # never behind is_ready()
        time.sleep(0.2)
    verdict_becomes(False)
    (doubt / "hang").unlink()
    verdict_becomes(True)
    http.close()
    grpc.close()


@pytest.mark.parametrize("value", ["-1", "nan", "soon"])
def test_a_drain_length_that_is_no_length_stops_the_start(value):
    run = subprocess.run([PYTHON, "-m", "shmserve", "--model-repository", str(READINESS_MODELS),
                          "--exit-timeout-secs", value], capture_output=True, text=True, timeout=DEADLINE_S)
    assert run.returncode == 2, run.stderr
    assert "--exit-timeout-secs" in run.stderr
