"""Triton's current system shared-memory behaviour (its qa/L0_shared_memory suite), through
tritonclient against a real server: the error texts clients match on (an offset outside the
region, offset + byte size past it or past 2^64, a registration outside the object, keys that
may not be registered), and an unregister while a request uses the region, which waits for
the requests to finish and then takes effect with no second call.
"""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from conftest import raw_request, start_shm_server, wait_until
from gates import Gate
from test_shared_memory import NB, N, Regions, _infer_in_thread, shm_input, shm_output, status_names

SIZE_MAX = 2**64 - 1


@pytest.fixture(scope="module")
def shm_server(module_factory):
    return start_shm_server(module_factory)


@pytest.fixture
def http(shm_server):
    c = shm_server.client()
    yield c
    c.close()


@pytest.fixture
def regions(shm_server):
    r = Regions(shm_server)
    yield r
    r.close()


# -- requests outside their regions ------------------------------------------------------------


@pytest.mark.parametrize("offset,byte_size,text", [
    (2**64 - 32, NB, "Invalid offset for shared memory region: '{r}'"),  # Triton's test_infer_offset_out_of_bound
    (NB, NB, "Invalid offset for shared memory region: '{r}'"),  # the offset is the region's end
    (1, NB, "Invalid offset + byte size for shared memory region: '{r}'"),  # test_infer_byte_size_out_of_bound
    (32, 2**64 - 32, "Integer overflow detected: byte_size (18446744073709551584) + offset (32) exceeds "
                     "maximum value (18446744073709551615) for region '{r}'"),  # test_infer_integer_overflow
], ids=["offset_past_2_63", "offset_at_end", "end_past_region", "integer_overflow"])
def test_output_outside_its_region_is_refused_with_tritons_text(http, regions, offset, byte_size, text):
    a = np.arange(N, dtype=np.int32)
    hin = regions.make("oob_in", 2 * NB)
    shm.set_shared_memory_region(hin, [a, a])
    regions.make("oob_out", NB)
    with pytest.raises(InferenceServerException) as e:
        http.infer("add_sub", [shm_input("INPUT0", "oob_in", NB), shm_input("INPUT1", "oob_in", NB, NB)],
                   outputs=[shm_output("OUTPUT0", "oob_out", byte_size, offset)])
    assert e.value.status() == "400", e.value
    assert e.value.message() == text.format(r="oob_out")  # the whole text: clients match on it


def test_input_offset_past_its_region_is_refused_with_tritons_text(http, regions):
    hin = regions.make("oob_input", NB)
    shm.set_shared_memory_region(hin, [np.arange(N, dtype=np.int32)])
    with pytest.raises(InferenceServerException) as e:
        http.infer("add_sub", [shm_input("INPUT0", "oob_input", NB, NB + 4), shm_input("INPUT1", "oob_input", NB)])
    assert e.value.status() == "400"
    assert "Invalid offset for shared memory region: 'oob_input'" in e.value.message(), e.value.message()


# -- registrations that are refused ------------------------------------------------------------


@pytest.mark.parametrize("byte_size,offset", [(NB + 1, 0), (NB, 1), (1, NB), (0, NB + 1)])
def test_registration_outside_the_object_is_refused_with_tritons_text(shm_server, http, regions, byte_size, offset):
    """Triton's test_register_out_of_bound: every edge of offset + byte_size past the object."""
    _, key = regions.create("reg_oob", NB)
    regions.names.append("reg_oob")  # unregistered on teardown, should the server take it
    with pytest.raises(InferenceServerException) as e:
        http.register_system_shared_memory("reg_oob", key, byte_size, offset)
    assert e.value.status() == "400"
    assert "failed to register shared memory region 'reg_oob': invalid args" in e.value.message(), e.value.message()
    assert status_names(shm_server) == []


@pytest.mark.parametrize("key", ["/", "///"])
def test_key_of_slashes_only_is_refused_with_tritons_text(http, key):
    with pytest.raises(InferenceServerException) as e:
        http.register_system_shared_memory("my_test_shm_name", key, 10000)
    assert e.value.status() == "400"
    assert f"cannot register shared memory region 'my_test_shm_name' - invalid shm key '{key}'" in e.value.message()


@pytest.mark.parametrize("key", ["triton_python_backend_shm_region__my_test_shm_key",
                                 "/triton_python_backend_shm_region__my_test_shm_key",
                                 "///triton_python_backend_shm_region__my_test_shm_key"])
def test_key_with_tritons_reserved_prefix_is_refused_with_tritons_text(http, key):
    with pytest.raises(InferenceServerException) as e:
        http.register_system_shared_memory("my_test_shm_name", key, 10000)
    assert e.value.status() == "400"
    assert (f"cannot register shared memory region 'my_test_shm_name' with key '{key}' as the key contains the "
            f"reserved prefix 'triton_python_backend_shm_region_'") in e.value.message(), e.value.message()


# -- status, and names shared by system and CUDA regions ------------------------------------------


def test_status_of_all_lists_the_regions_in_name_order(shm_server, http, regions):
    """Triton keeps its regions in a std::map: the status of all lists them by name, not in the
    order they were registered."""
    for name in ("ord_b", "ord_c", "ord_a"):
        regions.make(name, NB)
    raw = raw_request(shm_server.port, "GET", "/v2/systemsharedmemory/status")
    assert raw.status == 200
    assert [r["name"] for r in raw.json() if r["name"].startswith("ord_")] == ["ord_a", "ord_b", "ord_c"]
    assert [r["name"] for r in http.get_system_shared_memory_status()
            if r["name"].startswith("ord_")] == ["ord_a", "ord_b", "ord_c"]


def test_a_name_is_taken_by_a_region_of_either_kind(shm_server, http, regions):
    """Triton's one map of regions takes a name once, whatever its kind: a CUDA register of a
    system region's name is ALREADY_EXISTS (checked first, on a host without a GPU too), and the
    CUDA status of that name says what it is; the system region stays registered."""
    regions.make("kinds_sys", NB)
    handle = base64.b64encode(bytes(64))
    grpc = grpcclient.InferenceServerClient(shm_server.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as e:
            http.register_cuda_shared_memory("kinds_sys", handle, 0, 64)
        assert (e.value.status(), e.value.message()) == ("400", "shared memory region 'kinds_sys' already in manager")
        with pytest.raises(InferenceServerException) as e:
            grpc.register_cuda_shared_memory("kinds_sys", handle, 0, 64)
        assert e.value.status() == "StatusCode.ALREADY_EXISTS"
        assert e.value.message() == "shared memory region 'kinds_sys' already in manager"
        text = "The region named 'kinds_sys' is registered as system shared memory, not CUDA shared memory"
        raw = raw_request(shm_server.port, "GET", "/v2/cudasharedmemory/region/kinds_sys/status")
        assert (raw.status, raw.json()) == (404, {"error": text})
        with pytest.raises(InferenceServerException) as e:
            grpc.get_cuda_shared_memory_status("kinds_sys")
        assert (e.value.status(), e.value.message()) == ("StatusCode.NOT_FOUND", text)
        http.unregister_cuda_shared_memory("kinds_sys")  # no CUDA region of that name: nothing to do
        assert "kinds_sys" in status_names(shm_server)
    finally:
        grpc.close()


def test_cuda_register_refusals_start_with_tritons_words(shm_server, http):
    """A CUDA handle that cannot be opened (on a host without a GPU, any handle) is Triton's
    "failed to register shared memory region: invalid args", with the reason after it."""
    handle = base64.b64encode(bytes(64))
    grpc = grpcclient.InferenceServerClient(shm_server.grpc_url)
    try:
        for client, status in ((http, "400"), (grpc, "StatusCode.INVALID_ARGUMENT")):
            with pytest.raises(InferenceServerException) as e:
                client.register_cuda_shared_memory("cuda_words", handle, 0, 64)
            assert e.value.status() == status
            assert e.value.message().startswith("failed to register shared memory region: invalid args ("), \
                e.value.message()
    finally:
        grpc.close()
    assert http.get_cuda_shared_memory_status() == []


@pytest.mark.parametrize("body,text", [
    ({"raw_handle": {"b64": "AAAA"}, "device_id": 0, "byte_size": 64},
     "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t"),
    ({"raw_handle": {"b64": "!!"}, "device_id": 0, "byte_size": 64},
     "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t"),
    ({"raw_handle": {"b64": base64.b64encode(bytes(65)).decode()}, "device_id": 0, "byte_size": 64},
     "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t"),
    ({"raw_handle": {"b64": base64.b64encode(bytes(64)).decode()}, "byte_size": 64},
     "attempt to access non-existing object member 'device_id'"),
], ids=["short", "not_base64", "65_bytes", "no_device_id"])
def test_http_cuda_register_checks_its_request_first_with_tritons_words(shm_server, body, text):
    """Triton's HTTP frontend reads the whole request (device_id is required) and decodes the
    handle before the registry looks at it; on a host without a GPU too. (TritonJson's words
    are a 500 in Triton, a 400 here: docs/compatibility.md.)"""
    raw = raw_request(shm_server.port, "POST", "/v2/cudasharedmemory/region/cuda_req/register",
                      json.dumps(body).encode())
    assert (raw.status, raw.json()) == (400, {"error": text})


def test_http_cuda_handle_is_read_as_tritons_base64_decoder_reads_it(shm_server):
    """libb64 skips what is not base64: a handle with line breaks (base64.encodebytes) is a
    64-byte handle, which gets as far as opening it."""
    handle = base64.encodebytes(bytes(64)).decode()
    raw = raw_request(shm_server.port, "POST", "/v2/cudasharedmemory/region/cuda_lines/register",
                      json.dumps({"raw_handle": {"b64": handle}, "device_id": 0, "byte_size": 64}).encode())
    assert raw.status == 400
    assert raw.json()["error"].startswith("failed to register shared memory region: invalid args ("), raw.json()


# -- an unregister while a request uses the region ------------------------------------------------


def _status_lists(server, name: str) -> bool:
    return name in status_names(server)


def _assert_unregistered(server, http, name: str) -> None:
    """Gone (with no second unregister) once its requests are done; its name is free again."""
    wait_until(lambda: not _status_lists(server, name), f"region '{name}' unregistered")
    with pytest.raises(InferenceServerException) as e:
        http.get_system_shared_memory_status(name)
    assert f"Unable to find system shared memory region: '{name}'" in e.value.message()


def test_unregister_during_inference_waits_for_the_request(shm_server, http, regions, tmp_path):
    """Triton's test_unregister_shm_during_inference_single_req: the region stays listed while
    the request that names it runs (slow_reader reads X only after its gate opens), the request
    reads the right bytes, and then the region is gone without a second call. A region no
    request uses goes at once."""
    x = np.arange(1, 65, dtype=np.int32)
    handle, key = regions.create("defer_in", x.nbytes)
    regions.register("defer_in", key, x.nbytes)
    shm.set_shared_memory_region(handle, [x])
    regions.make("defer_idle", 16)
    gate = Gate(tmp_path / "gate")
    t, box = _infer_in_thread(shm_server, "slow_reader", [shm_input("X", "defer_in", x.nbytes, shape=[64])],
                              parameters={"sleep_s": 0, "gate": gate.param})
    try:
        gate.wait_started(1)
        http.unregister_system_shared_memory()  # all of them, as Triton's test does
        assert status_names(shm_server) == ["defer_in"]
        assert http.get_system_shared_memory_status("defer_in") == [
            {"name": "defer_in", "key": key, "offset": 0, "byte_size": x.nbytes}]
    finally:
        gate.open()
    t.join(60)
    assert not t.is_alive(), "the request hung"
    assert "result" in box, box.get("error")
    assert box["result"].as_numpy("SUM").tolist() == [int(x.sum())]
    np.testing.assert_array_equal(box["result"].as_numpy("COPY"), x)
    _assert_unregistered(shm_server, http, "defer_in")
    regions.register("defer_in", key, x.nbytes)  # the name may be registered again
    assert status_names(shm_server) == ["defer_in"]


def test_request_sent_after_the_unregister_keeps_the_region_until_it_is_done(shm_server, http, regions, tmp_path):
    """Triton's test_unregister_shm_during_inference_multiple_req: a second request names the
    region after the unregister; it is served, and the region stays listed until it is done
    too, though the first one finished."""
    x = np.arange(3, 35, dtype=np.int32)
    handle, key = regions.create("defer_two", x.nbytes)
    regions.register("defer_two", key, x.nbytes)
    shm.set_shared_memory_region(handle, [x])
    first_gate, second_gate = Gate(tmp_path / "first"), Gate(tmp_path / "second")
    inputs = [shm_input("X", "defer_two", x.nbytes, shape=[32])]
    first_t, first = _infer_in_thread(shm_server, "slow_reader", inputs,
                                      parameters={"sleep_s": 0, "gate": first_gate.param})
    second_t = None
    try:
        first_gate.wait_started(1)
        http.unregister_system_shared_memory("defer_two")
        assert status_names(shm_server) == ["defer_two"]
        second_t, second = _infer_in_thread(shm_server, "slow_reader", inputs,
                                            parameters={"sleep_s": 0, "gate": second_gate.param})
        first_gate.open()
        first_t.join(60)
        assert "result" in first, first.get("error")
        second_gate.wait_started(1)  # the first is done, the second is in the model
        assert status_names(shm_server) == ["defer_two"]
    finally:
        first_gate.open()
        second_gate.open()
    first_t.join(60)
    if second_t is not None:
        second_t.join(60)
    assert not first_t.is_alive() and second_t is not None and not second_t.is_alive(), "a request hung"
    for box in (first, second):
        assert "result" in box, box.get("error")
        assert box["result"].as_numpy("SUM").tolist() == [int(x.sum())]
        np.testing.assert_array_equal(box["result"].as_numpy("COPY"), x)
    _assert_unregistered(shm_server, http, "defer_two")
    with pytest.raises(InferenceServerException, match="Unable to find shared memory region: 'defer_two'"):
        http.infer("slow_reader", inputs, parameters={"sleep_s": 0})


# word_stream as it is (its requests go straight to the worker), and with two instances and the
# dynamic batcher (they go through the broker, which lets go of them once execute returns).
_WORD_STREAM_THROUGH_THE_BROKER = json.dumps({
    "name": "word_stream", "backend": "python", "max_batch_size": 4,
    "model_transaction_policy": {"decoupled": True},
    "input": [{"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]}],
    "output": [{"name": "text_output", "data_type": "TYPE_STRING", "dims": [1]},
               {"name": "index", "data_type": "TYPE_INT32", "dims": [1]}],
    "instance_group": [{"count": 2, "kind": "KIND_CPU"}], "dynamic_batching": {}})


@pytest.mark.parametrize("config", [None, _WORD_STREAM_THROUGH_THE_BROKER], ids=["direct", "through-the-broker"])
def test_a_stream_answered_after_execute_keeps_its_region_until_its_final_response(shm_server, http, regions,
                                                                                   config):
    """word_stream returns from execute at once and speaks from a thread, one word a second: its
    input region, unregistered after the first word, stays listed until the final response, then
    goes with no second call. The words all arrive."""
    import queue

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import serialize_byte_tensor, serialized_byte_size

    text = serialize_byte_tensor(np.array([b"one two three four"], dtype=object))
    size = serialized_byte_size(text)
    handle, key = regions.create("stream_in", size)
    regions.register("stream_in", key, size)
    shm.set_shared_memory_region(handle, [text])
    answers: queue.Queue = queue.Queue()
    http.load_model("word_stream", config=config)  # a product model this server loads only here
    client = grpcclient.InferenceServerClient(shm_server.wait_grpc_ready().grpc_url)
    try:
        client.start_stream(callback=lambda result, error: answers.put(error or result))
        inp = grpcclient.InferInput("text_input", [1] if config is None else [1, 1], "BYTES")
        inp.set_shared_memory("stream_in", size)
        client.async_stream_infer("word_stream", [inp], parameters={"delay_ms": 1000})
        first = answers.get(timeout=60)
        assert not isinstance(first, Exception), str(first)
        http.unregister_system_shared_memory("stream_in")
        assert status_names(shm_server) == ["stream_in"]  # three words still to come
        rest = [answers.get(timeout=60) for _ in range(3)]
        assert [r.as_numpy("text_output")[0] for r in [first, *rest]] == [b"one", b"two", b"three", b"four"]
        _assert_unregistered(shm_server, http, "stream_in")
    finally:
        client.stop_stream()
        client.close()
        http.unload_model("word_stream")
