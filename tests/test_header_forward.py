"""--http-header-forward-pattern and --grpc-header-forward-pattern: request headers (gRPC metadata)
whose names match reach the model as string request parameters, as in Triton; others do not, and
without the flags none do. meta_echo returns ``request.parameters()`` as its PARAMETERS output."""
from __future__ import annotations

import http.client
import json
import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import PYTHON, ROOT, SHM_MODELS

# Triton matches the pattern anywhere in the name and ignores case: "^X-TENANT" takes x-tenant-id.
HTTP_PATTERN = "^X-TENANT|traceparent|^priority$"
GRPC_PATTERN = "^x-tenant|^traceparent$"
MODEL_ARGS = ["--model-control-mode", "explicit", "--load-model", "meta_echo"]
X = np.array([1, 2], dtype=np.int32)


@pytest.fixture(scope="module")
def forwarding(module_factory):
    server = module_factory.start([SHM_MODELS], [*MODEL_ARGS, "--http-header-forward-pattern", HTTP_PATTERN,
                                                 "--grpc-header-forward-pattern", GRPC_PATTERN])
    server.wait_grpc_ready()
    return server


def _http_params(server, headers=None, parameters=None) -> dict:
    client = httpclient.InferenceServerClient(server.url)
    try:
        x = httpclient.InferInput("X", [2], "INT32")
        x.set_data_from_numpy(X)
        result = client.infer("meta_echo", [x], headers=headers, parameters=parameters)
        assert result.as_numpy("Y").tolist() == [2, 3]
        return json.loads(result.as_numpy("PARAMETERS")[0])
    finally:
        client.close()


def _grpc_params(server, headers=None, parameters=None) -> dict:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        x = grpcclient.InferInput("X", [2], "INT32")
        x.set_data_from_numpy(X)
        result = client.infer("meta_echo", [x], headers=headers, parameters=parameters)
        return json.loads(result.as_numpy("PARAMETERS")[0])
    finally:
        client.close()


def test_http_infer_forwards_matching_headers_named_as_sent(forwarding):
    params = _http_params(forwarding, headers={"X-Tenant-Id": "acme", "traceparent": "00-4bf9-01",
                                               "X-Other": "not forwarded"})
    assert params == {"X-Tenant-Id": "acme", "traceparent": "00-4bf9-01"}


def test_http_header_wins_over_a_body_parameter_of_its_name(forwarding):
    params = _http_params(forwarding, headers={"x-tenant-id": "from-header"},
                          parameters={"x-tenant-id": "from-body", "kept": 7})
    assert params == {"x-tenant-id": "from-header", "kept": 7}


def test_http_large_binary_body_forwards_headers(forwarding):
    """A body of 1 MiB or more is copied into its request block as it arrives (ingest.py): its
    descriptor, written before the body is in, carries the forwarded headers too."""
    client = httpclient.InferenceServerClient(forwarding.url)
    try:
        big = np.arange(1 << 19, dtype=np.int32)  # 2 MiB
        x = httpclient.InferInput("X", list(big.shape), "INT32")
        x.set_data_from_numpy(big, binary_data=True)
        result = client.infer("meta_echo", [x], headers={"X-Tenant-Id": "bulk"})
        assert np.array_equal(result.as_numpy("Y"), big + 1)
        assert json.loads(result.as_numpy("PARAMETERS")[0]) == {"X-Tenant-Id": "bulk"}
    finally:
        client.close()


def test_http_header_sent_twice_forwards_its_last_value(forwarding):
    body = json.dumps({"inputs": [{"name": "X", "datatype": "INT32", "shape": [2], "data": [1, 2]}]}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", forwarding.port, timeout=60)
    try:
        conn.putrequest("POST", "/v2/models/meta_echo/infer")
        conn.putheader("x-tenant-id", "first")
        conn.putheader("x-tenant-id", "second")
        conn.putheader("content-type", "application/json")
        conn.putheader("content-length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        doc = json.loads(resp.read())
    finally:
        conn.close()
    assert resp.status == 200, doc
    out = {o["name"]: o["data"] for o in doc["outputs"]}
    assert json.loads(out["PARAMETERS"][0]) == {"x-tenant-id": "second"}


def test_a_forwarded_header_does_not_steer_the_server(forwarding):
    """Only the body's sequence, priority and timeout parameters count: a forwarded header of
    such a name is a string parameter for the model, not a refused or sequenced request."""
    client = httpclient.InferenceServerClient(forwarding.url)
    try:
        x = httpclient.InferInput("X", [2], "INT32")
        x.set_data_from_numpy(X)
        # the body's 'priority' must be an integer: the header's text would be refused with 400
        result = client.infer("meta_echo", [x], headers={"priority": "soon"})
        assert json.loads(result.as_numpy("PARAMETERS")[0]) == {"priority": "soon"}
    finally:
        client.close()


def test_http_generate_forwards_matching_headers(forwarding):
    conn = http.client.HTTPConnection("127.0.0.1", forwarding.port, timeout=60)
    try:
        conn.request("POST", "/v2/models/meta_echo/generate", body=json.dumps({"X": [1, 2], "max": 3}),
                     headers={"X-Tenant-Id": "acme", "X-Other": "no", "content-type": "application/json"})
        resp = conn.getresponse()
        doc = json.loads(resp.read())
    finally:
        conn.close()
    assert resp.status == 200, doc
    assert doc["Y"] == [2, 3]
    assert json.loads(doc["PARAMETERS"]) == {"max": 3, "X-Tenant-Id": "acme"}


def test_grpc_infer_forwards_matching_metadata(forwarding):
    params = _grpc_params(forwarding, headers={"x-tenant-id": "acme", "traceparent": "00-4bf9-01",
                                               "x-other": "no", "traceparent-extra": "no"})
    assert params == {"x-tenant-id": "acme", "traceparent": "00-4bf9-01"}


def test_grpc_binary_metadata_is_forwarded_as_text(forwarding):
    """A ``-bin`` key's value arrives as bytes: it is read as UTF-8, what is not UTF-8 replaced."""
    params = _grpc_params(forwarding, headers={"x-tenant-bin": b"\xffid\x00"})
    assert params == {"x-tenant-bin": "\ufffdid\x00"}


def test_grpc_metadata_wins_over_a_request_parameter_of_its_name(forwarding):
    params = _grpc_params(forwarding, headers={"x-tenant-id": "from-metadata"},
                          parameters={"x-tenant-id": "from-request", "kept": "yes"})
    assert params == {"x-tenant-id": "from-metadata", "kept": "yes"}


def test_grpc_stream_forwards_the_streams_metadata_to_each_request(forwarding):
    client = grpcclient.InferenceServerClient(forwarding.grpc_url)
    answers: queue.Queue = queue.Queue()
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)),
                            headers={"x-tenant-id": "streamer", "x-other": "no"})
        x = grpcclient.InferInput("X", [2], "INT32")
        x.set_data_from_numpy(X)
        for k in range(2):
            client.async_stream_infer("meta_echo", [x], request_id=str(k), parameters={"k": k})
        seen = []
        for _ in range(2):
            result, error = answers.get(timeout=60)
            assert error is None, error
            seen.append(json.loads(result.as_numpy("PARAMETERS")[0]))
        assert seen == [{"k": k, "x-tenant-id": "streamer"} for k in range(2)]
    finally:
        client.stop_stream()
        client.close()


def test_without_the_flags_no_header_is_forwarded(server_factory):
    server = server_factory.start([SHM_MODELS], MODEL_ARGS)
    server.wait_grpc_ready()
    headers = {"x-tenant-id": "acme", "traceparent": "00-4bf9-01"}
    assert _http_params(server, headers=dict(headers), parameters={"kept": 1}) == {"kept": 1}  # (it adds to them)
    assert _grpc_params(server, headers=headers) == {}


@pytest.mark.parametrize("flag", ["--http-header-forward-pattern", "--grpc-header-forward-pattern"])
def test_a_pattern_that_is_not_a_regular_expression_stops_the_start(flag, tmp_path):
    import subprocess

    r = subprocess.run([PYTHON, "-m", "shmserve", "--model-repository", str(tmp_path), flag, "x-(tenant"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert f"{flag} 'x-(tenant' is not a regular expression" in r.stderr
