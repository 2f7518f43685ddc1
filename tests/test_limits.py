"""Limits on what a client may send, and the hostile inputs that once crashed or 500ed the server.

Each limit is refused with a 400 and a message naming it, before the server allocates for the
request; each former bug has its regression test here.
"""
from __future__ import annotations

import base64
import gzip
import json
import os
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest

from conftest import PRODUCT_MODELS, SHM_MODELS, TEST_MODELS, cmdline, descendants, raw_request
from test_errors import assert_still_serving

MAX_INPUT = 4 << 20
MAX_ELEMENTS = 1 << 20


@pytest.fixture(scope="module")
def lim(module_factory):
    return module_factory.start(
        [PRODUCT_MODELS, TEST_MODELS, SHM_MODELS],
        ["--model-control-mode", "explicit", "--load-model", "add_sub", "--load-model", "identity_all",
         "--load-model", "bytes_identity", "--load-model", "running_sum",
         "--http-max-input-size", str(MAX_INPUT), "--http-max-tensor-elements", str(MAX_ELEMENTS),
         "--frontend-arena-mb", "1", "--allow-model-file-uploads"])


def post(server, path: str, body, headers: dict | None = None):
    if not isinstance(body, (bytes, bytearray)):
        body = json.dumps(body).encode()
    return raw_request(server.port, "POST", path, body, headers)


def error(resp, status: int = 400) -> str:
    assert resp.status == status, resp
    assert resp.headers["content-type"].startswith("application/json"), resp
    return resp.json()["error"]


def binary(name: str, datatype: str, shape: list, data: bytes, **params) -> tuple[bytes, dict]:
    head = json.dumps({"inputs": [{"name": name, "datatype": datatype, "shape": shape,
                                   "parameters": {"binary_data_size": len(data), **params}}]}).encode()
    return head + data, {"Inference-Header-Content-Length": str(len(head))}


def ident(datatype: str, shape: list, data) -> dict:
    return {"inputs": [{"name": f"IN_{datatype}", "datatype": datatype, "shape": shape, "data": data}]}


# -- --http-max-input-size ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v2/models/add_sub/infer", "/v2/repository/index", "/v2/models/add_sub/generate",
                                  "/v2/systemsharedmemory/region/x/register", "/v2/logging"])
def test_body_over_the_limit_is_refused_on_every_endpoint(lim, path):
    msg = error(post(lim, path, b"{" + b" " * MAX_INPUT + b"}"))
    assert "--http-max-input-size" in msg and str(MAX_INPUT) in msg
    assert_still_serving(lim)


def test_declared_length_is_refused_before_the_body_is_read(lim):
    """Content-Length alone decides: the server answers without waiting for the bytes."""
    import socket

    with socket.create_connection(("127.0.0.1", lim.port), timeout=30) as s:  # (a wait for the body: no answer)
        s.sendall(b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n{"
                  % (1 << 40))
        answer = b""
        while b"}" not in answer:
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400"), answer
    assert b"--http-max-input-size" in answer
    assert_still_serving(lim)


@pytest.mark.parametrize("value, words", [("-1", "inference header size should be in range (0, 2), got: -1"),
                                          ("12", "inference header size should be in range (0, 2), got: 12"),
                                          ("x", "Unable to parse Inference-Header-Content-Length, got: x")])
def test_inference_header_length_that_cannot_be_is_a_clear_400(lim, value, words):
    """An Inference-Header-Content-Length outside the body is refused in Triton's words."""
    assert error(post(lim, "/v2/models/add_sub/infer", b"{}", {"Inference-Header-Content-Length": value})) == words


def test_limit_applies_after_decompression(lim):
    bomb = gzip.compress(b" " * (MAX_INPUT + 1))
    assert len(bomb) < MAX_INPUT
    msg = error(post(lim, "/v2/models/add_sub/infer", bomb, {"Content-Encoding": "gzip"}))
    assert "decompressed" in msg and "limit" in msg


def test_tensor_bytes_beyond_the_frontend_arena_are_a_client_error(lim):
    """2 MiB of tensor data can never fit a 1 MiB arena: 400 naming the flag, not a 503 retry."""
    n = (2 << 20) // 8
    body, headers = binary("IN_FP64", "FP64", [1, n], np.zeros(n).tobytes())
    msg = error(post(lim, "/v2/models/identity_all/infer", body, headers))
    assert "--frontend-arena-mb" in msg
    assert_still_serving(lim)


# -- --http-max-tensor-elements and shapes ---------------------------------------------------------------


@pytest.mark.parametrize("shape", [[1, MAX_ELEMENTS + 1], [2 ** 31, 2 ** 31], [0, 2 ** 63 - 1], [2 ** 62, 4],
                                   [1] * 65])
def test_shapes_past_the_element_limit_are_refused_before_allocating(lim, shape):
    body, headers = binary("IN_FP32", "FP32", shape, b"")
    msg = error(post(lim, "/v2/models/identity_all/infer", body, headers))
    # past int64 in elements or bytes: Triton's words; else the element limit names its flag
    assert "--http-max-tensor-elements" in msg or "dimensions" in msg or \
        msg.startswith(("byte size overflow for input 'IN_FP32'", "invalid shape for input 'IN_FP32'"))


def test_bytes_shape_larger_than_its_data_can_hold(lim):
    """Every BYTES element needs a 4-byte length: 1000 elements cannot be in 8 bytes (Triton's words)."""
    body, headers = binary("IN_BYTES", "BYTES", [1, 1000], struct.pack("<I", 4) + b"abcd")
    msg = error(post(lim, "/v2/models/identity_all/infer", body, headers))
    assert msg == ("[request id: <id_unknown>] expected 1000 string elements for inference input 'IN_BYTES' for "
                   "model 'identity_all', got 1")


@pytest.mark.parametrize("data", [struct.pack("<I", 100) + b"abc",          # prefix past the end
                                  struct.pack("<I", 2 ** 32 - 1) + b"abcd",   # huge prefix
                                  struct.pack("<I", 1) + b"a" + b"\x01\x00",  # a cut-off second prefix
                                  struct.pack("<I", 0) * 2 + b"zz"])          # bytes no element claims
def test_bytes_with_lying_length_prefixes(lim, data):
    body, headers = binary("IN", "BYTES", [2] if len(data) >= 8 else [1], data)
    msg = error(post(lim, "/v2/models/bytes_identity/infer", body, headers))
    assert "string" in msg and "for inference input 'IN'" in msg, msg  # Triton's core's words, named
    assert_still_serving(lim)


# -- JSON ------------------------------------------------------------------------------------------------


def test_json_nested_deeper_than_orjson_allows(lim):
    msg = error(post(lim, "/v2/models/add_sub/infer", b"[" * 1025 + b"]" * 1025))
    assert "nested deeper than 1024 levels" in msg
    msg = error(post(lim, "/v2/models/identity_all/generate", b'{"a":' * 1100 + b"1" + b"}" * 1100))
    assert "nested deeper than 1024 levels" in msg


# -- former 500s and crashes (regressions) --------------------------------------------------------------


@pytest.mark.parametrize("doc, words", [
    ({"inputs": [{"name": "IN_INT32", "datatype": [], "shape": [1, 1], "data": [1]}]},
     "Unable to parse 'datatype': attempt to access JSON non-string as string"),
    ({**ident("INT32", [1, 1], [1]), "outputs": [{"name": "OUT_INT32", "parameters": [1]}]}, "'parameters'"),
    ({**ident("INT32", [1, 1], [1]), "outputs": [{"name": "OUT_INT32", "parameters": {"binary_data": "x"}}]},
     "binary_data"),
    ({**ident("INT32", [1, 1], [1]), "outputs": [{"name": "OUT_INT32", "parameters": {
        "shared_memory_region": {"a": 1}, "shared_memory_byte_size": 4}}]}, "shared_memory_region"),
    ({"inputs": [{"name": "IN_INT32", "datatype": "INT32", "shape": [1, 1], "parameters": {
        "shared_memory_region": ["x"], "shared_memory_byte_size": 4}}]}, "shared_memory_region"),
    (ident("BYTES", [1, 1], [{"a": 1}]), "Unable to parse JSON bytes array: attempt to access JSON non-string as string"),
    (ident("BYTES", [1, 1], [None]), "Unable to parse JSON bytes array: attempt to access JSON non-string as string"),
    ({**ident("INT32", [1, 1], [1]), "id": {"x": 1}}, "Unable to parse 'id': attempt to access JSON non-string as string"),
    ({**ident("INT32", [1, 1], [1]), "parameters": {"binary_data_output": "yes"}}, "binary_data_output"),
])
def test_malformed_fields_are_400(lim, doc, words):
    assert words in error(post(lim, "/v2/models/identity_all/infer", doc))


@pytest.mark.parametrize("params, words", [({"sequence_id": -1, "sequence_start": True}, "Unable to parse 'sequence_id'"),
                                           ({"sequence_id": 7, "sequence_start": "yes"}, "sequence_start")])
def test_sequence_parameters_are_checked(lim, params, words):
    """A negative id once reached the model and came back as a 500."""
    doc = {"inputs": [{"name": "VALUE", "datatype": "FP32", "shape": [1, 1], "data": [1.0]}], "parameters": params}
    assert words in error(post(lim, "/v2/models/running_sum/infer", doc))


@pytest.mark.parametrize("body, words", [(b"[1]", "JSON object"), (b"1", "JSON object"), (b"true", "JSON object"),
                                         (b'{"ready": [1]}', "attempt to access JSON non-boolean as boolean")])
def test_repository_index_with_a_body_that_is_not_an_object(lim, body, words):
    assert words in error(post(lim, "/v2/repository/index", body))


@pytest.mark.parametrize("body", [{"IN_INT32": 1, "parameters": [1]}, {"IN_INT32": 1e300},
                                  {"IN_INT32": {"a": 1}}, {"IN_INT32": [[1], [2, 3]]}, {"IN_INT32": 1, "id": 5}])
def test_generate_bodies(lim, body):
    for path in ("/v2/models/identity_all/generate", "/v2/models/identity_all/generate_stream"):
        error(post(lim, path, body))


def test_cuda_register_with_a_handle_that_is_not_an_object(lim):
    error(post(lim, "/v2/cudasharedmemory/region/c/register", {"raw_handle": [1], "device_id": 0, "byte_size": 4}))


def test_unknown_paths_and_methods_answer_json(lim):
    resp = raw_request(lim.port, "GET", "/v2/models/add_sub/infer")
    assert "not allowed" in error(resp, 405).lower() and "POST" in resp.headers["allow"]
    error(raw_request(lim.port, "GET", "/v2/no/such/thing"), 404)


# -- the load API's 'file:' override stays in its private folder ---------------------------------------------


def _load(server, name: str, files: dict[str, bytes]):
    params = {"config": json.dumps({"backend": "python"})}
    params.update({f"file:{k}": base64.b64encode(v).decode() for k, v in files.items()})
    return post(server, f"/v2/repository/models/{name}/load", {"parameters": params})


def _temp_dirs() -> set[str]:
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("shmserve-model-")}


@pytest.mark.parametrize("name, files", [
    ("..", {"fz_escape_marker.txt": b"x"}),                 # the model name climbs out of the temp dir
    (".", {"fz_escape_marker.txt": b"x"}),
    ("fz_escape", {"../fz_escape_marker.txt": b"x"}),       # a file name climbs out
    ("fz_escape", {"1/../../../fz_escape_marker.txt": b"x"}),
    ("fz_escape", {"/tmp/fz_escape_marker.txt": b"x"}),     # an absolute path
])
def test_load_files_cannot_escape_their_folder(lim, name, files):
    before = _temp_dirs()
    marker = Path(tempfile.gettempdir()) / "fz_escape_marker.txt"
    marker.unlink(missing_ok=True)
    resp = raw_request(lim.port, "POST", f"/v2/repository/models/{name}/load", json.dumps({"parameters": {
        "config": "{}", **{f"file:{k}": base64.b64encode(v).decode() for k, v in files.items()}}}).encode())
    assert resp.status == 400, resp
    assert not marker.exists(), "a load wrote outside its private folder"
    assert _temp_dirs() == before, "a refused load left its folder behind"


@pytest.mark.parametrize("files,status", [({"x" * 300: b"x"}, 500), ({"a": b"x", "a/b": b"x"}, 400)])
def test_load_files_the_filesystem_refuses_are_refused_not_a_broker_crash(lim, files, status):
    """An OSError while writing a load's files is answered and the broker stays up: a name longer
    than NAME_MAX with Triton's 500 ('failed to poll from model repository'), a file where a
    folder must go with 400."""
    broker = [pid for pid, t in lim.titles().items() if t.startswith("shmserve broker")]
    resp = _load(lim, "fz_oserror", files)
    assert "cannot write" in error(resp, status)
    assert [pid for pid, t in lim.titles().items() if t.startswith("shmserve broker")] == broker
    assert_still_serving(lim)


def test_server_processes_keep_large_buffers_in_their_heap(server_factory):
    """The frontend and workers raise glibc's mmap and trim thresholds (shm/heap.py): a 16 MiB
    body is then served from memory already mapped, not faulted in anew per request. Checked
    from outside through the frontend's minor-fault count across repeated large requests."""
    import tritonclient.http as httpclient

    server = server_factory.start([TEST_MODELS], ["--model-control-mode", "explicit",
                                                  "--load-model", "identity_all"])
    frontend = [p for p in descendants(server.proc.pid) if "shmserve frontend" in cmdline(p)][0]
    x = np.ones((1, 4 << 20), dtype=np.float32)  # 16 MiB
    client = httpclient.InferenceServerClient(server.url, network_timeout=120)
    try:
        def call() -> None:
            inp = httpclient.InferInput("IN_FP32", list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            out = client.infer("identity_all", [inp],
                               outputs=[httpclient.InferRequestedOutput("OUT_FP32", binary_data=True)])
            assert out.as_numpy("OUT_FP32").shape == x.shape

        for _ in range(3):  # warm: the heap grows to its working size
            call()
        before = minor_faults(frontend)
        for _ in range(5):
            call()
        per_request = (minor_faults(frontend) - before) / 5
    finally:
        client.close()
    # Faulting in one 16 MiB body alone is 4096 faults; a reused heap takes far fewer.
    assert per_request < 1024, per_request


def minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def test_a_config_override_larger_than_an_argument_may_be_loads(lim):
    """A worker's spec (with the config) once travelled on its command line, where one argument
    is at most 128 KiB: a larger override failed with 500 'Argument list too long'."""
    big = "x" * (200 << 10)
    config = {"name": "add_sub", "backend": "python", "max_batch_size": 0,
              "input": [{"name": f"INPUT{i}", "data_type": "TYPE_INT32", "dims": [16]} for i in (0, 1)],
              "output": [{"name": f"OUTPUT{i}", "data_type": "TYPE_INT32", "dims": [16]} for i in (0, 1)],
              "parameters": {"padding": {"string_value": big}}}
    try:
        resp = post(lim, "/v2/repository/models/add_sub/load", {"parameters": {"config": json.dumps(config)}})
        assert resp.status == 200, resp
        served = raw_request(lim.port, "GET", "/v2/models/add_sub/config").json()
        assert served["parameters"]["padding"]["string_value"] == big
        assert_still_serving(lim)
    finally:
        assert post(lim, "/v2/repository/models/add_sub/load", {}).status == 200  # the repository's again
