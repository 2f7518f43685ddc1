"""Bad requests: each is a 400 with a message that says what is wrong, and the server keeps serving."""
from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import raw_request

A = np.arange(16, dtype=np.int32)
B = np.arange(16, dtype=np.int32) * 10


def _input(name, data, datatype="INT32", shape=None, binary=True):
    t = httpclient.InferInput(name, list(shape if shape is not None else data.shape), datatype)
    t.set_data_from_numpy(data, binary_data=binary)
    return t


def assert_still_serving(server) -> None:
    client = server.client()
    result = client.infer("add_sub", [_input("INPUT0", A), _input("INPUT1", B)])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)
    assert client.is_server_ready()


def infer_error(client, *args, **kwargs) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as e:
        client.infer(*args, **kwargs)
    return e.value


def raw_error(server, body: bytes, headers: dict | None = None, model: str = "add_sub") -> str:
    raw = raw_request(server.port, "POST", f"/v2/models/{model}/infer", body, headers)
    assert raw.status == 400, raw
    assert raw.headers["content-type"].startswith("application/json")
    doc = raw.json()
    assert isinstance(doc.get("error"), str) and doc["error"], doc
    return doc["error"]


def _binary_body(inputs: list[tuple[str, str, list[int], bytes]], size_of=None) -> tuple[bytes, dict]:
    """A binary-extension body; ``size_of`` overrides the binary_data_size each input claims."""
    size_of = size_of or {}
    head = json.dumps({"inputs": [
        {"name": n, "datatype": dt, "shape": shape, "parameters": {"binary_data_size": size_of.get(n, len(data))}}
        for n, dt, shape, data in inputs]}).encode()
    body = head + b"".join(data for *_, data in inputs)
    return body, {"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"}


# -- through tritonclient -----------------------------------------------------------------------


def test_unknown_model(server, client):
    err = infer_error(client, "x", [_input("INPUT0", A), _input("INPUT1", B)])
    assert err.status() == "404"  # Triton 2.51's NOT_FOUND
    assert "Request for unknown model: 'x' is not found" in err.message()
    assert_still_serving(server)


# The texts below are Triton 2.51's, word for word (taken from the reference server on the same
# requests), request id prefix and trailing space included: clients compare them.
def test_wrong_shape(server, client):
    short = np.arange(3, dtype=np.int32)
    err = infer_error(client, "add_sub", [_input("INPUT0", short), _input("INPUT1", B)])
    assert err.status() == "400"
    assert err.message() == ("[request id: <id_unknown>] unexpected shape for input 'INPUT0' for model 'add_sub'. "
                             "Expected [16], got [3]. ")
    assert_still_serving(server)


@pytest.mark.parametrize("request_id, tag", [("", "<id_unknown>"), ("req-7", "req-7")])
def test_wrong_datatype(server, client, request_id, tag):
    err = infer_error(client, "add_sub", [_input("INPUT0", A.astype(np.float32), "FP32"), _input("INPUT1", B)],
                      request_id=request_id)
    assert err.status() == "400"
    assert err.message() == (f"[request id: {tag}] inference input 'INPUT0' data-type is 'FP32', but model "
                             f"'add_sub' expects 'INT32'")
    assert_still_serving(server)


def test_missing_input(server, client):
    err = infer_error(client, "add_sub", [_input("INPUT0", A)])
    assert err.status() == "400"
    assert err.message() == ("[request id: <id_unknown>] expected 2 inputs but got 1 inputs for model 'add_sub'. "
                             "Got input(s) ['INPUT0'], but missing required input(s) ['INPUT1']. Please provide "
                             "all required input(s).")
    assert_still_serving(server)


def test_input_given_twice(server):
    doc = {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [16], "data": A.tolist()},
                      {"name": "INPUT0", "datatype": "INT32", "shape": [16], "data": A.tolist()}]}
    msg = raw_error(server, json.dumps(doc).encode(), {"Content-Type": "application/json"})
    assert msg == "[request id: <id_unknown>] input 'INPUT0' already exists in request"
    assert_still_serving(server)


def test_unexpected_input(server, client):
    """An input the model does not have: named when the count is right, counted (Triton counts
    first) when it is one too many."""
    err = infer_error(client, "add_sub", [_input("INPUT0", A), _input("INPUT9", B)])
    assert err.status() == "400"
    assert err.message() == "unexpected inference input 'INPUT9' for model 'add_sub'"
    err = infer_error(client, "add_sub", [_input("INPUT0", A), _input("INPUT1", B), _input("INPUT9", B)])
    assert err.status() == "400"
    assert err.message() == (
        "[request id: <id_unknown>] expected 2 inputs but got 3 inputs for model 'add_sub'. Got input(s) "
        "['INPUT0','INPUT1','INPUT9'], but missing required input(s) ]. Please provide all required input(s).")
    assert_still_serving(server)


def test_unexpected_output_name(server, client):
    err = infer_error(client, "add_sub", [_input("INPUT0", A), _input("INPUT1", B)],
                      outputs=[httpclient.InferRequestedOutput("OUTPUT7")])
    assert err.status() == "400"
    assert "unexpected inference output 'OUTPUT7' for model 'add_sub'" in err.message()
    assert_still_serving(server)


@pytest.mark.parametrize("method,path", [
    ("POST", "/v2/models/x/infer"),
    ("GET", "/v2/models/x"),
    ("GET", "/v2/models/x/config"),
    ("POST", "/v2/models/add_sub/versions/7/infer"),
    ("GET", "/v2/models/add_sub/versions/7"),
    ("GET", "/v2/models/add_sub/versions/7/config"),
    ("POST", "/v2/models/x/generate"),
])
def test_unknown_model_or_version_is_404(server, method, path):
    """Triton 2.51 answers NOT_FOUND (404) for a model or version it does not have, on infer,
    generate, metadata and config alike (readiness and statistics keep their 400, as Triton's)."""
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [16], "data": list(range(16))},
                                  {"name": "INPUT1", "datatype": "INT32", "shape": [16], "data": list(range(16))}]})
    raw = raw_request(server.port, method, path, body=body.encode() if method == "POST" else None)
    assert raw.status == 404, (path, raw.status, raw.body)
    assert raw.json()["error"].startswith("Request for unknown model: "), raw.json()
    assert_still_serving(server)


@pytest.mark.parametrize("body", [b'{"inputs": []}', b"{not json", b'{"inputs": [{"name": "X"}]}'])
def test_unknown_model_wins_over_a_bad_body(server, body):
    """Triton looks the model up before the body: a malformed request to a model or version the
    server does not have is its 404, while the same body to a model it has stays a 400."""
    for path, text in (("/v2/models/nope/infer", "Request for unknown model: 'nope' is not found"),
                       ("/v2/models/add_sub/versions/7/infer",
                        "Request for unknown model: 'add_sub' version 7 is not found")):
        raw = raw_request(server.port, "POST", path, body=body)
        assert raw.status == 404 and raw.json() == {"error": text}, (path, raw)
    raw = raw_request(server.port, "POST", "/v2/models/add_sub/infer", body=body)
    assert raw.status == 400 and "unknown model" not in raw.json()["error"], raw
    assert_still_serving(server)


@pytest.mark.parametrize("version", ["7", "0"])
def test_unknown_version(server, client, version):
    err = infer_error(client, "add_sub", [_input("INPUT0", A), _input("INPUT1", B)], model_version=version)
    assert err.status() == "404"
    assert f"Request for unknown model: 'add_sub' version {version} is not found" in err.message()
    assert_still_serving(server)


def test_non_numeric_version(server):
    body = json.dumps({"inputs": [
        {"name": "INPUT0", "datatype": "INT32", "shape": [16], "data": A.tolist()},
        {"name": "INPUT1", "datatype": "INT32", "shape": [16], "data": B.tolist()}]}).encode()
    raw = raw_request(server.port, "POST", "/v2/models/add_sub/versions/latest/infer", body)
    assert raw.status == 404, raw  # Triton 2.51: its route takes digits only, so no route: its plain 404
    assert raw.json() == {"error": "Not Found"}
    assert_still_serving(server)


@pytest.mark.parametrize("method,suffix", [("GET", ""), ("GET", "/ready"), ("GET", "/config"), ("GET", "/stats"),
                                           ("POST", "/infer")])
def test_a_version_too_large_for_an_int64_is_tritons_400(server, method, suffix):
    """Measured on Triton 2.51: digits its std::stol cannot hold are a 400 on every endpoint that
    names a version (the largest int64 is just an unknown version: 404)."""
    huge = "9223372036854775808"
    raw = raw_request(server.port, method, f"/v2/models/add_sub/versions/{huge}{suffix}",
                      b'{"inputs": []}' if method == "POST" else None)
    assert raw.status == 400, raw
    assert raw.json() == {"error": f"failed to get model version from specified version string '{huge}' (details: "
                                   f"stol), version should be an integral value > 0"}
    raw = raw_request(server.port, "GET", "/v2/models/add_sub/versions/9223372036854775807")
    assert raw.status == 404, raw
    assert_still_serving(server)


def test_an_empty_batch_and_a_missing_batch_dimension_in_tritons_words(server):
    """A batching model: a batch of 0 rows fails Triton's byte-size check (which counts one row),
    a shape without dimensions has no batch dimension."""
    def refusal(shape: list[int], data: list) -> str:
        doc = {"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": shape, "data": data}]}
        return raw_error(server, json.dumps(doc).encode(), {"Content-Type": "application/json"}, model="digits")

    assert refusal([0, 1, 8, 8], []) == ("[request id: <id_unknown>] input byte size mismatch for input 'INPUT__0' "
                                         "for model 'digits'. Expected 256, got 0")
    assert refusal([], [1.0]) == ("[request id: <id_unknown>] input 'INPUT__0' has no shape but model requires "
                                  "batch dimension for 'digits'")
    assert_still_serving(server)


def test_batch_too_large(server, client):
    x = np.zeros((65, 1, 8, 8), dtype=np.float32)
    err = infer_error(client, "digits", [_input("INPUT__0", x, "FP32")])
    assert err.status() == "400"
    assert err.message() == "[request id: <id_unknown>] inference request batch-size must be <= 64 for 'digits'"
    assert_still_serving(server)


def test_missing_batch_dimension(server, client):
    x = np.zeros((1, 8, 8), dtype=np.float32)
    err = infer_error(client, "digits", [_input("INPUT__0", x, "FP32")])
    assert err.status() == "400"
    assert err.message() == (
        "[request id: <id_unknown>] unexpected shape for input 'INPUT__0' for model 'digits'. Expected "
        "[-1,1,8,8], got [1,8,8]. NOTE: Setting a non-zero max_batch_size in the model config requires a batch "
        "dimension to be prepended to each input shape. If you want to specify the full shape including the "
        "batch dim in your input dims config, try setting max_batch_size to zero. See the model configuration "
        "docs for more info on max_batch_size.")
    assert_still_serving(server)


_PAIR_MODEL = """import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("SUM", pb_utils.get_input_tensor_by_name(r, "A").as_numpy()
                                                            + pb_utils.get_input_tensor_by_name(r, "B").as_numpy())])
                for r in requests]
"""


def test_inputs_of_different_batch_sizes_are_refused(server_factory, tmp_path):
    """A batching model's inputs share one batch dimension: a request whose inputs disagree on it
    is Triton's 400, not a batch the model would see with rows missing."""
    model = tmp_path / "repo" / "pair" / "1"
    model.mkdir(parents=True)
    (model / "model.py").write_text(_PAIR_MODEL)
    (model.parent / "config.pbtxt").write_text(
        'name: "pair"\nbackend: "python"\nmax_batch_size: 8\n'
        'input [ { name: "A" data_type: TYPE_INT32 dims: [ 2 ] }, { name: "B" data_type: TYPE_INT32 dims: [ 2 ] } ]\n'
        'output [ { name: "SUM" data_type: TYPE_INT32 dims: [ 2 ] } ]\n')
    client = server_factory.start([tmp_path / "repo"]).client()
    try:
        three, two = np.ones((3, 2), dtype=np.int32), np.ones((2, 2), dtype=np.int32)
        err = infer_error(client, "pair", [_input("A", three), _input("B", two)], request_id="r-1")
        assert err.status() == "400"
        assert err.message() == "[request id: r-1] input 'B' batch size does not match other inputs for 'pair'"
        result = client.infer("pair", [_input("A", three), _input("B", three)])
        np.testing.assert_array_equal(result.as_numpy("SUM"), three * 2)
    finally:
        client.close()


_CONSTANT_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([7], dtype=np.int32))])
                for _ in requests]
"""


def test_a_model_that_declares_no_inputs_refuses_any_input(server_factory, tmp_path):
    """A config with no inputs (a model that makes its answer from nothing) takes requests with no
    inputs; an input it did not declare is Triton's 400, as for any other model."""
    model = tmp_path / "repo" / "constant" / "1"
    model.mkdir(parents=True)
    (model / "model.py").write_text(_CONSTANT_MODEL)
    (model.parent / "config.pbtxt").write_text(
        'name: "constant"\nbackend: "python"\nmax_batch_size: 0\n'
        'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]\n')
    client = server_factory.start([tmp_path / "repo"]).client()
    try:
        err = infer_error(client, "constant", [_input("X", A)])
        assert err.status() == "400" and err.message() == (
            "[request id: <id_unknown>] expected 0 inputs but got 1 inputs for model 'constant'. Got input(s) "
            "['X'], but missing required input(s) ]. Please provide all required input(s).")
        assert client.infer("constant", []).as_numpy("OUT").tolist() == [7]
    finally:
        client.close()


# -- malformed bodies, on the wire ---------------------------------------------------------------


def test_wrong_byte_size_in_binary_mode(server):
    # 60 bytes claimed and sent for an INT32 [16] tensor (64 bytes).
    body, headers = _binary_body([("INPUT0", "INT32", [16], A.tobytes()[:60]),
                                  ("INPUT1", "INT32", [16], B.tobytes())])
    msg = raw_error(server, body, headers)
    assert msg == ("[request id: <id_unknown>] input byte size mismatch for input 'INPUT0' for model 'add_sub'. "
                   "Expected 64, got 60")
    assert_still_serving(server)


def test_binary_size_larger_than_body_is_truncated_body(server):
    body, headers = _binary_body([("INPUT0", "INT32", [16], A.tobytes()),
                                  ("INPUT1", "INT32", [16], B.tobytes()[:32])], size_of={"INPUT1": 64})
    msg = raw_error(server, body, headers)
    assert "INPUT1" in msg
    assert "end of the request body" in msg or "truncated" in msg
    assert_still_serving(server)


def test_header_length_beyond_body(server):
    body, headers = _binary_body([("INPUT0", "INT32", [16], A.tobytes()),
                                  ("INPUT1", "INT32", [16], B.tobytes())])
    headers["Inference-Header-Content-Length"] = str(len(body) + 10)
    msg = raw_error(server, body, headers)
    assert msg == f"inference header size should be in range (0, {len(body)}), got: {len(body) + 10}"  # Triton's
    assert_still_serving(server)


def test_header_length_not_a_number(server):
    body, headers = _binary_body([("INPUT0", "INT32", [16], A.tobytes()),
                                  ("INPUT1", "INT32", [16], B.tobytes())])
    headers["Inference-Header-Content-Length"] = "twelve"
    msg = raw_error(server, body, headers)
    assert "twelve" in msg
    assert_still_serving(server)


def test_truncated_json_body(server):
    body = json.dumps({"inputs": [
        {"name": "INPUT0", "datatype": "INT32", "shape": [16], "data": A.tolist()},
        {"name": "INPUT1", "datatype": "INT32", "shape": [16], "data": B.tolist()}]}).encode()
    msg = raw_error(server, body[:len(body) // 2])
    assert "JSON" in msg or "json" in msg
    assert_still_serving(server)


def test_unclaimed_binary_tail(server):
    body, headers = _binary_body([("INPUT0", "INT32", [16], A.tobytes()),
                                  ("INPUT1", "INT32", [16], B.tobytes())])
    msg = raw_error(server, body + b"\x00" * 8, headers)
    assert "8 bytes" in msg
    assert_still_serving(server)


@pytest.mark.parametrize("body", [b"{\"inputs\": [}", b"not json at all", b"\xff\xfe\x00garbage", b""],
                         ids=["broken", "text", "binary-junk", "empty"])
def test_bad_json(server, body):
    msg = raw_error(server, body, {"Content-Type": "application/json"})
    assert "failed to parse the request JSON buffer" in msg
    assert_still_serving(server)


@pytest.mark.parametrize("doc,needle", [
    ([1, 2, 3], "Unable to parse 'inputs'"),
    ({"inputs": []}, "inputs"),
    ({"inputs": "INPUT0"}, "inputs"),
    ({"inputs": [{"datatype": "INT32", "shape": [16], "data": [0] * 16}]}, "name"),
    ({"inputs": [{"name": "INPUT0", "datatype": "INT128", "shape": [16], "data": [0] * 16}]}, "invalid datatype for input INPUT0"),
    ({"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": "16", "data": [0] * 16}]}, "shape"),
    ({"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [-16], "data": [0] * 16}]},
     "Unable to parse 'shape'"),
    ({"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [16]}]}, "But no field is set"),
    ({"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [16], "data": [0] * 15}]}, "Shape does not match"),
    ({"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [16], "data": ["a"] * 16}]}, "Unable to parse 'data'"),
    ({"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [16], "data": [1.5] * 16}]},
     "non-signed-integer as signed-integer"),
    ({"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [16], "data": [True] * 16}]},
     "non-signed-integer as signed-integer"),
], ids=["array", "no-inputs", "inputs-not-list", "no-name", "bad-datatype", "shape-not-list", "negative-dim",
        "no-data", "element-count", "strings-for-ints", "floats-for-ints", "bools-for-ints"])
def test_malformed_request_documents(server, doc, needle):
    msg = raw_error(server, json.dumps(doc).encode(), {"Content-Type": "application/json"})
    assert needle in msg
    assert_still_serving(server)


def test_error_then_good_on_the_same_connection(server):
    """A 400 must not poison a keep-alive connection: tritonclient reuses its connections."""
    client = httpclient.InferenceServerClient(server.url, concurrency=1)
    for _ in range(3):
        err = infer_error(client, "add_sub", [_input("INPUT0", A)])
        assert err.status() == "400"
        result = client.infer("add_sub", [_input("INPUT0", A), _input("INPUT1", B)])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)
    client.close()


def test_after_all_errors_a_good_request_still_works(server, client):
    assert client.is_server_live() and client.is_server_ready()
    assert_still_serving(server)
    result = client.infer("add_sub", [_input("INPUT0", A, binary=False), _input("INPUT1", B, binary=False)],
                          outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=False)])
    assert result.get_output("OUTPUT0")["data"] == (A + B).tolist()
    index = {e["name"]: e["state"] for e in client.get_model_repository_index()}
    assert index["add_sub"] == "READY" and index["digits"] == "READY"
