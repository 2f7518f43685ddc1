"""Hostile input against a real server (hypothesis): every answer is 200 or a 4xx (503 only for
documented overload) with a JSON {"error": ...} body, within a few seconds; afterwards the server
still answers a good request correctly and none of its processes died or was restarted.

One server for the module (explicit control: add_sub, identity_all with every datatype,
bytes_identity, a priority batcher and a sequence model); example counts keep the file near two
minutes.
"""
from __future__ import annotations

import gzip
import json
import struct
import time
import zlib

import numpy as np
import posix_ipc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import PRODUCT_MODELS, SHM_MODELS, TEST_MODELS, TESTS, pid_alive, raw_request

MODELS = ["add_sub", "identity_all", "bytes_identity", "probe_prio", "running_sum"]
DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
             "FP64", "BF16", "BYTES"]
ITEMSIZE = {"BOOL": 1, "UINT8": 1, "INT8": 1, "UINT16": 2, "INT16": 2, "FP16": 2, "BF16": 2, "UINT32": 4,
            "INT32": 4, "FP32": 4, "UINT64": 8, "INT64": 8, "FP64": 8, "BYTES": 0}
# (model, input name, datatype) the fuzzer aims at; wrong ones come from the strategies.
TARGETS = [("add_sub", "INPUT0", "INT32"), ("bytes_identity", "IN", "BYTES"), ("probe_prio", "INPUT0", "FP32"),
           ("running_sum", "VALUE", "FP32")] + [("identity_all", f"IN_{d}", d) for d in DATATYPES]
REQUEST_TIME_LIMIT_S = 30.0  # no answer may hang: far past what any request takes, on a loaded host too
FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck), database=None)

A = np.arange(16, dtype=np.int32)


# -- the server and its checks ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def fz(module_factory):
    server = module_factory.start(
        [PRODUCT_MODELS, TEST_MODELS, SHM_MODELS, TESTS / "models" / "batching"],
        ["--model-control-mode", "explicit", *[a for m in MODELS for a in ("--load-model", m)],
         "--http-max-input-size", str(4 << 20)])
    server.initial_tree = sorted(server.tree())
    # A real region of our own, registered, for offsets and sizes to be fuzzed against.
    key = f"/fz_{server.id}"
    shm = posix_ipc.SharedMemory(key, posix_ipc.O_CREX, size=4096)
    shm.close_fd()
    status = call(server, "POST", "/v2/systemsharedmemory/region/fzreg/register",
                  {"key": key, "offset": 0, "byte_size": 4096})
    assert status == 200
    server.region_key = key
    yield server
    posix_ipc.unlink_shared_memory(key)


TRITON_500_TEXTS = (b"failed to poll from model repository", b"Unable to open shared memory region",
                    b"Invalid shared memory region")


def call(server, method: str, path: str, body=None, headers: dict | None = None) -> int:
    """One request; asserts the property every answer must have and returns its status."""
    if body is not None and not isinstance(body, (bytes, bytearray)):
        body = json.dumps(body).encode()
    started = time.monotonic()
    resp = raw_request(server.port, method, path, body, headers, timeout=REQUEST_TIME_LIMIT_S + 5)
    elapsed = time.monotonic() - started
    assert elapsed < REQUEST_TIME_LIMIT_S, f"{method} {path} took {elapsed:.1f} s"
    # 307: Starlette redirects a path with a trailing slash to the one without. 500: only where
    # Triton answers 500 (a load of a name no repository holds, a region key that opens nothing
    # or is registered already), with its text.
    triton_500 = resp.status == 500 and any(text in resp.body for text in TRITON_500_TEXTS)
    assert resp.status in (200, 307, 503) or 400 <= resp.status < 500 or triton_500, (method, path, body, resp)
    if resp.status == 307:
        return resp.status
    if resp.status != 200:
        assert resp.headers.get("content-type", "").startswith("application/json"), resp
        doc = resp.json()
        assert isinstance(doc, dict) and isinstance(doc.get("error"), str) and doc["error"], resp
    return resp.status


def infer(server, model: str, body, headers: dict | None = None, version: str = "") -> int:
    path = f"/v2/models/{model}/versions/{version}/infer" if version else f"/v2/models/{model}/infer"
    return call(server, "POST", path, body, headers)


def assert_healthy(server) -> None:
    """A good request is answered correctly and the process tree is the one we started with."""
    body = {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [16], "data": A.tolist()},
                       {"name": "INPUT1", "datatype": "INT32", "shape": [16], "data": (A * 2).tolist()}]}
    resp = raw_request(server.port, "POST", "/v2/models/add_sub/infer", json.dumps(body).encode())
    assert resp.status == 200, resp
    outs = {o["name"]: o["data"] for o in resp.json()["outputs"]}
    assert outs["OUTPUT0"] == (A * 3).tolist() and outs["OUTPUT1"] == (-A).tolist()
    for model in MODELS:
        assert server.http_status(f"/v2/models/{model}/ready") == 200, model
    dead = [pid for pid in server.initial_tree if not pid_alive(pid)]
    assert not dead, f"processes died: {dead}; log:\n{server.log_tail()}"
    assert sorted(server.tree()) == server.initial_tree, "a process was restarted or added"
    assert "Traceback" not in server.log(), server.log_tail()


@pytest.fixture
def healthy(fz):
    yield fz
    assert_healthy(fz)


# -- strategies -----------------------------------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1) | \
    st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
json_values = st.recursive(json_scalars, lambda kids: st.lists(kids, max_size=4) |
                           st.dictionaries(st.text(max_size=10), kids, max_size=4), max_leaves=12)
# Integers where the server expects sizes, offsets and dimensions: edges first.
edgy_ints = st.sampled_from([0, 1, -1, 2, 3, 4, 16, 63, 64, 4095, 4096, 4097, 2 ** 31 - 1, 2 ** 31, 2 ** 32,
                             2 ** 62, 2 ** 63 - 1, -(2 ** 63), 2 ** 64 - 1]) | st.integers(-10, 100) | \
    st.integers(-(2 ** 63), 2 ** 64 - 1)
not_ints = st.none() | st.booleans() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8) | \
    st.lists(st.integers(), max_size=2) | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
shapes = st.lists(edgy_ints, max_size=5) | st.lists(st.integers(0, 4), min_size=1, max_size=3)


def _bytes_payload(draw, count: int) -> bytes:
    """A BYTES tensor: well formed, or with length prefixes that lie."""
    kind = draw(st.sampled_from(["good", "long_prefix", "huge_prefix", "cut", "extra", "random"]))
    items = [draw(st.binary(max_size=8)) for _ in range(min(count, 8))]
    good = b"".join(struct.pack("<I", len(b)) + b for b in items)
    if kind == "good":
        return good
    if kind == "long_prefix":
        return good + struct.pack("<I", draw(st.integers(1, 100))) + b"x"
    if kind == "huge_prefix":
        return struct.pack("<I", draw(st.sampled_from([2 ** 32 - 1, 2 ** 31, 1 << 20]))) + b"abc"
    if kind == "cut":
        return good[:draw(st.integers(0, max(len(good) - 1, 0)))]
    if kind == "extra":
        return good + draw(st.binary(min_size=1, max_size=8))
    return draw(st.binary(max_size=64))


@st.composite
def binary_requests(draw):
    """(model, body, headers) of the binary tensor extension with every part possibly wrong."""
    model, name, datatype = draw(st.sampled_from(TARGETS))
    if draw(st.integers(0, 4)) == 0:
        datatype = draw(st.sampled_from(DATATYPES))
    shape = draw(shapes)
    count = 1
    for d in shape:
        count *= d
    if datatype == "BYTES":
        data = _bytes_payload(draw, max(min(count, 16), 0))
    else:
        right = max(min(count, 64), 0) * ITEMSIZE[datatype]
        n = draw(st.sampled_from([right, right, max(right - 1, 0), right + 1, 0]) | st.integers(0, 200))
        data = draw(st.binary(min_size=n, max_size=n))
    size = draw(st.sampled_from([len(data)] * 3) | edgy_ints | not_ints)
    head_doc = {"inputs": [{"name": name, "datatype": datatype, "shape": shape,
                            "parameters": {"binary_data_size": size}}]}
    if draw(st.booleans()):
        head_doc["outputs"] = [{"name": draw(st.sampled_from(["OUTPUT0", "OUT", "OUT_" + datatype, "x"])),
                                "parameters": {"binary_data": draw(st.booleans() | json_scalars)}}]
    head = json.dumps(head_doc).encode()
    tail = draw(st.sampled_from(["exact", "exact", "truncated", "oversized", "none"]))
    body = head + (data if tail == "exact" else data[:len(data) // 2] if tail == "truncated"
                   else data + draw(st.binary(min_size=1, max_size=32)) if tail == "oversized" else b"")
    header = draw(st.sampled_from([str(len(head))] * 3 + ["0", "-1", "", "abc", " 5", "1e3", "0x10",
                                                          str(len(body)), str(len(body) + 1), str(2 ** 64),
                                                          "9" * 5000, str(len(head) - 1)]))
    headers = {"Inference-Header-Content-Length": header, "Content-Type": "application/octet-stream"}
    return model, body, headers


def _valid_request(draw) -> tuple[str, dict]:
    model, name, datatype = draw(st.sampled_from(TARGETS))
    shape = {"add_sub": [16], "probe_prio": [1, 1], "running_sum": [1, 1]}.get(model, [1, 2])
    count = int(np.prod(shape))
    data = ["ab"] * count if datatype == "BYTES" else [True] * count if datatype == "BOOL" else [1] * count
    return model, {"inputs": [{"name": name, "datatype": datatype, "shape": shape, "data": data}]}


@st.composite
def mutated_requests(draw):
    """A valid JSON request with one field anywhere replaced by hostile JSON."""
    model, doc = _valid_request(draw)
    inp = doc["inputs"][0]
    where = draw(st.sampled_from(["root", "inputs", "input", "name", "datatype", "shape", "dim", "data", "datum",
                                  "parameters", "tparams", "outputs", "output", "id", "extra"]))
    value = draw(json_values | edgy_ints | not_ints)
    if where == "root":
        return model, value
    if where == "inputs":
        doc["inputs"] = value
    elif where == "input":
        doc["inputs"][0] = value
    elif where in ("name", "datatype", "shape", "data"):
        inp[where] = value
    elif where == "dim":
        inp["shape"] = [value, *inp["shape"][1:]]
    elif where == "datum":
        inp["data"] = [value, *inp["data"][1:]]
    elif where == "parameters":
        doc["parameters"] = value
    elif where == "tparams":
        inp["parameters"] = value
    elif where == "outputs":
        doc["outputs"] = value
    elif where == "output":
        doc["outputs"] = [value]
    elif where == "id":
        doc["id"] = value
    else:
        doc[draw(st.text(max_size=10))] = value
    return model, doc


@st.composite
def parameter_abuse(draw):
    model, doc = _valid_request(draw)
    keys = st.sampled_from(["priority", "timeout", "sequence_id", "sequence_start", "sequence_end",
                            "binary_data_output", "headers", "max_tokens", "", "x" * 300]) | st.text(max_size=12)
    doc["parameters"] = draw(st.dictionaries(keys, edgy_ints | not_ints | json_values, max_size=5))
    if draw(st.booleans()):
        doc["inputs"][0]["parameters"] = draw(st.dictionaries(keys | st.sampled_from(["binary_data_size"]),
                                                              edgy_ints | not_ints, max_size=3))
    return model, doc


# -- the tests ------------------------------------------------------------------------------------


@FUZZ
@given(req=binary_requests())
def test_binary_tensor_extension(healthy, req):
    model, body, headers = req
    infer(healthy, model, body, headers)


@FUZZ
@given(req=binary_requests(), encoding=st.sampled_from(["gzip", "deflate", "br", "identity", "gzip, deflate"]),
       damage=st.sampled_from(["none", "truncate", "garbage"]))
def test_compressed_bodies(healthy, req, encoding, damage):
    model, body, headers = req
    if encoding == "gzip":
        body = gzip.compress(body)
    elif encoding == "deflate":
        body = zlib.compress(body)
    if damage == "truncate":
        body = body[:len(body) // 2]
    elif damage == "garbage":
        body = b"\x1f\x8b" + body[::-1]
    infer(healthy, model, body, {**headers, "Content-Encoding": encoding})


@FUZZ
@given(req=mutated_requests())
def test_json_field_mutations(healthy, req):
    model, doc = req
    infer(healthy, model, doc)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(doc=json_values, model=st.sampled_from(MODELS + ["nope", "", "a" * 300]),
       version=st.sampled_from(["", "1", "0", "-1", "2", "99999999999999999999", "x"]))
def test_random_json_bodies(healthy, doc, model, version):
    if model:
        infer(healthy, model, doc, version=version)
    else:
        call(healthy, "POST", "/v2/models//infer", json.dumps(doc).encode())


@FUZZ
@given(req=parameter_abuse())
def test_parameter_abuse(healthy, req):
    model, doc = req
    infer(healthy, model, doc)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(depth=st.integers(1, 3000), kind=st.sampled_from(["list", "object", "data"]))
def test_deep_nesting(healthy, depth, kind):
    if kind == "list":
        body = b"[" * depth + b"]" * depth
    elif kind == "object":
        body = b'{"a":' * depth + b"1" + b"}" * depth
    else:
        body = (b'{"inputs":[{"name":"INPUT0","datatype":"INT32","shape":[16],"data":' + b"[" * depth + b"1"
                + b"]" * depth + b"}]}")
    status = infer(healthy, "add_sub", body)
    assert status == 400


@st.composite
def shm_inputs(draw):
    model, doc = _valid_request(draw)
    inp = doc["inputs"][0]
    del inp["data"]
    region = draw(st.sampled_from(["fzreg", "fzreg", "nope", ""]) | st.text(max_size=10) | not_ints)
    inp["parameters"] = {"shared_memory_region": region}
    for field in ("shared_memory_offset", "shared_memory_byte_size"):
        if draw(st.integers(0, 5)):
            inp["parameters"][field] = draw(edgy_ints | not_ints)
    if draw(st.booleans()):
        params = {"shared_memory_region": draw(st.sampled_from(["fzreg", "nope"])),
                  "shared_memory_offset": draw(edgy_ints), "shared_memory_byte_size": draw(edgy_ints)}
        doc["outputs"] = [{"name": draw(st.sampled_from(["OUTPUT0", "OUT", "SUM", "OUT_INT32"])),
                           "parameters": params}]
    return model, doc


@FUZZ
@given(req=shm_inputs())
def test_shared_memory_fields(healthy, req):
    model, doc = req
    infer(healthy, model, doc)


def _register_keys(server_id: str):
    own = [f"shmserve.{server_id}.broker.0", f"/shmserve.{server_id}.broker.0", f"sem.shmserve.{server_id}.trace.0",
           f"/shmserve.{server_id}.worker.1", f"shmserve.{server_id}.client.broker"]
    paths = ["/../etc/passwd", "../../etc/passwd", "/dev/shm/x", "/dev/shm/../../etc/shadow", "/", "", "//", ".",
             "..", "/a/b", "a\x00b", "/proc/self/mem", "x" * 300]
    return st.sampled_from(own + paths + ["/fz_" + server_id]) | st.text(max_size=20) | not_ints


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def test_register_endpoint(healthy, data):
    key = data.draw(_register_keys(healthy.id))
    doc = {"key": key, "offset": data.draw(edgy_ints | not_ints), "byte_size": data.draw(edgy_ints | not_ints)}
    for field in ("key", "offset", "byte_size"):
        if data.draw(st.integers(0, 6)) == 0:
            del doc[field]
    name = data.draw(st.sampled_from(["fzr1", "fzreg", "a b", "%2e%2e"]) | st.text(
        st.characters(blacklist_categories=("Cs",), blacklist_characters="/?#%"), min_size=1, max_size=12))
    from urllib.parse import quote
    status = call(healthy, "POST", f"/v2/systemsharedmemory/region/{quote(name, safe='')}/register", doc)
    if status == 200:
        # Only our own region may ever be registered, and only within its bounds.
        assert key in (healthy.region_key, healthy.region_key.lstrip("/")), doc
        assert doc.get("offset", 0) + doc["byte_size"] <= 4096, doc
        assert call(healthy, "POST", f"/v2/systemsharedmemory/region/{quote(name, safe='')}/unregister") == 200
    cuda = {"raw_handle": data.draw(st.fixed_dictionaries({"b64": st.text(max_size=20)}) | json_values),
            "device_id": data.draw(edgy_ints | not_ints), "byte_size": data.draw(edgy_ints | not_ints)}
    call(healthy, "POST", f"/v2/cudasharedmemory/region/{quote(name, safe='')}/register", cuda)


@FUZZ
@given(body=json_values | st.dictionaries(st.sampled_from(["IN_INT32", "IN_BYTES", "IN_FP16", "IN_BOOL", "id",
                                                           "parameters", "x"]),
                                          json_values | edgy_ints | not_ints, max_size=4),
       stream=st.booleans())
def test_generate(healthy, body, stream):
    call(healthy, "POST", f"/v2/models/identity_all/{'generate_stream' if stream else 'generate'}", body)


@FUZZ
@given(path=st.sampled_from(["/v2/repository/index", "/v2/repository/models/nope/load",
                             "/v2/repository/models/nope/unload", "/v2/logging",
                             "/v2/repository/models/add_sub/canary", "/v2/repository/models/nope/canary",
                             "/v2/repository/models/add_sub/canary/promote"]),
       body=json_values | st.binary(max_size=40))
def test_control_bodies(healthy, path, body):
    if isinstance(body, dict) and path == "/v2/logging":
        body.pop("log_file", None)  # a log file would be opened for real
    call(healthy, "POST", path, body if isinstance(body, bytes) else json.dumps(body).encode())


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(segments=st.lists(st.sampled_from(["models", "add_sub", "versions", "1", "x", "ready", "config", "stats",
                                          "infer", "..", "%00", "%2F", ""]), max_size=5),
       method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]))
def test_random_paths(healthy, segments, method):
    call(healthy, method, "/v2/" + "/".join(segments), b"{}" if method != "GET" else None)


def test_oversized_bodies_are_refused_without_reading_them(healthy):
    """A declared Content-Length over --http-max-input-size is a 400 at once, on infer and on
    every other endpoint; so is a gzip body that inflates beyond the limit."""
    big = b"{" + b" " * (5 << 20) + b"}"
    for path in ("/v2/models/add_sub/infer", "/v2/repository/index", "/v2/models/add_sub/generate"):
        resp = raw_request(healthy.port, "POST", path, big)
        assert resp.status == 400 and "--http-max-input-size" in resp.json()["error"], resp
    bomb = gzip.compress(b" " * (8 << 20))
    resp = raw_request(healthy.port, "POST", "/v2/models/add_sub/infer", bomb, {"Content-Encoding": "gzip"})
    assert resp.status == 400 and "limit" in resp.json()["error"], resp
