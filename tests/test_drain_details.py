"""What the server says while it cannot serve, against a real server.

- An ensemble is ready only while each of its steps is, nested ensembles included: not while its
  step's only instance is dead and fails to restart, nor while the step is unloaded.
"""
from __future__ import annotations

import os
import signal

import tritonclient.grpc as grpcclient

from conftest import TESTS, raw_request
from test_readiness import READINESS_MODELS, call, wait_for

ENSEMBLE_MODELS = TESTS / "models" / "ensemble_readiness"
ENSEMBLES = ("ens_relapse", "ens_nested")


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
