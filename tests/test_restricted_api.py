"""--http-restricted-api: restricted endpoint groups answer 403 without the header, normally with
it; other groups stay open; tritonclient passes the header through its ``headers`` argument."""
from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import PYTHON, ROOT, TEST_MODELS, raw_request

KEY = {"admin-key": "s3cret"}


@pytest.fixture(scope="module")
def guarded(module_factory):
    return module_factory.start([TEST_MODELS], [
        "--http-restricted-api=model-repository,shared-memory:admin-key=s3cret",
        "--http-restricted-api", "statistics,logging,model-config:Admin-Key=s3cret",
        "--model-control-mode=explicit", "--load-model", "raiser"])


@pytest.mark.parametrize("method,path,body", [
    ("POST", "/v2/repository/index", b"{}"),
    ("POST", "/v2/repository/models/raiser/load", b"{}"),
    ("GET", "/v2/systemsharedmemory/status", None),
    ("POST", "/v2/systemsharedmemory/unregister", b""),
    ("GET", "/v2/cudasharedmemory/status", None),
    ("GET", "/v2/models/stats", None),
    ("GET", "/v2/models/raiser/versions/1/stats", None),
    ("GET", "/v2/logging", None),
    ("GET", "/v2/models/raiser/config", None),
])
def test_restricted_groups_need_the_header(guarded, method, path, body):
    denied = raw_request(guarded.port, method, path, body=body)
    assert denied.status == 403, denied
    assert denied.json() == {"error": "This API is restricted, expecting header 'admin-key'"}
    wrong = raw_request(guarded.port, method, path, body=body, headers={"admin-key": "guess"})
    assert wrong.status == 403
    allowed = raw_request(guarded.port, method, path, body=body, headers=KEY)
    assert allowed.status == 200, allowed


@pytest.mark.parametrize("method,path", [
    ("GET", "/v2/health/live"), ("GET", "/v2/health/ready"), ("GET", "/v2"),
    ("GET", "/v2/models/raiser"), ("GET", "/v2/models/raiser/ready"),
])
def test_other_groups_stay_open(guarded, method, path):
    assert raw_request(guarded.port, method, path).status == 200


def test_tritonclient_with_and_without_the_header(guarded):
    client = httpclient.InferenceServerClient(guarded.url)
    x = httpclient.InferInput("X", [2], "INT32")
    x.set_data_from_numpy(np.array([1, 2], dtype=np.int32))
    assert client.infer("raiser", [x]).as_numpy("Y").tolist() == [2, 4]  # inference is not restricted
    with pytest.raises(InferenceServerException, match="This API is restricted") as e:
        client.get_model_repository_index()
    assert e.value.status() == "403"
    index = client.get_model_repository_index(headers=KEY)
    assert any(m["name"] == "raiser" for m in index)
    with pytest.raises(InferenceServerException, match="restricted"):
        client.unload_model("raiser")
    assert client.is_model_ready("raiser")  # the refused unload did nothing
    stats = client.get_inference_statistics("raiser", headers=KEY)
    assert stats["model_stats"][0]["inference_stats"]["success"]["count"] == 1
    client.close()


@pytest.mark.parametrize("flag,needle", [
    ("inference", "--http-restricted-api option format is '<config name>:<setting>=<value>'. Got inference"),
    ("bogus:k=v", "unknown restricted api 'bogus'"),
    ("inference:k", "option format is '<config name>:<setting>=<value>'. Got inference:k"),
    ("inference:k=", "option format is '<config name>:<setting>=<value>'. Got inference:k="),
    ("inference,inference:k=v", "restricted api 'inference' can not be specified in multiple config groups"),
])
def test_bad_restricted_api_flags_exit_2(flag, needle, tmp_path):
    import subprocess

    r = subprocess.run([PYTHON, "-m", "shmserve", "--model-repository", str(TEST_MODELS),
                        f"--http-restricted-api={flag}"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and needle in r.stderr, (r.returncode, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1


def test_restricted_inference_on_the_fast_path(server_factory):
    """Infer requests are answered by the frontend's own HTTP protocol; a restricted 'inference'
    group still needs its header there (and other groups stay open)."""
    server = server_factory.start([TEST_MODELS], ["--http-restricted-api=inference:infer-key=k1",
                                                  "--model-control-mode=explicit", "--load-model", "raiser"])
    client = httpclient.InferenceServerClient(server.url)
    x = httpclient.InferInput("X", [2], "INT32")
    x.set_data_from_numpy(np.array([1, 2], dtype=np.int32))
    for headers in (None, {"infer-key": "wrong"}):
        with pytest.raises(InferenceServerException, match="expecting header 'infer-key'") as e:
            client.infer("raiser", [x], headers=headers)
        assert e.value.status() == "403"
    assert client.infer("raiser", [x], headers={"infer-key": "k1"}).as_numpy("Y").tolist() == [2, 4]
    assert client.infer("raiser", [x], headers={"Infer-Key": "k1"}).as_numpy("Y").tolist() == [2, 4]
    assert client.is_model_ready("raiser")  # health is not restricted
    client.close()


def test_restrictions_larger_than_an_argument_may_be_start(server_factory):
    """The frontends' specs (with every restriction) once travelled on their command lines, where
    one argument is at most 128 KiB: larger ones failed every frontend's start."""
    value = "k" * (60 << 10)  # each flag fits an argument; together they do not
    flags = [f"--http-restricted-api={group}:{group}-key={value}" for group in ("statistics", "logging", "trace")]
    flags += [f"--grpc-restricted-protocol={group}:{group}-key={value}" for group in ("statistics", "logging", "trace")]
    server = server_factory.start([TEST_MODELS], [*flags, "--model-control-mode=explicit", "--load-model", "raiser"])
    assert raw_request(server.port, "GET", "/v2/logging").status == 403
    assert raw_request(server.port, "GET", "/v2/logging", headers={"logging-key": value}).status == 200
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(server.grpc_url) as c:  # (its keys are past gRPC's metadata limit)
        assert c.is_model_ready("raiser")
        with pytest.raises(InferenceServerException, match="expecting header 'triton-grpc-protocol-logging-key'"):
            c.get_log_settings()
