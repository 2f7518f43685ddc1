"""Triton's system shared-memory extension over HTTP, through tritonclient, against a real server:
tensors in POSIX shared-memory regions the client creates (tritonclient.utils.shared_memory),
registration and status, every error a 400 that leaves the server serving, the loopback-only rule
for registration, regions that vanish while a request uses them, and the CUDA endpoints of a
server without a GPU.

Every region a test makes has a key unique to the test server and is unregistered and unlinked
by the ``regions`` fixture, whatever the test's outcome.
"""
from __future__ import annotations

import base64

import itertools
import json
import os
import threading
import time

import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import (InferenceServerException, deserialize_bytes_tensor, serialize_byte_tensor,
                                serialized_byte_size)

from shmserve.workers.devices import cuda_device_count
from conftest import PRODUCT_MODELS, raw_request, shm_names, start_shm_server, wait_pending
from gates import Gate

N = 16  # add_sub takes and gives INT32 [16]
NB = N * 4
_keys = itertools.count()


@pytest.fixture(scope="module")
def shm_server(module_factory):
    """add_sub and the models of tests/models/shm; bound on every address so that a peer that is
    not loopback (this machine's own non-loopback address) can reach it too."""
    return start_shm_server(module_factory, ["--http-address", "0.0.0.0"])


@pytest.fixture
def http(shm_server):
    c = shm_server.client()
    yield c
    c.close()


class Regions:
    """POSIX regions made with tritonclient's utilities, unique keys per server; on teardown every
    name registered through ``register`` is unregistered and every region unlinked."""

    def __init__(self, server) -> None:
        self.server = server
        self.client = server.client()
        self.handles: dict[str, shm.SharedMemoryRegion] = {}  # key -> handle
        self.names: list[str] = []

    def create(self, name: str, byte_size: int) -> tuple[shm.SharedMemoryRegion, str]:
        key = f"/tshm_{self.server.id}_{name}_{next(_keys)}"
        handle = shm.create_shared_memory_region(name, key, byte_size, create_only=True)
        self.handles[key] = handle
        return handle, key

    def register(self, name: str, key: str, byte_size: int, offset: int = 0) -> None:
        self.names.append(name)
        self.client.register_system_shared_memory(name, key, byte_size, offset)

    def make(self, name: str, byte_size: int) -> shm.SharedMemoryRegion:
        """Create and register (the whole object) in one go."""
        handle, key = self.create(name, byte_size)
        self.register(name, key, byte_size)
        return handle

    def destroy(self, key: str) -> None:
        handle = self.handles.pop(key, None)
        if handle is not None:
            shm.destroy_shared_memory_region(handle)

    def close(self) -> None:
        for name in self.names:
            raw_request(self.server.port, "POST", f"/v2/systemsharedmemory/region/{name}/unregister")
        for key in list(self.handles):
            self.destroy(key)
        self.client.close()


@pytest.fixture
def regions(shm_server):
    r = Regions(shm_server)
    yield r
    r.close()


def contents(handle, dtype, shape, offset=0) -> np.ndarray:
    """A copy of what a region holds (a view would pin the mapping past destroy)."""
    return np.array(shm.get_contents_as_numpy(handle, dtype, shape, offset=offset), copy=True)


def shm_input(name: str, region: str, byte_size: int, offset: int = 0, datatype: str = "INT32",
              shape: list[int] | None = None) -> httpclient.InferInput:
    i = httpclient.InferInput(name, shape or [N], datatype)
    i.set_shared_memory(region, byte_size, offset=offset)
    return i


def shm_output(name: str, region: str, byte_size: int, offset: int = 0) -> httpclient.InferRequestedOutput:
    o = httpclient.InferRequestedOutput(name)
    o.set_shared_memory(region, byte_size, offset=offset)
    return o


def plain_input(name: str, arr: np.ndarray, datatype: str = "INT32") -> httpclient.InferInput:
    i = httpclient.InferInput(name, list(arr.shape), datatype)
    i.set_data_from_numpy(arr)
    return i


def assert_serves_through_shm(server, regions: Regions) -> None:
    """A fresh pair of regions, add_sub through them, right answer: the server is fine."""
    a = np.arange(N, dtype=np.int32) * 5
    b = np.arange(N, dtype=np.int32) - 3
    tag = f"ok{next(_keys)}"
    hin = regions.make(f"{tag}_in", 2 * NB)
    hout = regions.make(f"{tag}_out", 2 * NB)
    shm.set_shared_memory_region(hin, [a, b])
    c = server.client()
    try:
        c.infer("add_sub", [shm_input("INPUT0", f"{tag}_in", NB), shm_input("INPUT1", f"{tag}_in", NB, NB)],
                outputs=[shm_output("OUTPUT0", f"{tag}_out", NB), shm_output("OUTPUT1", f"{tag}_out", NB, NB)])
    finally:
        c.close()
    np.testing.assert_array_equal(contents(hout, np.int32, [N]), a + b)
    np.testing.assert_array_equal(contents(hout, np.int32, [N], NB), a - b)


def status_names(server) -> list[str]:
    raw = raw_request(server.port, "GET", "/v2/systemsharedmemory/status")
    assert raw.status == 200, raw
    return sorted(r["name"] for r in raw.json())


# -- A. tensors in regions ---------------------------------------------------------------------


def test_numeric_inputs_and_outputs_in_regions(http, regions):
    a = np.arange(N, dtype=np.int32) * 7
    b = np.arange(N, dtype=np.int32) + 100
    hin = regions.make("num_in", 2 * NB)
    hout = regions.make("num_out", 2 * NB)
    shm.set_shared_memory_region(hin, [a, b])
    result = http.infer("add_sub", [shm_input("INPUT0", "num_in", NB), shm_input("INPUT1", "num_in", NB, NB)],
                        outputs=[shm_output("OUTPUT0", "num_out", NB), shm_output("OUTPUT1", "num_out", NB, NB)])
    outs = {o["name"]: o for o in result.get_response()["outputs"]}
    assert set(outs) == {"OUTPUT0", "OUTPUT1"}
    for name, offset in (("OUTPUT0", 0), ("OUTPUT1", NB)):
        o = outs[name]
        assert o["datatype"] == "INT32" and o["shape"] == [N]
        assert "data" not in o
        assert o["parameters"]["shared_memory_region"] == "num_out"
        assert o["parameters"]["shared_memory_byte_size"] == NB
        assert o["parameters"].get("shared_memory_offset", 0) == offset
        assert "binary_data_size" not in o["parameters"]
    np.testing.assert_array_equal(contents(hout, np.int32, [N]), a + b)
    np.testing.assert_array_equal(contents(hout, np.int32, [N], NB), a - b)
    # The inputs were read, not consumed or altered.
    np.testing.assert_array_equal(contents(hin, np.int32, [N]), a)


def test_response_on_the_wire_carries_region_parameters_and_no_data(shm_server, regions):
    a = np.arange(N, dtype=np.int32)
    hin = regions.make("wire_in", NB)
    hout = regions.make("wire_out", 4 * NB)
    shm.set_shared_memory_region(hin, [a])
    body = {
        "id": "wire-1",
        "inputs": [
            {"name": "INPUT0", "datatype": "INT32", "shape": [N],
             "parameters": {"shared_memory_region": "wire_in", "shared_memory_byte_size": NB}},
            {"name": "INPUT1", "datatype": "INT32", "shape": [N], "data": [2] * N},
        ],
        "outputs": [
            {"name": "OUTPUT0", "parameters": {"shared_memory_region": "wire_out", "shared_memory_byte_size": NB,
                                               "shared_memory_offset": 2 * NB}},
            {"name": "OUTPUT1", "parameters": {"binary_data": False}},
        ],
    }
    raw = raw_request(shm_server.port, "POST", "/v2/models/add_sub/infer", json.dumps(body).encode(),
                      {"Content-Type": "application/json"})
    assert raw.status == 200, raw
    assert "inference-header-content-length" not in raw.headers  # no binary tail at all
    doc = raw.json()
    assert doc["id"] == "wire-1" and doc["model_name"] == "add_sub"
    outs = {o["name"]: o for o in doc["outputs"]}
    assert outs["OUTPUT0"] == {"name": "OUTPUT0", "datatype": "INT32", "shape": [N], "parameters": {
        "shared_memory_region": "wire_out", "shared_memory_byte_size": NB, "shared_memory_offset": 2 * NB}}
    assert outs["OUTPUT1"]["data"] == (a - 2).tolist()  # the other output still comes as JSON
    np.testing.assert_array_equal(contents(hout, np.int32, [N], 2 * NB), a + 2)
    assert not contents(hout, np.int32, [2 * N]).any(), "bytes before the output's offset were written"


def test_offsets_inside_registered_regions(http, regions):
    """A region registered at an offset of its object, tensors at offsets inside the region: every
    offset adds up."""
    a = np.arange(N, dtype=np.int32) * 3
    b = np.full(N, 11, dtype=np.int32)
    hin, kin = regions.create("off_in", 1024)
    hout, kout = regions.create("off_out", 1024)
    regions.register("off_in", kin, 512, offset=256)
    regions.register("off_out", kout, 384, offset=128)
    shm.set_shared_memory_region(hin, [a], offset=256 + 32)
    shm.set_shared_memory_region(hin, [b], offset=256 + 200)
    http.infer("add_sub", [shm_input("INPUT0", "off_in", NB, 32), shm_input("INPUT1", "off_in", NB, 200)],
               outputs=[shm_output("OUTPUT0", "off_out", NB, 8), shm_output("OUTPUT1", "off_out", NB, 136)])
    np.testing.assert_array_equal(contents(hout, np.int32, [N], 128 + 8), a + b)
    np.testing.assert_array_equal(contents(hout, np.int32, [N], 128 + 136), a - b)
    whole = contents(hout, np.uint8, [1024])
    written = np.zeros(1024, dtype=bool)
    written[136:136 + NB] = written[264:264 + NB] = True
    assert not whole[~written].any(), "the server wrote outside the outputs' places"
    assert http.get_system_shared_memory_status("off_in") == [
        {"name": "off_in", "key": kin, "offset": 256, "byte_size": 512}]


def test_bytes_inputs_and_outputs_in_regions(http, regions):
    values = np.array([b"hello", b"", b"\x00\xff binary \x01", "ünïcödé".encode(), b"x" * 300], dtype=np.object_)
    serialized = serialize_byte_tensor(values)
    size = serialized_byte_size(serialized)
    hin = regions.make("bytes_in", 1024)
    hout = regions.make("bytes_out", 1024)
    shm.set_shared_memory_region(hin, [serialized], offset=40)
    result = http.infer("bytes_identity",
                        [shm_input("IN", "bytes_in", size, 40, "BYTES", [len(values)])],
                        outputs=[shm_output("OUT", "bytes_out", 600, 16)])
    (out,) = result.get_response()["outputs"]
    assert out["datatype"] == "BYTES" and out["shape"] == [len(values)]
    assert "data" not in out and out["parameters"]["shared_memory_region"] == "bytes_out"
    assert out["parameters"].get("shared_memory_offset") == 16
    # Read back the two ways a tritonclient user would.
    got = contents(hout, np.object_, [len(values)], 16)
    assert got.tolist() == values.tolist()
    raw = bytes(contents(hout, np.uint8, [size], 16))
    assert deserialize_bytes_tensor(raw).tolist() == values.tolist()


def test_model_writing_its_input_leaves_the_http_clients_region_alone(http, regions):
    """zerocopy_probe sets element 0 of its input array to 4242: over HTTP with the input in a
    region, the client's region is unchanged (the model's inputs are its own copies, as in
    Triton), while the output goes straight into the client's output region."""
    x = np.arange(10, 20, dtype=np.int32)
    hin = regions.make("zc_in", 64)
    hout = regions.make("zc_out", 64)
    shm.set_shared_memory_region(hin, [x])
    result = http.infer("zerocopy_probe", [shm_input("X", "zc_in", x.nbytes, shape=[10])],
                        outputs=[httpclient.InferRequestedOutput("BEFORE"), shm_output("DOUBLED", "zc_out", 64)])
    assert result.as_numpy("BEFORE").tolist() == [10]
    np.testing.assert_array_equal(contents(hout, np.int32, [10]), x * 2)
    np.testing.assert_array_equal(contents(hin, np.int32, [10]), x)


# -- A. status and unregister ------------------------------------------------------------------


def test_status_of_one_and_of_all_is_triton_shaped(shm_server, http, regions):
    _, k1 = regions.create("st_one", 128)
    _, k2 = regions.create("st_two", 256)
    assert status_names(shm_server) == []
    regions.register("st_one", k1, 128)
    regions.register("st_two", k2, 200, offset=56)
    raw = raw_request(shm_server.port, "GET", "/v2/systemsharedmemory/status")
    assert raw.status == 200 and raw.headers["content-type"].startswith("application/json")
    assert sorted(raw.json(), key=lambda r: r["name"]) == [
        {"name": "st_one", "key": k1, "offset": 0, "byte_size": 128},
        {"name": "st_two", "key": k2, "offset": 56, "byte_size": 200},
    ]
    one = raw_request(shm_server.port, "GET", "/v2/systemsharedmemory/region/st_two/status")
    assert one.status == 200 and one.json() == [{"name": "st_two", "key": k2, "offset": 56, "byte_size": 200}]
    assert http.get_system_shared_memory_status("st_one") == [
        {"name": "st_one", "key": k1, "offset": 0, "byte_size": 128}]
    assert sorted(r["name"] for r in http.get_system_shared_memory_status()) == ["st_one", "st_two"]
    with pytest.raises(InferenceServerException) as e:
        http.get_system_shared_memory_status("st_none")
    assert e.value.status() == "404" and "st_none" in e.value.message()  # Triton 2.51: NOT_FOUND


def test_unregister_one_then_all(shm_server, http, regions):
    a = np.arange(N, dtype=np.int32)
    for name in ("un_a", "un_b", "un_c"):
        h = regions.make(name, 2 * NB)
        shm.set_shared_memory_region(h, [a, a])
    http.unregister_system_shared_memory("un_b")
    assert status_names(shm_server) == ["un_a", "un_c"]
    with pytest.raises(InferenceServerException) as e:  # un_b is no longer usable
        http.infer("add_sub", [shm_input("INPUT0", "un_b", NB), shm_input("INPUT1", "un_a", NB)])
    assert e.value.status() == "404" and "un_b" in e.value.message()  # (Triton: NOT_FOUND)
    result = http.infer("add_sub", [shm_input("INPUT0", "un_a", NB), shm_input("INPUT1", "un_c", NB, NB)])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * a)
    raw = raw_request(shm_server.port, "POST", "/v2/systemsharedmemory/unregister")
    assert raw.status == 200, raw
    assert status_names(shm_server) == []
    http.unregister_system_shared_memory()  # all again, with nothing registered: still fine
    assert http.get_system_shared_memory_status() == []


# -- B. errors: 400 with a clear message, and the server goes on ------------------------------------


@pytest.mark.parametrize("case", ["missing_key", "dev_shm_path", "slash_path", "server_key", "server_key_bare",
                                  "duplicate_name", "same_key", "beyond_object", "zero_size"])
def test_bad_registration_is_refused(shm_server, http, regions, case):
    _, key = regions.create("reg_ok", 256)
    regions.register("reg_ok", key, 256)
    name, size, offset = "reg_bad", 64, 0
    if case == "missing_key":
        bad = f"/tshm_{shm_server.id}_does_not_exist"
        needle = f"Unable to open shared memory region: '{bad}'"
    elif case == "dev_shm_path":
        bad, needle = f"/dev/shm{key}", "not a path"  # the object exists, but a key is no path
    elif case == "slash_path":
        bad, needle = "a/b", "not a path"
    elif case == "server_key":
        bad, needle = f"/shmserve.{shm_server.id}.broker.0", "the key contains the reserved prefix 'shmserve.'"
    elif case == "server_key_bare":
        bad, needle = f"shmserve.{shm_server.id}.worker.0", "the key contains the reserved prefix 'shmserve.'"
    elif case == "duplicate_name":
        bad, name, needle = key, "reg_ok", "shared memory region 'reg_ok' already in manager"
    elif case == "same_key":  # another name on a key registered already: Triton refuses it (INTERNAL)
        bad, offset, needle = key, 128, f"Invalid shared memory region: '{key}'"
    elif case == "beyond_object":
        _, bad = regions.create("reg_other", 256)
        size, offset, needle = 200, 100, "failed to register shared memory region 'reg_bad': invalid args"
    else:
        _, bad = regions.create("reg_other", 256)
        size, needle = 0, "failed to register shared memory region 'reg_bad'"
    with pytest.raises(InferenceServerException) as e:
        http.register_system_shared_memory(name, bad, size, offset)
    assert e.value.status() == ("500" if case in ("missing_key", "same_key") else "400"), e.value  # Triton's INTERNAL
    assert needle in e.value.message(), e.value.message()
    assert status_names(shm_server) == ["reg_ok"]
    assert http.get_system_shared_memory_status("reg_ok")[0]["key"] == key  # the duplicate changed nothing
    assert_serves_through_shm(shm_server, regions)


@pytest.mark.parametrize("key", ["sem.shmserve.{id}.trace.0", "/sem.shmserve.{id}.trace.0"])
def test_server_semaphore_file_cannot_be_registered(shm_server, http, regions, key):
    """The files behind the server's semaphores live in /dev/shm too (found by the earlier version
    of this test: the broker's doorbell, a semaphore then, could be registered and written over)."""
    key = key.format(id=shm_server.id)
    assert os.path.exists(f"/dev/shm/{key.lstrip('/')}")
    regions.names.append("sem_key")  # unregistered on teardown, should the server take it
    with pytest.raises(InferenceServerException) as e:
        http.register_system_shared_memory("sem_key", key, 8)
    assert e.value.status() == "400"
    assert "as the key contains the reserved prefix" in e.value.message()
    assert status_names(shm_server) == []
    assert_serves_through_shm(shm_server, regions)


def _infer_error_case(case: str, regions: Regions) -> tuple[str, list, list, str]:
    a = np.arange(N, dtype=np.int32)
    h = regions.make(f"ie_{case}", 2 * NB)
    shm.set_shared_memory_region(h, [a, a])
    region = f"ie_{case}"
    plain = plain_input("INPUT1", a)
    if case == "unknown_region":
        return "add_sub", [shm_input("INPUT0", "never_registered_region", NB), plain], [], \
            "Unable to find shared memory region: 'never_registered_region'"
    if case == "byte_size_mismatch":
        return "add_sub", [shm_input("INPUT0", region, NB - 4), plain], [], f"Expected {NB}, got {NB - 4}"
    if case == "overrun":
        return "add_sub", [shm_input("INPUT0", region, NB, NB + 4), plain], [], \
            f"Invalid offset + byte size for shared memory region: '{region}'"
    if case == "output_region_too_small":
        return ("add_sub", [shm_input("INPUT0", region, NB), plain], [shm_output("OUTPUT0", region, NB - 8)],
                f"shared memory size specified with the request for output 'OUTPUT0' ({NB - 8} bytes) should be at "
                f"least {NB} bytes to hold the results")
    if case == "output_overrun":
        return "add_sub", [shm_input("INPUT0", region, NB), plain], [shm_output("OUTPUT0", region, NB, NB + 8)], \
            f"Invalid offset + byte size for shared memory region: '{region}'"
    if case == "output_unknown_region":
        return "add_sub", [shm_input("INPUT0", region, NB), plain], [shm_output("OUTPUT0", "no_out_region", NB)], \
            "Unable to find shared memory region: 'no_out_region'"
    assert case == "bytes_size_mismatch"
    data = serialize_byte_tensor(np.array([b"abc", b"defg"], dtype=np.object_))
    shm.set_shared_memory_region(h, [data])
    return "bytes_identity", [shm_input("IN", region, serialized_byte_size(data) - 2, 0, "BYTES", [2])], [], \
        "incomplete string data for inference input 'IN', expecting string of length 4 but only 2 bytes available"


@pytest.mark.parametrize("case", ["unknown_region", "byte_size_mismatch", "overrun", "output_region_too_small",
                                  "output_overrun", "output_unknown_region", "bytes_size_mismatch"])
def test_bad_region_use_in_infer_is_refused(shm_server, http, regions, case):
    """A 400, or Triton's 404 (NOT_FOUND) for a region that is not registered."""
    model, inputs, outputs, needle = _infer_error_case(case, regions)
    pids = {m: shm_server.worker_pids(m) for m in ("add_sub", "bytes_identity")}
    with pytest.raises(InferenceServerException) as e:
        http.infer(model, inputs, outputs=outputs or None)
    assert e.value.status() == ("404" if "unknown_region" in case else "400"), e.value
    assert needle in e.value.message(), e.value.message()
    assert {m: shm_server.worker_pids(m) for m in pids} == pids  # no worker died over it
    assert_serves_through_shm(shm_server, regions)


def test_an_output_in_a_region_cannot_also_ask_for_classes_or_binary_data(shm_server):
    """Triton's refusals (checked on 2.51), over HTTP (capitalised) and gRPC; tritonclient never
    sends them, a raw client may."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    region = {"shared_memory_region": "r", "shared_memory_byte_size": 64}
    for clash, extra in (("classification", {"classification": 2}), ("binary_data", {"binary_data": True})):
        doc = {"inputs": [{"name": n, "datatype": "INT32", "shape": [N], "data": [0] * N} for n in ("INPUT0", "INPUT1")],
               "outputs": [{"name": "OUTPUT0", "parameters": {**region, **extra}}]}
        r = raw_request(shm_server.port, "POST", "/v2/models/add_sub/infer", json.dumps(doc).encode())
        assert (r.status, r.json()) == (400, {"error": f"Output can't set both 'shared_memory_region' and '{clash}'"})
    request = service_pb2.ModelInferRequest(model_name="add_sub")
    for n in ("INPUT0", "INPUT1"):
        request.inputs.add(name=n, datatype="INT32", shape=[N]).contents.int_contents.extend([0] * N)
    out = request.outputs.add(name="OUTPUT0")
    out.parameters["shared_memory_region"].string_param = "r"
    out.parameters["shared_memory_byte_size"].int64_param = 64
    out.parameters["classification"].int64_param = 2
    with grpc.insecure_channel(shm_server.wait_grpc_ready().grpc_url) as channel:
        with pytest.raises(grpc.RpcError) as e:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
    assert (e.value.code(), e.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, "output can't set both 'shared_memory_region' and 'classification'")


def test_registration_from_a_non_loopback_peer_is_refused(shm_server, regions, local_non_loopback_address):
    _, key = regions.create("remote_refused", 64)
    remote = httpclient.InferenceServerClient(f"{local_non_loopback_address}:{shm_server.port}")
    try:
        assert remote.is_server_live()  # the peer does reach the server
        with pytest.raises(InferenceServerException) as e:
            remote.register_system_shared_memory("remote_refused", key, 64)
        assert e.value.status() == "403"
        assert "--allow-remote-shm" in e.value.message()
        with pytest.raises(InferenceServerException) as e:
            remote.register_cuda_shared_memory("remote_cuda", b"\0" * 64, 0, 64)
        assert e.value.status() == "403"
        assert remote.get_system_shared_memory_status() == []
    finally:
        remote.close()
    assert status_names(shm_server) == []
    regions.register("remote_refused", key, 64)  # the same request from loopback is fine
    assert status_names(shm_server) == ["remote_refused"]


def test_an_ipv4_loopback_peer_of_a_server_bound_to_every_ipv6_address_may_register(server_factory):
    """Bound to ``::``, the server sees a client of 127.0.0.1 as ``::ffff:127.0.0.1``: that is
    still this host, and registers as any loopback peer does."""
    server = server_factory.start([PRODUCT_MODELS], ["--http-address", "::", "--model-control-mode", "explicit",
                                                     "--load-model", "add_sub"])
    key = f"/tshm_{server.id}_mapped"
    handle = shm.create_shared_memory_region("mapped", key, 2 * NB, create_only=True)
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
    try:
        a = np.arange(N, dtype=np.int32)
        shm.set_shared_memory_region(handle, [a, a * 3])
        client.register_system_shared_memory("mapped", key, 2 * NB)
        result = client.infer("add_sub", [shm_input("INPUT0", "mapped", NB), shm_input("INPUT1", "mapped", NB, NB)])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 4)
        client.unregister_system_shared_memory("mapped")
        assert client.get_system_shared_memory_status() == []
    finally:
        client.close()
        shm.destroy_shared_memory_region(handle)


def test_allow_remote_shm_lets_a_non_loopback_peer_register(server_factory, local_non_loopback_address):
    server = server_factory.start([PRODUCT_MODELS], ["--http-address", "0.0.0.0", "--allow-remote-shm",
                                                     "--model-control-mode", "explicit", "--load-model", "add_sub"])
    key = f"/tshm_{server.id}_remote_ok"
    handle = shm.create_shared_memory_region("remote_ok", key, 2 * NB, create_only=True)
    remote = httpclient.InferenceServerClient(f"{local_non_loopback_address}:{server.port}")
    try:
        a = np.arange(N, dtype=np.int32)
        shm.set_shared_memory_region(handle, [a, a * 3])
        remote.register_system_shared_memory("remote_ok", key, 2 * NB)
        assert remote.get_system_shared_memory_status() == [
            {"name": "remote_ok", "key": key, "offset": 0, "byte_size": 2 * NB}]
        result = remote.infer("add_sub", [shm_input("INPUT0", "remote_ok", NB), shm_input("INPUT1", "remote_ok", NB, NB)])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 4)
        remote.unregister_system_shared_memory("remote_ok")
        assert remote.get_system_shared_memory_status() == []
    finally:
        remote.close()
        shm.destroy_shared_memory_region(handle)


# -- C. a region that goes away while a request uses it ------------------------------------------


def _infer_in_thread(server, *args, **kwargs) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        c = server.client(network_timeout=60.0)
        started = time.monotonic()
        try:
            box["result"] = c.infer(*args, **kwargs)
        except InferenceServerException as e:
            box["error"] = e
        finally:
            box["seconds"] = time.monotonic() - started
            c.close()

    t = threading.Thread(target=run)
    t.start()
    return t, box


def _slow_reader_pid(server) -> int:
    pids = server.worker_pids("slow_reader")
    assert len(pids) == 1, pids
    return pids[0]


def _check_completed_or_clean_error(box: dict, expected_sum: int, pid: int) -> None:
    if "result" in box:
        result = box["result"]
        assert result.as_numpy("SUM").tolist() == [expected_sum]
        assert result.as_numpy("PID").tolist() == [pid]
    else:
        e = box["error"]
        assert e.status() in ("400", "404", "410"), e  # (404: the region is gone, Triton's NOT_FOUND)
        assert e.message() and "Traceback" not in e.message(), e.message()


@pytest.mark.parametrize("unlink", [False, True], ids=["unregister", "unregister_and_unlink"])
def test_region_removed_while_the_model_uses_it(shm_server, http, regions, unlink, tmp_path):
    """slow_reader waits at a gate before it reads X; the region X lives in is unregistered (and
    the object unlinked) meanwhile. The request completes (or fails cleanly), the worker is the
    same process afterwards, and the server goes on serving."""
    pid = _slow_reader_pid(shm_server)
    x = np.arange(1, 65, dtype=np.int32)
    handle, key = regions.create("busy_in", x.nbytes)
    regions.register("busy_in", key, x.nbytes)
    shm.set_shared_memory_region(handle, [x])
    gate = Gate(tmp_path / "gate")
    t, box = _infer_in_thread(shm_server, "slow_reader", [shm_input("X", "busy_in", x.nbytes, shape=[64])],
                              parameters={"sleep_s": 0, "gate": gate.param})
    try:
        gate.wait_started(1)  # the request is in the model, which has not read X yet
        http.unregister_system_shared_memory("busy_in")
        if unlink:
            regions.destroy(key)
            assert shm_names(key.lstrip("/")) == []
    finally:
        gate.open()
    t.join(60)
    assert not t.is_alive(), "the request hung"
    _check_completed_or_clean_error(box, int(x.sum()), pid)
    assert _slow_reader_pid(shm_server) == pid, "the worker was replaced"
    y = np.arange(8, dtype=np.int32)
    after = http.infer("slow_reader", [plain_input("X", y)], parameters={"sleep_s": 0})
    assert after.as_numpy("SUM").tolist() == [int(y.sum())] and after.as_numpy("PID").tolist() == [pid]
    assert_serves_through_shm(shm_server, regions)


def test_region_unlinked_while_its_request_waits_for_the_instance(shm_server, http, regions, tmp_path):
    """A request waits behind another on the single instance; its input region is unregistered
    and unlinked before the worker gets to it: it fails cleanly (or completes), the worker lives."""
    pid = _slow_reader_pid(shm_server)
    x = np.arange(5, 37, dtype=np.int32)
    handle, key = regions.create("queued_in", x.nbytes)
    regions.register("queued_in", key, x.nbytes)
    shm.set_shared_memory_region(handle, [x])
    ones = regions.make("queued_first", 16)  # through a region too, so that the broker counts it pending
    shm.set_shared_memory_region(ones, [np.ones(4, dtype=np.int32)])
    gate = Gate(tmp_path / "gate")
    first_t, first = _infer_in_thread(shm_server, "slow_reader", [shm_input("X", "queued_first", 16, shape=[4])],
                                      parameters={"sleep_s": 0, "gate": gate.param})
    try:
        gate.wait_started(1)
        second_t, second = _infer_in_thread(shm_server, "slow_reader",
                                            [shm_input("X", "queued_in", x.nbytes, shape=[32])],
                                            parameters={"sleep_s": 0})
        wait_pending(shm_server, "slow_reader", 2)  # the second waits behind the first, which is held
        http.unregister_system_shared_memory("queued_in")
        regions.destroy(key)
    finally:
        gate.open()
    first_t.join(60)
    second_t.join(60)
    assert not first_t.is_alive() and not second_t.is_alive(), "a request hung"
    assert first["result"].as_numpy("SUM").tolist() == [4]
    _check_completed_or_clean_error(second, int(x.sum()), pid)
    assert _slow_reader_pid(shm_server) == pid, "the worker was replaced"
    assert_serves_through_shm(shm_server, regions)


def test_key_reused_for_a_new_object_is_read_afresh(shm_server, http, regions):
    """Unregister, unlink, create a new object under the same key, register again: the worker must
    use the new object (an earlier version read the old, deleted one from its cached mapping and
    wrote the outputs there: silent wrong results)."""
    key = f"/tshm_{shm_server.id}_reused_key"
    for round_, value in enumerate((10, 20)):
        handle = shm.create_shared_memory_region("reuse", key, 2 * NB, create_only=True)
        regions.handles[key] = handle
        shm.set_shared_memory_region(handle, [np.full(N, value, dtype=np.int32), np.ones(N, dtype=np.int32)])
        regions.register("reuse", key, 2 * NB)
        hout = regions.make(f"reuse_out{round_}", NB)
        result = http.infer("add_sub", [shm_input("INPUT0", "reuse", NB), shm_input("INPUT1", "reuse", NB, NB)],
                            outputs=[shm_output("OUTPUT0", f"reuse_out{round_}", NB),
                                     httpclient.InferRequestedOutput("OUTPUT1")])
        written = contents(hout, np.int32, [N])
        http.unregister_system_shared_memory("reuse")
        regions.destroy(key)  # unlinked: the next round makes a new object with the same key
        assert result.as_numpy("OUTPUT1").tolist() == [value - 1] * N, f"round {round_} read stale input"
        assert written.tolist() == [value + 1] * N, f"round {round_}: the output did not reach the region"


def test_repeated_requests_follow_their_regions_through_re_registration(shm_server, http, regions):
    """The same request bytes follow a region registered again at another offset, and fail once
    it is gone, never read or write where it used to be."""
    hin, key_in = regions.create("moving_in", 4 * NB)
    hout, key_out = regions.create("moving_out", 2 * NB)
    shm.set_shared_memory_region(hin, [np.full(N, 10, dtype=np.int32), np.ones(N, dtype=np.int32),
                                       np.full(N, 20, dtype=np.int32), np.full(N, 2, dtype=np.int32)])

    def infer():
        return http.infer("add_sub", [shm_input("INPUT0", "moving_in", NB), shm_input("INPUT1", "moving_in", NB, NB)],
                          outputs=[shm_output("OUTPUT0", "moving_out", NB),
                                   httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)])

    for round_, (offset, a, b) in enumerate(((0, 10, 1), (2 * NB, 20, 2))):
        regions.register("moving_in", key_in, 2 * NB, offset)
        regions.register("moving_out", key_out, NB, offset // 2)
        for _ in range(3):  # the first is checked in full, the next ones reuse what it found
            assert infer().as_numpy("OUTPUT1").tolist() == [a - b] * N, f"round {round_} read the old place"
            assert contents(hout, np.int32, [N], offset // 2).tolist() == [a + b] * N, \
                f"round {round_}: the output did not reach the region's new place"
        http.unregister_system_shared_memory("moving_in")
        http.unregister_system_shared_memory("moving_out")
    with pytest.raises(InferenceServerException, match="Unable to find shared memory region: 'moving_in'"):
        infer()
    assert contents(hout, np.int32, [N]).tolist() == [11] * N  # round 0's answer, untouched since
    assert_serves_through_shm(shm_server, regions)


@pytest.mark.parametrize("which", ["input", "output"])
def test_region_truncated_after_registration_is_a_400_not_a_crash(shm_server, http, regions, which):
    """A client shrinks its region after registering it: touching the lost pages would kill the
    worker with SIGBUS; the server checks the object's size and refuses the request instead."""
    tag = f"trunc{next(_keys)}"
    hin, kin = regions.create(f"{tag}_in", 2 * NB)
    hout, kout = regions.create(f"{tag}_out", 2 * NB)
    regions.register(f"{tag}_in", kin, 2 * NB)
    regions.register(f"{tag}_out", kout, 2 * NB)
    shm.set_shared_memory_region(hin, [np.arange(N, dtype=np.int32), np.ones(N, dtype=np.int32)])
    workers = shm_server.worker_pids("add_sub")
    fd = os.open(f"/dev/shm{kin if which == 'input' else kout}", os.O_RDWR)
    try:
        os.ftruncate(fd, 16)
    finally:
        os.close(fd)
    with pytest.raises(InferenceServerException) as e:
        http.infer("add_sub", [shm_input("INPUT0", f"{tag}_in", NB), shm_input("INPUT1", f"{tag}_in", NB, NB)],
                   outputs=[shm_output("OUTPUT0", f"{tag}_out", NB), shm_output("OUTPUT1", f"{tag}_out", NB, NB)])
    assert e.value.status() == "400"
    assert "was truncated since it was registered" in e.value.message()
    assert shm_server.worker_pids("add_sub") == workers  # no worker died
    assert_serves_through_shm(shm_server, regions)


# -- D. CUDA shared memory registrations that cannot be served ------------------------------------


def test_cuda_registrations_that_cannot_be_served_are_400s(shm_server, http):
    """Without a CUDA device, every registration is refused saying so; with one, a handle that
    does not open (64 zero bytes) is refused at registration, as Triton refuses it."""
    why = "no CUDA device" if cuda_device_count() == 0 else "failed to open CUDA IPC handle"
    zeros = base64.b64encode(bytes(64)).decode()
    with pytest.raises(InferenceServerException) as e:
        # tritonclient sends the handle as given: base64, as cuda_shared_memory.get_raw_handle gives it
        http.register_cuda_shared_memory("cuda_r", zeros.encode(), 0, 1024)
    assert e.value.status() == "400"
    assert why in e.value.message(), e.value.message()
    raw = raw_request(shm_server.port, "POST", "/v2/cudasharedmemory/region/cuda_r/register",
                      json.dumps({"raw_handle": {"b64": zeros}, "device_id": 0, "byte_size": 64}).encode())
    assert raw.status == 400 and why in raw.json()["error"]
    assert http.get_cuda_shared_memory_status() == []
    raw = raw_request(shm_server.port, "GET", "/v2/cudasharedmemory/status")
    assert raw.status == 200 and raw.json() == []
    # tritonclient unregisters unconditionally (e.g. in cleanup): both forms answer 200.
    http.unregister_cuda_shared_memory("cuda_r")
    http.unregister_cuda_shared_memory()
    for path in ("/v2/cudasharedmemory/region/cuda_r/unregister", "/v2/cudasharedmemory/unregister"):
        assert raw_request(shm_server.port, "POST", path).status == 200
    assert http.is_server_ready()


def test_region_table_too_large_for_its_area_is_published_incomplete():
    """Past its area the table is published empty and incomplete, so clients send requests that
    name regions through the broker (which resolves them) rather than to workers that could not."""
    from shmserve.shm.region_table import RegionEntry, encode

    regions = {f"r{i}": RegionEntry(f"/key{i}", 0, 64, i) for i in range(100)}
    handles = ["QUJD", "REVG"]
    assert orjson.loads(encode(regions, 1 << 20, handles)) == {
        "complete": True, "regions": {n: list(r) for n, r in regions.items()}, "cuda": handles}
    # The CUDA handles stay listed: workers close the mappings of the others.
    assert orjson.loads(encode(regions, 256, handles)) == {"complete": False, "regions": {}, "cuda": handles}
