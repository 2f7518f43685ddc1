"""The HTTP details Triton's clients rely on, against a real server: raw binary requests (a body
that is one tensor's bytes, as curl posts an image), the generate endpoint's checks, order, id
and texts, duplicate output names, and the refusal texts clients match on (Triton's words).
"""
from __future__ import annotations

import gzip
import hashlib
import http.client
import json
import os
import socket
import struct
import zlib

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import TESTS, raw_request, read_raw_response

MODELS = TESTS / "models" / "http_details"
MAX_INPUT = 1 << 20
UNKNOWN = "[request id: <id_unknown>] "


@pytest.fixture(scope="module")
def srv(module_factory):
    return module_factory.start([MODELS], ["--http-max-input-size", str(MAX_INPUT)])


def post_raw(server, model: str, body: bytes, headers: dict | None = None) -> tuple[int, dict, bytes]:
    """What ``curl --data-binary @file -H 'Inference-Header-Content-Length: 0'`` sends."""
    sent = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": "0", **(headers or {})}
    r = raw_request(server.port, "POST", f"/v2/models/{model}/infer", body, sent)
    return r.status, r.headers, r.body


def post_chunked(server, path: str, pieces: list[bytes], headers: dict) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", path, body=iter(pieces), headers=headers, encode_chunked=True)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def binary_outputs(headers: dict, body: bytes) -> dict[str, tuple[dict, bytes]]:
    """The outputs of a binary answer: each one's JSON entry and its bytes."""
    assert headers["content-type"] == "application/octet-stream", headers
    n = int(headers["inference-header-content-length"])
    doc = json.loads(body[:n])
    out, pos = {}, n
    for o in doc["outputs"]:
        size = o["parameters"]["binary_data_size"]
        out[o["name"]] = (o, body[pos:pos + size])
        pos += size
    assert pos == len(body)
    return out


def error_of(status: int, *answer, expected: int = 400) -> str:
    """The error text of an answer ``(status, [headers,] body)``, which must have ``expected``."""
    body = answer[-1]
    assert status == expected, (status, body)
    return json.loads(body)["error"]


# -- raw binary requests ---------------------------------------------------------------------------

def test_raw_binary_body_is_a_batch_of_one_with_every_output_binary(srv):
    values = np.arange(4, dtype=np.float32)
    status, headers, body = post_raw(srv, "raw_vec", values.tobytes())
    assert status == 200, body
    outputs = binary_outputs(headers, body)
    assert set(outputs) == {"DOUBLED", "SHAPE"}  # every output, each as binary data
    entry, data = outputs["DOUBLED"]
    assert entry["shape"] == [1, 4] and entry["datatype"] == "FP32"
    np.testing.assert_array_equal(np.frombuffer(data, np.float32), values * 2)
    assert np.frombuffer(outputs["SHAPE"][1], np.int64).tolist() == [1, 4]


def test_raw_binary_chunked_body(srv):
    """curl -H 'Transfer-Encoding: chunked': the same request without a Content-Length."""
    values = np.arange(1000, dtype=np.float32)
    raw = values.tobytes()
    status, headers, body = post_chunked(srv, "/v2/models/raw_vec/infer", [raw[:1000], raw[1000:2500], raw[2500:]],
                                         {"Inference-Header-Content-Length": "0"})
    assert status == 200, body
    entry, data = binary_outputs(headers, body)["DOUBLED"]
    assert entry["shape"] == [1, 1000]
    np.testing.assert_array_equal(np.frombuffer(data, np.float32), values * 2)


def test_raw_binary_gzip_body_is_inflated_first(srv):
    values = np.arange(64, dtype=np.float32)
    status, headers, body = post_raw(srv, "raw_vec", gzip.compress(values.tobytes()), {"Content-Encoding": "gzip"})
    assert status == 200, body
    entry, data = binary_outputs(headers, body)["DOUBLED"]
    assert entry["shape"] == [1, 64]
    np.testing.assert_array_equal(np.frombuffer(data, np.float32), values * 2)


def test_raw_binary_image_into_a_bytes_input(srv):
    """The body is the one BYTES element, as an image posted with curl."""
    image = os.urandom(300_000)
    status, headers, body = post_raw(srv, "raw_text", image, {"Content-Type": "image/jpeg"})
    assert status == 200, body
    outputs = binary_outputs(headers, body)
    assert np.frombuffer(outputs["LENGTH"][1], np.int64).tolist() == [len(image)]
    digest = outputs["DIGEST"][1]
    assert struct.unpack("<I", digest[:4])[0] == 64 and digest[4:].decode() == hashlib.sha256(image).hexdigest()


@pytest.mark.parametrize("model, body, text", [
    ("gen", b"x" * 8, f"{UNKNOWN}Raw request must only have 1 input (found 1) to be deduced but got 3 inputs in "
                      f"'gen' model configuration"),
    ("raw_two_var", b"x" * 8, f"{UNKNOWN}The shape of the raw input 'INPUT' can not be deduced because there are "
                              f"more than one variable-sized dimension"),
    ("raw_text_var", b"x" * 8, f"{UNKNOWN}For BYTE datatype raw input 'INPUT', the model must have input shape [1]"),
    ("raw_vec", b"x" * 10, f"{UNKNOWN}input byte size mismatch for input 'raw_input' for model 'raw_vec'. Expected "
                           f"8, got 10"),  # (Triton names the body's tensor so)
], ids=["three-inputs", "two-variable-dims", "bytes-not-one", "size-not-a-multiple"])
def test_raw_binary_refusals_are_tritons(srv, model, body, text):
    assert error_of(*post_raw(srv, model, body)) == text
    assert_still_serving_here(srv)


def test_raw_binary_to_an_unknown_model_is_404(srv):
    status, _, body = post_raw(srv, "no_such_model", b"1234")
    assert status == 404 and "no_such_model" in json.loads(body)["error"]


def test_raw_binary_body_over_the_limit(srv):
    """Triton's text for a raw body over --http-max-input-size, declared or chunked."""
    big = b"\0" * (MAX_INPUT + 8)
    text = (f"Raw input has a byte_size ({len(big)} bytes) that exceeds the maximum allowed value of {MAX_INPUT} "
            f"bytes. Use --http-max-input-size to increase the limit.")
    assert error_of(*post_raw(srv, "raw_vec", big)) == text
    msg = error_of(*post_chunked(srv, "/v2/models/raw_vec/infer", [big[:MAX_INPUT // 2]] * 4,
                                 {"Inference-Header-Content-Length": "0"}))
    assert msg.startswith("Raw input has a byte_size (") and "Use --http-max-input-size" in msg
    assert_still_serving_here(srv)


@pytest.mark.parametrize("value", ["-1", "3"])
def test_inference_header_length_out_of_range(srv, value):
    status, _, body = post_raw(srv, "raw_vec", b"{}", {"Inference-Header-Content-Length": value})
    assert error_of(status, body) == f"inference header size should be in range (0, 2), got: {value}"


def assert_still_serving_here(server) -> None:
    status, _, body = post_raw(server, "raw_vec", np.ones(2, np.float32).tobytes())
    assert status == 200, body


# -- duplicate outputs, shapes ---------------------------------------------------------------------

def test_duplicate_output_names_are_refused(srv):
    client = httpclient.InferenceServerClient(srv.url)
    try:
        inp = httpclient.InferInput("INPUT", [1, 3], "FP32")
        inp.set_data_from_numpy(np.ones((1, 3), np.float32))
        outputs = [httpclient.InferRequestedOutput("DOUBLED"), httpclient.InferRequestedOutput("DOUBLED")]
        with pytest.raises(InferenceServerException) as e:
            client.infer("raw_vec", [inp], outputs=outputs, request_id="r-9")
        assert e.value.status() == "400"
        assert e.value.message() == "[request id: r-9] output 'DOUBLED' already exists in request"
        result = client.infer("raw_vec", [inp], outputs=outputs[:1])
        np.testing.assert_array_equal(result.as_numpy("DOUBLED"), np.full((1, 3), 2, np.float32))
    finally:
        client.close()


@pytest.mark.parametrize("shape, datatype, text", [
    ([1, -3], "FP32", "Unable to parse 'shape': attempt to access JSON non-unsigned-integer as unsigned-integer"),
    ([1 << 62, 4], "FP32", f"invalid shape for input 'INPUT': shape [{1 << 62},4] causes total element count to "
                           f"exceed maximum size of {(1 << 63) - 1}"),
    ([1, 1 << 61], "FP64", f"byte size overflow for input 'INPUT': element count ({1 << 61}) * data type size (8) "
                           f"exceeds maximum allowed size ({(1 << 63) - 1})"),
], ids=["negative", "element-count", "byte-size"])
def test_shape_refusals_use_tritons_words(srv, shape, datatype, text):
    doc = {"inputs": [{"name": "INPUT", "datatype": datatype, "shape": shape, "data": [1.0]}]}
    r = raw_request(srv.port, "POST", "/v2/models/raw_vec/infer", json.dumps(doc).encode())
    assert error_of(r.status, r.body).startswith(text)


def test_too_few_inputs_are_counted_before_their_names_are_looked_at(srv):
    """Triton counts first: one input the model does not have, where two are required, is the
    count's refusal, not the unknown name's (checked on Triton 2.51)."""
    doc = {"inputs": [{"name": "VALUE", "datatype": "INT32", "shape": [1], "data": [1]}]}
    r = raw_request(srv.port, "POST", "/v2/models/gen/infer", json.dumps(doc).encode())
    assert error_of(r.status, r.body) == (
        f"{UNKNOWN}expected number of inputs between 2 and 3 but got 1 inputs for model 'gen'. Got input(s) "
        f"['VALUE'], but missing required input(s) ['PROMPT','MAX_TOKENS']. Please provide all required input(s).")


def test_an_output_the_model_did_not_produce_is_left_out(srv):
    """As Triton 2.51: a requested output the model's response lacks is not in the answer (it was
    a 400 here), over HTTP and gRPC; the server's log names it once."""
    doc = {"inputs": [{"name": "X", "datatype": "INT32", "shape": [2], "data": [1, 2]}],
           "outputs": [{"name": "Y"}, {"name": "X2"}]}
    for _ in range(2):
        r = raw_request(srv.port, "POST", "/v2/models/skips_y/infer", json.dumps(doc).encode())
        assert r.status == 200, r.body
        assert [(o["name"], o["data"]) for o in r.json()["outputs"]] == [("X2", [2, 4])]
    with grpcclient.InferenceServerClient(srv.wait_grpc_ready().grpc_url) as g:
        x = grpcclient.InferInput("X", [2], "INT32")
        x.set_data_from_numpy(np.array([1, 2], np.int32))
        result = g.infer("skips_y", [x], outputs=[grpcclient.InferRequestedOutput("Y"),
                                                   grpcclient.InferRequestedOutput("X2")])
        assert result.as_numpy("Y") is None and result.as_numpy("X2").tolist() == [2, 4]
    assert srv.log().count("output 'Y' was requested but the model did not produce it") == 1


def test_too_many_chunks_are_refused_as_triton_does(srv):
    """More than 65536 non-empty chunks: Triton's 400 and text; the server goes on."""
    head = (b"POST /v2/models/raw_vec/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Inference-Header-Content-Length: 0\r\n\r\n")
    with socket.create_connection(("127.0.0.1", srv.port), timeout=60) as sock:
        sock.sendall(head + b"4\r\n\0\0\0\0\r\n" * 65537 + b"0\r\n\r\n")
        status, _, body = read_raw_response(sock.makefile("rb"))
    assert error_of(status, body) == ("Chunked request body exceeds maximum of 65536 non-empty chunks. Send fewer "
                                      "or larger HTTP chunks.")
    assert_still_serving_here(srv)


def test_as_many_chunks_as_allowed_are_taken(srv):
    head = (b"POST /v2/models/raw_vec/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Inference-Header-Content-Length: 0\r\n\r\n")
    with socket.create_connection(("127.0.0.1", srv.port), timeout=60) as sock:
        sock.sendall(head + b"4\r\n\0\0\0\0\r\n" * 65536 + b"0\r\n\r\n")
        status, headers, body = read_raw_response(sock.makefile("rb"))
    assert status == 200, body[:300]
    assert binary_outputs(headers, body)["DOUBLED"][0]["shape"] == [1, 65536]


# -- the generate endpoint -------------------------------------------------------------------------

def generate(server, body: bytes | dict, stream: bool = False) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = raw_request(server.port, "POST", f"/v2/models/gen/generate{'_stream' if stream else ''}", data,
                    {"Content-Type": "application/json"})
    return r.status, r.body


def test_generate_echoes_the_request_id(srv):
    status, body = generate(srv, {"id": "req-7", "PROMPT": "ab", "MAX_TOKENS": 2, "top_k": 3})
    assert status == 200, body
    doc = json.loads(body)
    assert doc["id"] == "req-7" and doc["TEXT"] == "abab" and doc["model_name"] == "gen"
    assert json.loads(doc["PARAMS"]) == {"id": "req-7", "top_k": 3}  # (Triton passes the id as a parameter too)
    status, body = generate(srv, {"id": "req-8", "PROMPT": "c", "MAX_TOKENS": 1}, stream=True)
    assert status == 200, body
    events = [json.loads(line[len(b"data: "):]) for line in body.split(b"\n\n") if line.startswith(b"data: ")]
    assert [(e["id"], e["TEXT"]) for e in events] == [("req-8", "c")]


def test_generate_repeated_parameter_reads_as_in_triton(srv):
    """Triton reads a repeated key's first value in its object each time the key comes: the
    model sees the top level's first value, or a later ``parameters`` object's."""
    status, body = generate(srv, b'{"PROMPT": "a", "MAX_TOKENS": 1, "k": 1, "k": 2, "j": true, "j": {}}')
    assert status == 200, body
    assert json.loads(json.loads(body)["PARAMS"]) == {"k": 1, "j": True}
    status, body = generate(srv, b'{"PROMPT": "a", "MAX_TOKENS": 1, "k": 1, "parameters": {"k": 3, "k": 4}}')
    assert status == 200, body
    assert json.loads(json.loads(body)["PARAMS"]) == {"k": 3}


def test_generate_without_id_has_none(srv):
    status, body = generate(srv, {"PROMPT": "a", "MAX_TOKENS": 1})
    assert status == 200 and "id" not in json.loads(body)


@pytest.mark.parametrize("body, text", [
    (b'{"PROMPT": "a", "MAX_TOKENS": 1, "PROMPT": "b"}', f"{UNKNOWN}input 'PROMPT' already exists in request"),
    (b'{"id": "x1", "MAX_TOKENS": 1, "parameters": {"MAX_TOKENS": 2}}',
     "Converting keyword: 'parameters': [request id: x1] input 'MAX_TOKENS' already exists in request"),
    (b'{}', f"{UNKNOWN}expected number of inputs between 2 and 3 but got 0 inputs for model 'gen'. Got input(s) "
            f"[], but missing required input(s) ['PROMPT','MAX_TOKENS']. Please provide all required input(s)."),
    (b'{"PROMPT": 1, "MAX_TOKENS": 1}', "Unable to parse JSON bytes array: attempt to access JSON non-string as "
                                        "string"),
    (b'{"PROMPT": "a", "MAX_TOKENS": "1"}', "Unable to parse 'data': attempt to access JSON non-signed-integer as "
                                            "signed-integer"),
    (b'{"PROMPT": "a", "MAX_TOKENS": 1, "PARAMS": {"k": 1}}',
     "parameter 'PARAMS' has invalid type. It should be either 'int', 'bool', or 'string'."),
    (b'{"PROMPT": "a", "MAX_TOKENS": 1, "parameters": {"PARAMS": [1]}}',
     "Converting keyword: 'parameters': parameter 'PARAMS' has invalid type. It should be either 'int', 'bool', "
     "or 'string'."),
    (b'{"PROMPT": "a", "MAX_TOKENS": [1, 2]}', "The schema can not convert input 'MAX_TOKENS' to tensor with proper "
                                               "shape"),
    (b'{"id": 3, "PROMPT": 1}', "Unable to parse 'id': attempt to access JSON non-string as string"),
    # Triton's order: members as they come, so the first bad one is named.
    (b'{"PARAMS": {}, "PROMPT": 1}', "parameter 'PARAMS' has invalid type. It should be either 'int', 'bool', or "
                                     "'string'."),
    (b'{"PROMPT": 1, "PARAMS": {}}', "Unable to parse JSON bytes array: attempt to access JSON non-string as string"),
    (b'{"parameters": 3}', "Expected JSON object for keyword: 'parameters': attempt to access JSON non-object as "
                           "object"),
    (b'[1]', "attempt to get members for non-object (the generate request must be a JSON object)"),
], ids=["duplicate-input", "duplicate-in-parameters", "missing-inputs", "number-for-bytes", "string-for-int",
        "object-parameter", "nested-array-parameter", "shape", "id-not-string", "order-parameter-first",
        "order-input-first", "parameters-not-object", "body-not-object"])
def test_generate_refusals_are_tritons(srv, body, text):
    for stream in (False, True):
        assert error_of(*generate(srv, body, stream)) == text


def test_generate_refuses_a_compressed_body(srv):
    r = raw_request(srv.port, "POST", "/v2/models/gen/generate", b"\x1f\x8b", {"Content-Encoding": "gzip"})
    assert error_of(r.status, r.body) == "Unsupported content-encoding, only 'identity' is supported."


def test_generate_to_an_unknown_model_is_404_whatever_the_body(srv):
    r = raw_request(srv.port, "POST", "/v2/models/nope/generate", b"not json")
    assert r.status == 404, r


# -- JSON bodies as Triton reads and writes them ---------------------------------------------------

def infer_json(server, doc: dict, headers: dict | None = None):
    return raw_request(server.port, "POST", "/v2/models/raw_vec/infer", json.dumps(doc).encode(),
                       {"Content-Type": "application/json", **(headers or {})})


def vec(data: list, **extra) -> dict:
    return {"name": "INPUT", "datatype": "FP32", "shape": [1, len(data)], "data": data, **extra}


def test_nan_and_infinities_travel_as_json_both_ways(srv):
    """tritonclient writes NaN and infinities in a JSON body as json.dumps does (NaN, Infinity,
    -Infinity); Triton reads them and writes them back the same way, and so does the server."""
    client = httpclient.InferenceServerClient(srv.url)
    try:
        x = np.array([[np.nan, np.inf, -np.inf, 1.5]], np.float32)
        inp = httpclient.InferInput("INPUT", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=False)
        result = client.infer("raw_vec", [inp], outputs=[httpclient.InferRequestedOutput("DOUBLED", binary_data=False)])
        np.testing.assert_array_equal(result.as_numpy("DOUBLED"), x * 2)
    finally:
        client.close()
    r = infer_json(srv, {"inputs": [vec([float("nan"), float("-inf")])], "outputs": [{"name": "DOUBLED"}]})
    assert r.status == 200 and b'"data":[NaN,-Infinity]' in r.body, r
    r = infer_json(srv, {"inputs": [vec([1.0, 2.0])], "outputs": [{"name": "DOUBLED"}]})
    assert r.status == 200 and b'"data":[2.0,4.0]' in r.body, r  # finite values: the usual writer
    r = raw_request(srv.port, "POST", "/v2/models/raw_vec/infer", b'{"inputs": [NaNx]}')
    assert error_of(r.status, r.body).startswith("failed to parse the request JSON buffer: ")
    # generate and generate_stream write them as Triton does too (1e39 is an FP32 infinity).
    for endpoint in ("generate", "generate_stream"):
        r = raw_request(srv.port, "POST", f"/v2/models/raw_vec/{endpoint}", b'{"INPUT": [1e39, -1e39]}')
        assert r.status == 200 and b'"DOUBLED":[Infinity,-Infinity]' in r.body, (endpoint, r)


@pytest.mark.parametrize("body, text", [
    (b'{"id":"NaN","inputs":[{"name":"INPUT","datatype":"FP32","shape":[1,1],"data":[1e400]}]}',
     "failed to parse the request JSON buffer: number is infinity when parsed as double"),
    (b'\xef\xbb\xbf{"inputs":[{"name":"INPUT","datatype":"FP32","shape":[1,1],"data":[NaN]}]}',
     "failed to parse the request JSON buffer: UTF-8 byte order mark (BOM) is not supported"),
    (b'{"parameters":{"p":NaN},"inputs":[{"name":"INPUT","datatype":"FP32","shape":[1,1],"data":[1]}]}',
     "parameter 'p' must be a finite number, got nan"),
], ids=["too-large-beside-a-nan-string", "bom", "nan-parameter"])
def test_nan_is_taken_only_where_it_stands_for_a_number(srv, body, text):
    """The NaN reading takes NaN and the infinities as numbers and nothing else orjson refuses; a
    request parameter must still be finite (the model's parameters travel as JSON without NaN)."""
    r = raw_request(srv.port, "POST", "/v2/models/raw_vec/infer", body)
    assert error_of(r.status, r.body).startswith(text)


def test_an_empty_batch_is_refused(srv):
    """Rows of no elements pass the byte-size check (0 bytes expected, 0 given): refused all the same."""
    r = infer_json(srv, {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [0, 0], "data": []}]})
    assert error_of(r.status, r.body) == f"{UNKNOWN}inference request batch-size must be >= 1 for 'raw_vec', got a batch of 0"


def test_a_named_output_is_json_unless_it_asks_for_binary(srv):
    """``binary_data_output`` is the default of the outputs the request does not name; a named
    output without its own ``binary_data`` comes as JSON (Triton's rule; tritonclient always
    gives ``binary_data``)."""
    named = infer_json(srv, {"inputs": [vec([1.0])], "parameters": {"binary_data_output": True},
                             "outputs": [{"name": "DOUBLED"}, {"name": "SHAPE", "parameters": {"binary_data": True}}]})
    n = int(named.headers["inference-header-content-length"])
    outputs = {o["name"]: o for o in json.loads(named.body[:n])["outputs"]}
    assert outputs["DOUBLED"]["data"] == [2.0] and outputs["SHAPE"]["parameters"] == {"binary_data_size": 16}
    unnamed = infer_json(srv, {"inputs": [vec([1.0])], "parameters": {"binary_data_output": True}})
    assert set(binary_outputs(unnamed.headers, unnamed.body)) == {"DOUBLED", "SHAPE"}


FIELDS = ("Input must set only one of the following fields: 'data', 'binary_data_size' in 'parameters', "
          "'shared_memory_region' in 'parameters'. But ")


@pytest.mark.parametrize("parameters, data, text", [
    ({"binary_data_size": 4}, True, "set 'data' 'binary_data_size'"),
    ({"shared_memory_region": "r", "shared_memory_byte_size": 4}, True, "set 'data' 'shared_memory_region'"),
    ({}, False, "no field is set"),
], ids=["data-and-binary", "data-and-region", "none"])
def test_an_input_gives_its_content_one_way(srv, parameters, data, text):
    doc_input = vec([1.0], parameters=parameters)
    if not data:
        del doc_input["data"]
    body = json.dumps({"inputs": [doc_input]}).encode()
    headers = {"Inference-Header-Content-Length": str(len(body))}
    r = raw_request(srv.port, "POST", "/v2/models/raw_vec/infer", body + b"\0" * 4, headers)
    assert error_of(r.status, r.body) == FIELDS + text


def _doc(**changes) -> dict:
    """A good raw_vec request with ``changes`` to its input (None: the key left out)."""
    tensor = {"name": "INPUT", "datatype": "FP32", "shape": [1, 3], "data": [1.0, 2.0, 3.0]}
    for key, value in changes.items():
        if value is None:
            del tensor[key]
        else:
            tensor[key] = value
    return {"inputs": [tensor]}


def _unable(key: str, words: str) -> str:
    return f"Unable to parse '{key}': attempt to access {words}"


GOOD = _doc()
# Each text is Triton 2.51's for the same body (there a 500, here a 400: docs/compatibility.md).
JSON_REFUSALS = [
    ([1, 2], _unable("inputs", "non-existing object member 'inputs'")),
    ({}, _unable("inputs", "non-existing object member 'inputs'")),
    ({"inputs": {"name": "INPUT"}}, _unable("inputs", "JSON non-array as array")),
    (_doc(name=None), _unable("name", "non-existing object member 'name'")),
    (_doc(name=5), _unable("name", "JSON non-string as string")),
    (_doc(datatype=None), _unable("datatype", "non-existing object member 'datatype'")),
    (_doc(datatype=[]), _unable("datatype", "JSON non-string as string")),
    (_doc(shape=None), _unable("shape", "non-existing object member 'shape'")),
    (_doc(shape="3"), _unable("shape", "JSON non-array as array")),
    (_doc(shape=[1, 3.0]), _unable("shape", "JSON non-unsigned-integer as unsigned-integer")),
    (_doc(shape=[1, "3"]), _unable("shape", "JSON non-unsigned-integer as unsigned-integer")),
    (_doc(data=1.0), _unable("data", "JSON non-array as array")),
    (_doc(data=[1.0, "2", 3.0]), _unable("data", "JSON non-number as double")),
    (_doc(data=[1.0, True, 3.0]), _unable("data", "JSON non-number as double")),  # not read as 1.0
    (_doc(datatype="FP64", data=[False, 2.0, 3.0]), _unable("data", "JSON non-number as double")),
    (_doc(datatype="INT32", data=[1, 2.5, 3]), _unable("data", "JSON non-signed-integer as signed-integer")),
    (_doc(datatype="INT64", data=[1, 2, 1 << 63]), _unable("data", "JSON non-signed-integer as signed-integer")),
    (_doc(datatype="UINT8", data=[1, -2, 3]), _unable("data", "JSON non-unsigned-integer as unsigned-integer")),
    (_doc(datatype="BOOL", data=[True, 1, False]), _unable("data", "JSON non-boolean as boolean")),
    (_doc(data=[1.0, 2.0]), "Unable to parse 'data': Shape does not match true shape of 'data' field"),
    (_doc(data=[1.0, 2.0, 3.0, 4.0]), "Unable to parse 'data': Shape does not match true shape of 'data' field"),
    (_doc(data=[1.0, "x"]), _unable("data", "JSON non-number as double")),  # a wrong value before the count
    (_doc(datatype="BYTES", data=["a", 2, "c"]), "Unable to parse JSON bytes array: attempt to access JSON "
                                                 "non-string as string"),
    ({**GOOD, "id": 5}, _unable("id", "JSON non-string as string")),
    ({"id": 5}, _unable("id", "JSON non-string as string")),  # the id is read first
    ({**GOOD, "parameters": [1]}, "failed to get request params.: attempt to get members for non-object"),
    ({**GOOD, "parameters": {"priority": -1}}, _unable("priority", "JSON non-unsigned-integer as unsigned-integer")),
    ({"inputs": 5, "parameters": {"priority": "x"}},  # the parameters before the inputs
     _unable("priority", "JSON non-unsigned-integer as unsigned-integer")),
    ({**GOOD, "parameters": {"timeout": "x"}}, _unable("timeout", "JSON non-unsigned-integer as unsigned-integer")),
    ({**GOOD, "parameters": {"sequence_id": 1.5}}, _unable("sequence_id", "JSON non-string as string")),
    ({**GOOD, "parameters": {"sequence_start": 1}}, _unable("sequence_start", "JSON non-boolean as boolean")),
    ({**GOOD, "parameters": {"binary_data_output": "yes"}},
     _unable("binary_data_output", "JSON non-boolean as boolean")),
    ({**GOOD, "parameters": {"foo": {"a": 1}, "priority": -1}},  # in the request's order
     "parameter 'foo' has invalid type. It should be either 'int', 'bool', or 'string'."),
    ({**GOOD, "outputs": {"name": "DOUBLED"}}, _unable("outputs", "JSON non-array as array")),
    ({**GOOD, "outputs": [{}]}, _unable("name", "non-existing object member 'name'")),
    ({**GOOD, "outputs": [{"name": 5}]}, _unable("name", "JSON non-string as string")),
    ({**GOOD, "outputs": [{"name": "DOUBLED", "parameters": {"binary_data": 1}}]},
     _unable("binary_data", "JSON non-boolean as boolean")),
    ({**GOOD, "outputs": [{"name": "DOUBLED", "parameters": {"classification": "3", "binary_data": 1}}]},
     "Unable to set 'classification': attempt to access JSON non-unsigned-integer as unsigned-integer"),
    ({"inputs": [5]}, FIELDS + "no field is set"),  # which content fields come first
    (_doc(name=None, data=None), FIELDS + "no field is set"),
    (_doc(data=None, parameters={"binary_data_size": -1}),
     _unable("binary_data_size", "JSON non-unsigned-integer as unsigned-integer")),
    (_doc(data=None, parameters={"shared_memory_region": "r", "shared_memory_offset": -1,
                                 "shared_memory_byte_size": 12}),
     _unable("shared_memory_offset", "JSON non-unsigned-integer as unsigned-integer")),
    (_doc(data=None, parameters={"shared_memory_region": 5, "shared_memory_byte_size": 12}),
     _unable("shared_memory_region", "JSON non-string as string")),
    # a parameter given null is there, of the wrong type (TritonJson's Find, then AsUInt)
    (_doc(data=None, parameters={"binary_data_size": None}),
     _unable("binary_data_size", "JSON non-unsigned-integer as unsigned-integer")),
    (_doc(data=None, parameters={"shared_memory_region": "r", "shared_memory_offset": None,
                                 "shared_memory_byte_size": 12}),
     _unable("shared_memory_offset", "JSON non-unsigned-integer as unsigned-integer")),
    (_doc(data=None, parameters={"shared_memory_region": "r", "shared_memory_byte_size": None}),
     _unable("shared_memory_byte_size", "JSON non-unsigned-integer as unsigned-integer")),
    # a region's offset and size are read whenever present, also beside 'data'
    (_doc(parameters={"shared_memory_offset": -1}),
     _unable("shared_memory_offset", "JSON non-unsigned-integer as unsigned-integer")),
    ({**GOOD, "outputs": [{"name": "DOUBLED", "parameters": {"classification": None}}]},
     "Unable to set 'classification': attempt to access JSON non-unsigned-integer as unsigned-integer"),
    ({**GOOD, "outputs": [{"name": "DOUBLED", "parameters": {"shared_memory_byte_size": None}}]},
     _unable("shared_memory_byte_size", "JSON non-unsigned-integer as unsigned-integer")),
    ({**GOOD, "outputs": [{"name": "DOUBLED", "parameters": {"binary_data": 1, "shared_memory_offset": -1}}]},
     _unable("shared_memory_offset", "JSON non-unsigned-integer as unsigned-integer")),
    # a region with classification or binary_data is looked at first, even before the name
    ({**GOOD, "outputs": [{"name": "DOUBLED", "parameters": {"shared_memory_region": "r",
                                                             "shared_memory_byte_size": 12, "classification": -1}}]},
     "Output can't set both 'shared_memory_region' and 'classification'"),
    ({**GOOD, "outputs": [{"name": "DOUBLED", "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 12,
                                                             "binary_data": 1, "classification": 1}}]},
     "Output can't set both 'shared_memory_region' and 'classification'"),
    ({**GOOD, "outputs": [{"parameters": {"shared_memory_region": "r", "classification": None}}]},
     "Output can't set both 'shared_memory_region' and 'classification'"),
    ({**GOOD, "outputs": [{"name": "DOUBLED", "parameters": {"shared_memory_region": "r",
                                                             "shared_memory_byte_size": 12, "binary_data": None}}]},
     "Unable to set 'binary_data': attempt to access JSON non-boolean as boolean"),
]


@pytest.mark.parametrize("doc, text", JSON_REFUSALS, ids=range(len(JSON_REFUSALS)))
def test_json_of_the_wrong_type_is_refused_in_tritons_words(srv, doc, text):
    r = raw_request(srv.port, "POST", "/v2/models/raw_vec/infer", json.dumps(doc).encode())
    assert error_of(r.status, r.body) == text


@pytest.mark.parametrize("data, request_id, text", [
    (["a"], None, f"{UNKNOWN}expected 2 string elements for inference input 'INPUT' for model 'raw_text_var', got 1"),
    ([], "b-1", "[request id: b-1] expected 2 string elements for inference input 'INPUT' for model 'raw_text_var', "
                "got 0"),
    (["a", "b", "c"], None, f"{UNKNOWN}unexpected number of string elements 3 for inference input 'INPUT' for "
                            f"model 'raw_text_var', expecting 2"),
], ids=["fewer", "none", "more"])
def test_bytes_counts_are_tritons_core_refusals(srv, data, request_id, text):
    doc = {"inputs": [{"name": "INPUT", "datatype": "BYTES", "shape": [2], "data": data}]}
    if request_id:
        doc["id"] = request_id
    r = raw_request(srv.port, "POST", "/v2/models/raw_text_var/infer", json.dumps(doc).encode())
    assert error_of(r.status, r.body) == text


@pytest.mark.parametrize("shape, tail, text", [
    ([3], b"\x01\x00\x00\x00a\x01\x00", f"{UNKNOWN}incomplete string length indicator for inference input "
                                         f"'INPUT' for model 'raw_text_var', expecting 4 bytes but only 2 bytes "
                                         f"available. Please make sure the string length indicator is in one "
                                         f"buffer."),
    ([3], b"\x01\x00\x00\x00a\x09\x00\x00\x00ab", f"{UNKNOWN}expected 3 string elements for inference input "
                                                    f"'INPUT' for model 'raw_text_var', got 2"),
    # found where the model's process reads the tensor (enough bytes for the frontend's check)
    ([1], b"\x01\x00\x00\x00a\x01\x00\x00\x00b", f"{UNKNOWN}unexpected number of string elements 2 for "
                                                   f"inference input 'INPUT' for model 'raw_text_var', expecting 1"),
    ([1], b"\x09\x00\x00\x00ab", "incomplete string data for inference input 'INPUT', expecting string of length 9 "
                                  "but only 2 bytes available"),
    # a stray byte after the last element: the core looks at the length before the count
    ([1], b"\x01\x00\x00\x00a\x00", f"{UNKNOWN}incomplete string length indicator for inference input 'INPUT' for "
                                     f"model 'raw_text_var', expecting 4 bytes but only 1 bytes available. Please make "
                                     f"sure the string length indicator is in one buffer."),
], ids=["cut-off-length", "fewer", "more", "cut-off-element", "stray-byte"])
def test_binary_bytes_framing_is_refused_in_tritons_words(srv, shape, tail, text):
    head = json.dumps({"inputs": [{"name": "INPUT", "datatype": "BYTES", "shape": shape,
                                   "parameters": {"binary_data_size": len(tail)}}]}).encode()
    r = raw_request(srv.port, "POST", "/v2/models/raw_text_var/infer", head + tail,
                    {"Inference-Header-Content-Length": str(len(head))})
    assert error_of(r.status, r.body) == text


def test_too_many_inputs_are_counted_first(srv):
    """Triton counts the inputs before it looks at their names: one more than the model has is
    refused with the count, its list of missing inputs reading "]" as Triton's does."""
    r = infer_json(srv, {"inputs": [vec([1.0]), vec([1.0], name="EXTRA")]})
    assert error_of(r.status, r.body) == (
        f"{UNKNOWN}expected 1 inputs but got 2 inputs for model 'raw_vec'. Got input(s) ['EXTRA','INPUT'], "
        "but missing required input(s) ]. Please provide all required input(s).")


def test_a_request_parameter_past_int64_reaches_the_model_as_a_double(srv):
    """Triton's HTTP frontend takes a JSON integer that int64 cannot hold as a double: the model
    reads 2**63 as 9.223372036854776e18 (a float), as it does on generate."""
    doc = {"inputs": [{"name": "PROMPT", "datatype": "BYTES", "shape": [1], "data": ["a"]},
                      {"name": "MAX_TOKENS", "datatype": "INT32", "shape": [1], "data": [1]}],
           "parameters": {"big": 1 << 63, "top": (1 << 64) - 1, "low": -(1 << 63) - 1, "fits": (1 << 63) - 1},
           "outputs": [{"name": "PARAMS"}]}
    r = raw_request(srv.port, "POST", "/v2/models/gen/infer", json.dumps(doc).encode())
    assert r.status == 200, r
    params = json.loads(json.loads(r.body)["outputs"][0]["data"][0])
    assert params == {"big": float(1 << 63), "top": float(1 << 64), "low": float(-(1 << 63)), "fits": (1 << 63) - 1}
    assert [type(params[k]) for k in ("big", "top", "low", "fits")] == [float, float, float, int]


def test_an_empty_request_id_is_left_out_of_the_answer(srv):
    r = infer_json(srv, {"id": "", "inputs": [vec([1.0])]})
    assert r.status == 200 and "id" not in json.loads(r.body), r
    r = infer_json(srv, {"id": "q-1", "inputs": [vec([1.0])]})
    assert r.status == 200 and json.loads(r.body)["id"] == "q-1", r


@pytest.mark.parametrize("path, method", [
    ("/v2/models/raw_vec/versions/-1/infer", "POST"), ("/v2/models/raw_vec/versions/abc", "GET"),
    ("/v2/models/raw_vec/versions/%201/ready", "GET"), ("/v2/models/raw_vec/versions/1x/config", "GET"),
    ("/v2/health/ready/", "GET"), ("/v2/models/raw_vec/", "GET"), ("/v2/models/raw_vec/infer/", "POST"),
    ("/v2/models//infer", "POST"), ("/v2/models//versions/1/infer", "POST"),
], ids=["negative", "letters", "blank", "suffix", "slash-health", "slash-model", "slash-infer", "no-model",
        "no-model-version"])
def test_paths_triton_has_no_route_for(srv, path, method):
    """A version that is not digits, or a trailing slash: Triton's plain 404, no redirect."""
    body = json.dumps({"inputs": [vec([1.0])]}).encode() if method == "POST" else None
    r = raw_request(srv.port, method, path, body)
    assert error_of(r.status, r.body, expected=404) == "Not Found"
    assert "location" not in r.headers


@pytest.mark.parametrize("accept, used", [
    ("gzip;q=0", None), ("deflate, gzip", "deflate"), ("gzip;q=0.5, deflate;q=0.8", "deflate"),
    ("gzip, identity;q=0.5", "gzip"), ("br", None), ("identity", None),
    # as Triton's CompressionTypeUsed reads an entry: the weight a number the text starts with,
    # an entry with none skipped, the name up to ';q=' with nothing stripped from its end
    ("gzip;q=0.5;level=9, deflate;q=0.4", "gzip"), ("gzip;q=, deflate;q=0.1", "deflate"),
    ("gzip , deflate", "deflate"), ("gzip;q=0x1p-1, deflate;q=0.4", "gzip"),
    # a weight past a double's range: stod throws, the entry is skipped (it was a 500)
    ("gzip;q=0x1p99999, deflate;q=0.1", "deflate"), ("gzip;q=1e999, deflate;q=0.1", "deflate"),
])
def test_the_answer_is_compressed_as_triton_chooses(srv, accept, used):
    r = infer_json(srv, {"inputs": [vec([1.0])]}, {"Accept-Encoding": accept})
    assert r.status == 200 and r.headers.get("content-encoding") == used, (accept, r.headers)
    body = {"gzip": gzip.decompress, "deflate": zlib.decompress, None: bytes}[used](r.body)
    assert json.loads(body)["outputs"][0]["data"] == [2.0]


def test_server_still_serves_after_all(srv):
    assert_still_serving_here(srv)
    status, body = generate(srv, {"PROMPT": "z", "MAX_TOKENS": 3})
    assert status == 200 and json.loads(body)["TEXT"] == "zzz"

