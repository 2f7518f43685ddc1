"""The gRPC frontend against a real server with tritonclient.grpc: every RPC served, inference
with raw and typed tensors, a 100 MiB tensor and through shared memory, cancelled calls, and
Triton's status codes for errors."""
from __future__ import annotations

import base64
import queue

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from conftest import PRODUCT_MODELS, TEST_MODELS, TESTS, wait_until
from gates import Gate
from shmserve.workers.devices import cuda_device_count

MODELS = ["add_sub", "identity_all", "word_stream", "held", "final_with_last", "error_end"]
CANCEL_MODELS = TESTS / "models" / "cancel"
FINAL_FLAG_MODELS = TESTS / "models" / "final_flag"


@pytest.fixture(scope="module")
def gserver(module_factory):
    args = ["--model-control-mode=explicit"]
    for m in MODELS:
        args += ["--load-model", m]
    return module_factory.start([PRODUCT_MODELS, TEST_MODELS, CANCEL_MODELS, FINAL_FLAG_MODELS], args)


@pytest.fixture(scope="module")
def gclient(gserver):
    c = grpcclient.InferenceServerClient(gserver.grpc_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def stub(gserver):
    channel = grpc.insecure_channel(gserver.grpc_url)
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def _add_sub_inputs(a: np.ndarray, b: np.ndarray) -> list:
    inputs = [grpcclient.InferInput("INPUT0", [16], "INT32"), grpcclient.InferInput("INPUT1", [16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs


def _error(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


# -- health and metadata ------------------------------------------------------------------------

def test_grpc_accepts_connections_once_http_says_ready(server_factory, tmp_path):
    """A readiness probe over HTTP (a load balancer's, a test's) vouches for the gRPC port too:
    with no model to load the broker is ready at once, before gRPC's imports are done."""
    server = server_factory.start([tmp_path], ["--model-control-mode=explicit"])
    with grpc.insecure_channel(server.grpc_url) as channel:  # no retries: one try, now
        health = health_pb2_grpc.HealthStub(channel)
        answer = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    log = server.log()  # Triton's order: the HTTP frontend starts once gRPC listens
    assert log.index("] serving gRPC on") < log.index("] frontend #0 serving HTTP")


def test_health_and_readiness(gserver, gclient):
    assert gclient.is_server_live()
    assert gclient.is_server_ready()
    assert gclient.is_model_ready("add_sub")
    assert not gclient.is_model_ready("no_such_model")
    with grpc.insecure_channel(gserver.grpc_url) as channel:
        # Any service name, as Triton answers it (a probe's ``service:`` naming anything passes)
        for service in ("", "inference.GRPCInferenceService", "triton"):
            check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))
            assert check.status == health_pb2.HealthCheckResponse.SERVING, service


def test_server_and_model_metadata_match_http(gserver, gclient):
    meta = gclient.get_server_metadata()
    http = gserver.client().get_server_metadata()
    assert meta.name == gserver.id == http["name"]
    assert list(meta.extensions) == http["extensions"]
    model = gclient.get_model_metadata("add_sub", as_json=True)
    assert model["name"] == "add_sub" and model["versions"] == ["1"]
    assert [(t["name"], t["datatype"], t["shape"]) for t in model["inputs"]] == \
        [("INPUT0", "INT32", ["16"]), ("INPUT1", "INT32", ["16"])]


def test_model_config_is_the_protobuf(gclient):
    config = gclient.get_model_config("add_sub").config
    assert config.name == "add_sub" and config.backend == "python"
    assert [(i.name, list(i.dims)) for i in config.input] == [("INPUT0", [16]), ("INPUT1", [16])]
    assert config.input[0].data_type == grpcclient.model_config_pb2.TYPE_INT32
    decoupled = gclient.get_model_config("word_stream").config
    assert decoupled.model_transaction_policy.decoupled
    assert config.default_model_filename == "model.py" and config.optimization.input_pinned_memory.enable


def test_statistics_count_grpc_inferences(gclient):
    a = np.arange(16, dtype=np.int32)
    gclient.infer("add_sub", _add_sub_inputs(a, a))
    stats = gclient.get_inference_statistics("add_sub", as_json=True)["model_stats"]
    assert stats[0]["name"] == "add_sub" and int(stats[0]["inference_count"]) >= 1
    assert int(stats[0]["inference_stats"]["success"]["count"]) >= 1


def test_repository_index_load_and_unload(gclient):
    index = {m.name: m for m in gclient.get_model_repository_index().models}
    assert index["add_sub"].state == "READY"
    assert "digits" in index and index["digits"].state == ""
    gclient.unload_model("identity_all")
    assert not gclient.is_model_ready("identity_all")
    gclient.load_model("identity_all")
    assert gclient.is_model_ready("identity_all")
    err = _error(lambda: gclient.load_model("no_such_model"))
    assert err.status() == "StatusCode.INTERNAL"  # as Triton: its repository poll failed
    assert err.message() == "failed to load 'no_such_model', failed to poll from model repository"


def test_log_and_trace_settings(gclient):
    settings = gclient.get_log_settings(as_json=True)["settings"]
    assert "log_info" in settings and "log_verbose_level" in settings
    changed = gclient.update_log_settings({"log_verbose_level": 1}, as_json=True)["settings"]
    assert int(changed["log_verbose_level"]["uint32_param"]) == 1
    gclient.update_log_settings({"log_verbose_level": 0})
    trace = gclient.get_trace_settings(as_json=True)["settings"]
    assert trace["trace_level"]["value"] == ["OFF"]


# -- inference ----------------------------------------------------------------------------------

def test_add_sub_raw(gclient):
    a = np.arange(16, dtype=np.int32)
    b = np.full(16, 3, dtype=np.int32)
    result = gclient.infer("add_sub", _add_sub_inputs(a, b), request_id="r1",
                           outputs=[grpcclient.InferRequestedOutput("OUTPUT0"),
                                    grpcclient.InferRequestedOutput("OUTPUT1")])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    response = result.get_response()
    assert response.id == "r1" and response.model_name == "add_sub" and response.model_version == "1"


def test_add_sub_typed_contents(stub):
    request = service_pb2.ModelInferRequest(model_name="add_sub")
    for name, values in (("INPUT0", range(16)), ("INPUT1", [2] * 16)):
        t = request.inputs.add(name=name, datatype="INT32", shape=[16])
        t.contents.int_contents.extend(values)
    response = stub.ModelInfer(request)
    out = {o.name: np.frombuffer(raw, dtype=np.int32) for o, raw in zip(response.outputs,
                                                                        response.raw_output_contents)}
    np.testing.assert_array_equal(out["OUTPUT0"], np.arange(16) + 2)
    np.testing.assert_array_equal(out["OUTPUT1"], np.arange(16) - 2)


def test_a_request_parameter_with_no_value_is_refused_in_tritons_words(stub):
    request = service_pb2.ModelInferRequest(model_name="add_sub")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="INT32", shape=[16]).contents.int_contents.extend(range(16))
    request.parameters["foo"].SetInParent()  # an InferParameter with none of its values set
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(request)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == "invalid value type for 'foo' parameter, expected int64_param, bool_param, or " \
                                "string_param."


@pytest.mark.parametrize("datatype,field,values,dtype", [
    ("BOOL", "bool_contents", [True, False, True, True], np.bool_),
    ("INT8", "int_contents", [-128, 0, 5, 127], np.int8),
    ("UINT16", "uint_contents", [0, 1, 65535, 7], np.uint16),
    ("INT64", "int64_contents", [-(1 << 63), 0, 1, (1 << 63) - 1], np.int64),
    ("UINT64", "uint64_contents", [0, 1, (1 << 64) - 1, 9], np.uint64),
    ("FP32", "fp32_contents", [0.5, -1.25, 3.0, 1e30], np.float32),
    ("FP64", "fp64_contents", [0.1, -2.5, 1e300, 0.0], np.float64),
])
def test_typed_contents_every_numeric_datatype(stub, datatype, field, values, dtype):
    request = service_pb2.ModelInferRequest(model_name="identity_all")
    t = request.inputs.add(name=f"IN_{datatype}", datatype=datatype, shape=[2, 2])
    getattr(t.contents, field).extend(values)
    response = stub.ModelInfer(request)
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [(f"OUT_{datatype}", datatype, [2, 2])]
    np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], dtype=dtype),
                                  np.array(values, dtype=dtype))


def test_typed_bytes_contents(gclient, stub):
    request = service_pb2.ModelInferRequest(model_name="identity_all")
    t = request.inputs.add(name="IN_BYTES", datatype="BYTES", shape=[1, 3])
    t.contents.bytes_contents.extend([b"a", b"", b"\xffz"])
    response = stub.ModelInfer(request)
    result = grpcclient.InferResult(response)
    assert result.as_numpy("OUT_BYTES").tolist() == [[b"a", b"", b"\xffz"]]


def test_a_100_mib_tensor_round_trip(gclient):
    n = 100 << 20
    data = (np.arange(n, dtype=np.uint32) % 251).astype(np.uint8).reshape(1, n)
    inp = grpcclient.InferInput("IN_UINT8", [1, n], "UINT8")
    inp.set_data_from_numpy(data)
    result = gclient.infer("identity_all", [inp], outputs=[grpcclient.InferRequestedOutput("OUT_UINT8")])
    out = result.as_numpy("OUT_UINT8")
    assert out.shape == (1, n) and np.array_equal(out, data)


def _held_input(x: int) -> list:
    inp = grpcclient.InferInput("X", [1], "INT32")
    inp.set_data_from_numpy(np.array([x], np.int32))
    return [inp]


def test_a_cancelled_call_cancels_its_request_and_the_server_serves_on(gclient, tmp_path):
    """``held`` runs until its gate opens or its request is cancelled; a cancelled one leaves
    ``saw-cancel-<request id>`` in the gate's folder."""
    gate = Gate(tmp_path / "gate")
    answers: queue.Queue = queue.Queue()
    call = gclient.async_infer("held", _held_input(1), lambda result, error: answers.put((result, error)),
                               request_id="cancel-me", parameters={"gate": gate.param})
    gate.wait_started(1)
    call.cancel()
    result, error = answers.get(timeout=60)
    assert result is None and error.status() == "StatusCode.CANCELLED"
    wait_until(lambda: (gate.folder / "saw-cancel-cancel-me").exists(), "the model saw the call's cancel")
    gate.open()
    answer = gclient.infer("held", _held_input(2), request_id="next", parameters={"gate": gate.param})
    assert answer.as_numpy("Y").tolist() == [2]
    assert len(gate.started()) == 2 and not (gate.folder / "saw-cancel-next").exists()


def test_parameters_and_sequence_fields_reach_the_server(gclient):
    a = np.ones(16, dtype=np.int32)
    result = gclient.infer("add_sub", _add_sub_inputs(a, a), priority=1, timeout=10_000_000,
                           parameters={"note": "x"})
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)


def test_system_shared_memory_inference(gserver, gclient):
    a = np.arange(16, dtype=np.int32)
    b = np.full(16, 5, dtype=np.int32)
    key = f"/grpc_test_{gserver.id}"
    handle = shm.create_shared_memory_region("grpc_region", key, 128)
    try:
        shm.set_shared_memory_region(handle, [a, b])
        gclient.register_system_shared_memory("grpc_region", key, 128)
        status = gclient.get_system_shared_memory_status(as_json=True)["regions"]
        assert status["grpc_region"]["key"] == key and int(status["grpc_region"]["byte_size"]) == 128
        inputs = [grpcclient.InferInput("INPUT0", [16], "INT32"), grpcclient.InferInput("INPUT1", [16], "INT32")]
        inputs[0].set_shared_memory("grpc_region", 64, 0)
        inputs[1].set_shared_memory("grpc_region", 64, 64)
        out0 = grpcclient.InferRequestedOutput("OUTPUT0")
        out0.set_shared_memory("grpc_region", 64, 0)  # the answer overwrites INPUT0's bytes
        out1 = grpcclient.InferRequestedOutput("OUTPUT1")
        result = gclient.infer("add_sub", inputs, outputs=[out0, out1])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
        assert result.get_output("OUTPUT0").parameters["shared_memory_region"].string_param == "grpc_region"
        np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.int32, [16], 0), a + b)
        # Triton's codes (checked on Triton 2.51): a name registered already, a region nobody registered
        err = _error(lambda: gclient.register_system_shared_memory("grpc_region", key, 128))
        assert err.status() == "StatusCode.ALREADY_EXISTS"
        assert err.message() == "shared memory region 'grpc_region' already in manager"
        err = _error(lambda: gclient.register_system_shared_memory("grpc_region2", key, 64, 64))  # its key again
        assert (err.status(), err.message()) == ("StatusCode.INTERNAL", f"Invalid shared memory region: '{key}'")
        missing = f"/grpc_missing_{gserver.id}"  # a key with no object: Triton's INTERNAL
        err = _error(lambda: gclient.register_system_shared_memory("grpc_missing", missing, 64))
        assert (err.status(), err.message()) == ("StatusCode.INTERNAL",
                                                 f"Unable to open shared memory region: '{missing}'")
        inputs[0].set_shared_memory("no_such_region", 64, 0)
        err = _error(lambda: gclient.infer("add_sub", inputs))
        assert (err.status(), err.message()) == ("StatusCode.NOT_FOUND",
                                                 "Unable to find shared memory region: 'no_such_region'")
        gclient.unregister_system_shared_memory("grpc_region")
        assert gclient.get_system_shared_memory_status(as_json=True).get("regions", {}) == {}
        err = _error(lambda: gclient.get_system_shared_memory_status("grpc_region"))
        assert err.status() == "StatusCode.NOT_FOUND"
        assert err.message() == "Unable to find system shared memory region: 'grpc_region'"
    finally:
        shm.destroy_shared_memory_region(handle)


def test_cuda_shared_memory_status_and_unregister(gclient):
    assert gclient.get_cuda_shared_memory_status(as_json=True).get("regions", {}) == {}
    gclient.unregister_cuda_shared_memory()


def test_cuda_registration_that_cannot_be_served_is_refused_as_over_http(gserver, gclient):
    """A handle that is no CUDA IPC handle (64 zero bytes; on a host without a device, any
    handle): the same message as HTTP's 400, with INVALID_ARGUMENT."""
    why = "no CUDA device" if cuda_device_count() == 0 else "failed to open CUDA IPC handle"
    handle = base64.b64encode(bytes(64))  # tritonclient takes the handle base64-encoded on both protocols
    http_err = _error(lambda: gserver.client().register_cuda_shared_memory("cuda_r", handle, 0, 1024))
    err = _error(lambda: gclient.register_cuda_shared_memory("cuda_r", handle, 0, 1024))
    assert http_err.status() == "400" and err.status() == "StatusCode.INVALID_ARGUMENT"
    assert why in err.message() and err.message() == http_err.message()
    assert gclient.get_cuda_shared_memory_status(as_json=True).get("regions", {}) == {}


# -- errors -------------------------------------------------------------------------------------

def test_unknown_model_is_not_found_with_the_http_message(gserver, gclient):
    a = np.arange(16, dtype=np.int32)
    err = _error(lambda: gclient.infer("no_such_model", _add_sub_inputs(a, a)))
    assert err.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(Exception) as http_err:
        gserver.client().get_model_metadata("no_such_model")
    assert err.message() == http_err.value.message()
    for call in (lambda: gclient.get_model_metadata("no_such_model"),
                 lambda: gclient.get_model_config("no_such_model")):
        assert _error(call).status() == "StatusCode.NOT_FOUND"


def test_bad_input_is_invalid_argument(gclient):
    inputs = [grpcclient.InferInput("INPUT0", [16], "INT32"), grpcclient.InferInput("INPUT1", [16], "INT32")]
    inputs[0].set_data_from_numpy(np.zeros(16, dtype=np.int32))
    inputs[1].set_data_from_numpy(np.zeros(16, dtype=np.int32))
    inputs[1]._raw_content = b"\0" * 12  # fewer bytes than the shape declares
    err = _error(lambda: gclient.infer("add_sub", inputs))
    assert err.status() == "StatusCode.INVALID_ARGUMENT"
    assert "input byte size mismatch for input 'INPUT1' for model 'add_sub'. Expected 64, got 12" in err.message()
    wrong = [grpcclient.InferInput("NOPE", [16], "INT32")]
    wrong[0].set_data_from_numpy(np.zeros(16, dtype=np.int32))
    assert _error(lambda: gclient.infer("add_sub", wrong)).status() == "StatusCode.INVALID_ARGUMENT"


def test_model_infer_on_a_decoupled_model_is_unimplemented(gclient):
    t = grpcclient.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([b"a b"], dtype=np.object_))
    err = _error(lambda: gclient.infer("word_stream", [t]))
    assert err.status() == "StatusCode.UNIMPLEMENTED"
    assert err.message() == "ModelInfer RPC doesn't support models with decoupled transaction policy"


# -- streaming ----------------------------------------------------------------------------------

def _stream(gserver, requests: list[tuple[str, list, dict]]) -> list:
    """Send each (model, inputs, keyword arguments) on one stream; the results and errors that
    came back, in order, once the stream is closed (which waits for every answer)."""
    import queue

    got: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(gserver.grpc_url) as c:
        c.start_stream(callback=lambda result, error: got.put(error if error is not None else result))
        for model, inputs, kw in requests:
            c.async_stream_infer(model, inputs, **kw)
        c.stop_stream()
    return [got.get_nowait() for _ in range(got.qsize())]


def _words(text: str) -> list:
    t = grpcclient.InferInput("text_input", [1], "BYTES")
    t.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
    return [t]


def test_stream_a_decoupled_model(gserver):
    results = _stream(gserver, [("word_stream", _words("one two three"), {"enable_empty_final_response": True})])
    assert all(not isinstance(r, Exception) for r in results), results
    words = [r.as_numpy("text_output").tolist() for r in results[:-1]]
    assert words == [[b"one"], [b"two"], [b"three"]]
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r in results]
    assert finals == [False, False, False, True]
    assert len(results[-1].get_response().outputs) == 0  # the empty final response asked for


@pytest.mark.parametrize("version", ["", "1", "+1"])
def test_the_empty_final_response_names_the_version_as_requested(gserver, version):
    """As Triton 2.51 (checked with reference-triton): the empty final response carries the
    request's id, model name and ``model_version`` as the request spelled them ("+1" stays "+1"),
    as an error response does; the responses with outputs name the version that served."""
    results = _stream(gserver, [("word_stream", _words("one"),
                                 {"model_version": version, "request_id": "r", "enable_empty_final_response": True})])
    responses = [r.get_response() for r in results]
    assert [(r.id, r.model_name, r.model_version, len(r.outputs)) for r in responses] == \
        [("r", "word_stream", "1", 2), ("r", "word_stream", version, 0)]


def test_an_empty_final_response_asked_for_with_another_type_is_refused(gserver):
    """Triton's in-stream refusal (checked on 2.51): the flag must be a bool_param; a string
    "false" turned the empty final response on. The request does not run; the stream goes on."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    def request(text: str, request_id: str) -> service_pb2.ModelInferRequest:
        r = service_pb2.ModelInferRequest(model_name="word_stream", id=request_id)
        t = r.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        t.contents.bytes_contents.append(text.encode())
        return r

    refused = request("one", "r1")
    refused.parameters["triton_enable_empty_final_response"].string_param = "false"  # (tritonclient refuses it)
    with grpc.insecure_channel(gserver.grpc_url) as channel:
        answers = list(service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(
            iter([refused, request("two", "r2")]), timeout=60))
    assert answers[0].error_message == ("invalid value type for 'triton_enable_empty_final_response' parameter, "
                                        "expected bool_param.")
    assert answers[0].infer_response.id == "r1"
    assert [a.infer_response.id for a in answers[1:]] == ["r2"] and not any(a.error_message for a in answers[1:])


def test_a_response_sent_with_the_final_flag_is_the_final_one(gserver):
    """As Triton: the response a model sends together with the final flag carries
    ``triton_final_response`` true, and no empty response follows it, asked for or not (a client
    that reads until the final one saw none before, or an extra empty one)."""
    x = grpcclient.InferInput("IN", [1], "FP32")
    x.set_data_from_numpy(np.array([1.0], np.float32))
    for empty_final in (True, False):
        results = _stream(gserver, [("final_with_last", [x], {"enable_empty_final_response": empty_final})])
        assert all(not isinstance(r, Exception) for r in results), results
        assert [r.as_numpy("OUT").tolist() for r in results] == [[1.0], [2.0]]
        assert [r.get_response().parameters["triton_final_response"].bool_param for r in results] == [False, True]


def test_an_error_sent_with_the_final_flag_ends_the_request(gserver):
    """As Triton 2.51 (checked with reference-triton): an error response sent together with the
    final flag comes as the stream's error message and nothing follows it, even with
    ``enable_empty_final_response`` (an extra empty final response came after it); an error sent
    before a separate final flag is followed by the empty final response when it is asked for."""
    x = grpcclient.InferInput("IN", [1], "FP32")
    x.set_data_from_numpy(np.array([1.0], np.float32))
    for empty_final in (True, False):
        for apart in (False, True):
            results = _stream(gserver, [("error_end", [x], {"enable_empty_final_response": empty_final,
                                                             "parameters": {"final_apart": apart}})])
            assert results[0].as_numpy("OUT").tolist() == [1.0]
            assert isinstance(results[1], InferenceServerException) and "the stream broke" in results[1].message()
            empty_after = results[2:]
            if apart and empty_final:
                assert len(empty_after) == 1 and len(empty_after[0].get_response().outputs) == 0, results
                assert empty_after[0].get_response().parameters["triton_final_response"].bool_param
            else:
                assert empty_after == [], (apart, empty_final, results)


def test_stream_without_empty_final_and_a_plain_model(gserver):
    a = np.arange(16, dtype=np.int32)
    results = _stream(gserver, [("word_stream", _words("x y"), {}), ("add_sub", _add_sub_inputs(a, a), {})])
    # (requests on a stream run side by side: the two requests' answers may interleave)
    words = [r for r in results if r.get_output("text_output") is not None]
    plain, = [r for r in results if r.get_output("OUTPUT0") is not None]
    assert [r.as_numpy("text_output").tolist() for r in words] == [[b"x"], [b"y"]]
    np.testing.assert_array_equal(plain.as_numpy("OUTPUT0"), a + a)
    assert plain.get_response().parameters["triton_final_response"].bool_param


def test_stream_errors_come_as_error_messages(gserver):
    a = np.arange(16, dtype=np.int32)
    results = _stream(gserver, [("no_such_model", _add_sub_inputs(a, a), {}), ("add_sub", _add_sub_inputs(a, a), {})])
    error, = [r for r in results if isinstance(r, InferenceServerException)]
    answer, = [r for r in results if not isinstance(r, InferenceServerException)]
    assert "no_such_model" in error.message()
    np.testing.assert_array_equal(answer.as_numpy("OUTPUT1"), a - a)


def test_a_stream_error_names_its_request(stub):
    """As Triton 2.51 (checked with reference-triton on the same requests): beside a stream's
    error_message comes an infer_response that names the request. Refused before it ran: the id
    alone; an error answer of the model: the id, the model's name and version as requested, and
    ``triton_final_response``. A message that is not a request has nothing to name."""
    def add_sub(request_id: str, first_bytes: int = 64) -> service_pb2.ModelInferRequest:
        r = service_pb2.ModelInferRequest(model_name="add_sub", id=request_id)
        for name in ("INPUT0", "INPUT1"):
            r.inputs.add(name=name, datatype="INT32", shape=[16])
        r.raw_input_contents.extend([b"\0" * first_bytes, b"\0" * 64])
        return r

    broken = service_pb2.ModelInferRequest(model_name="error_end", id="ee")
    broken.inputs.add(name="IN", datatype="FP32", shape=[1])
    broken.raw_input_contents.append(np.array([2.0], np.float32).tobytes())
    requests = [add_sub("bad", 60), service_pb2.ModelInferRequest(model_name="no_such_model", id="nm"), broken,
                add_sub("ok")]
    messages = list(stub.ModelStreamInfer(iter(requests), timeout=60))
    by_id: dict[str, list] = {}  # (requests on a stream run side by side: each one's messages in order)
    for m in messages:
        by_id.setdefault(m.infer_response.id, []).append(m)
    assert sorted(by_id) == ["bad", "ee", "nm", "ok"] and len(messages) == 5, messages
    bad, = by_id["bad"]
    assert bad.error_message.startswith("[request id: bad] input byte size mismatch"), bad
    assert bad.infer_response == service_pb2.ModelInferResponse(id="bad")
    nm, = by_id["nm"]
    assert nm.error_message.startswith("Request") and nm.infer_response == service_pb2.ModelInferResponse(id="nm")
    response, error = by_id["ee"]  # its response, then its error
    assert not response.error_message and error.error_message == "the stream broke"
    error_head = service_pb2.ModelInferResponse(id="ee", model_name="error_end")
    error_head.parameters["triton_final_response"].bool_param = True
    assert error.infer_response == error_head
    ok, = by_id["ok"]
    assert not ok.error_message


def _bad_add_sub_inputs() -> list:
    inputs = _add_sub_inputs(np.zeros(16, dtype=np.int32), np.zeros(16, dtype=np.int32))
    inputs[1]._raw_content = b"\0" * 12  # fewer bytes than the shape declares
    return inputs


@pytest.mark.parametrize("model, inputs, status", [
    ("no_such_model", lambda: _add_sub_inputs(np.zeros(16, np.int32), np.zeros(16, np.int32)), "StatusCode.NOT_FOUND"),
    ("add_sub", _bad_add_sub_inputs, "StatusCode.INVALID_ARGUMENT"),
])
def test_triton_grpc_error_header_ends_the_stream_with_the_status(gserver, model, inputs, status):
    import queue

    got: queue.Queue = queue.Queue()
    a = np.arange(16, dtype=np.int32)
    with grpcclient.InferenceServerClient(gserver.grpc_url) as c:
        c.start_stream(callback=lambda result, error: got.put(error if error is not None else result),
                       headers={"triton_grpc_error": "true"})
        c.async_stream_infer("add_sub", _add_sub_inputs(a, a))
        np.testing.assert_array_equal(got.get(timeout=30).as_numpy("OUTPUT0"), a + a)
        c.async_stream_infer(model, inputs())
        err = got.get(timeout=30)
        assert isinstance(err, InferenceServerException)
        assert err.status() == status
        plain = _stream(gserver, [(model, inputs(), {})])[0]
        assert err.message() == plain.message() and plain.status() is None
        with pytest.raises(InferenceServerException, match="no longer in valid state"):
            c.async_stream_infer("add_sub", _add_sub_inputs(a, a))
        c.stop_stream()
    assert got.empty()
