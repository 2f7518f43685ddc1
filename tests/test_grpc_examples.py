"""What Triton's own gRPC client examples (simple_grpc_*.py and grpc_explicit_*.py in
triton-inference-server/client) ask of a server, checked with tritonclient.grpc and the generated
stub against examples/triton_client_models. The programs themselves were run unchanged against
this repository (see the README); these tests keep what they depend on from regressing.
"""
from __future__ import annotations

import queue
import uuid

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException, serialize_byte_tensor, serialized_byte_size

from conftest import ROOT

EXAMPLES = ROOT / "examples" / "triton_client_models"
IN0 = np.arange(16, dtype=np.int32).reshape(1, 16)
IN1 = np.ones((1, 16), dtype=np.int32)
# simple_grpc_custom_args_client.py and simple_grpc_keepalive_client.py open their channel so
KEEPALIVE_ARGS = [("grpc.max_send_message_length", 1024 * 1024), ("grpc.max_receive_message_length", 1024 * 1024),
                  ("grpc.keepalive_time_ms", 2**31 - 1), ("grpc.keepalive_timeout_ms", 20000),
                  ("grpc.keepalive_permit_without_calls", False), ("grpc.http2.max_pings_without_data", 2),
                  ("grpc.dns_enable_srv_queries", 1)]


@pytest.fixture(scope="module")
def ex_server(module_factory):
    return module_factory.start([EXAMPLES]).wait_grpc_ready()


@pytest.fixture(scope="module")
def gclient(ex_server):
    c = grpcclient.InferenceServerClient(ex_server.grpc_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def stub(ex_server):
    channel = grpc.insecure_channel(ex_server.grpc_url)
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def _inputs(datatype: str, *arrays: np.ndarray) -> list[grpcclient.InferInput]:
    inputs = []
    for i, arr in enumerate(arrays):
        t = grpcclient.InferInput(f"INPUT{i}", list(arr.shape), datatype)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    return inputs


def test_simple_with_and_without_named_outputs(gclient):
    """simple_grpc_infer_client.py (and its async and aio siblings): a request id and headers,
    outputs named and not, the model's statistics, and Triton's text for an unknown model."""
    outputs = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT1")]
    for asked in (outputs, None):
        r = gclient.infer("simple", _inputs("INT32", IN0, IN1), outputs=asked, request_id="1",
                          headers={"test": "1"})
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), IN0 + IN1)
        np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), IN0 - IN1)
        assert r.get_response().id == "1"
    stats = gclient.get_inference_statistics(model_name="simple")
    assert len(stats.model_stats) == 1 and stats.model_stats[0].name == "simple"
    with pytest.raises(InferenceServerException, match="Request for unknown model"):
        gclient.infer("wrong_model_name", _inputs("INT32", IN0, IN1))


def test_health_and_metadata(ex_server, gclient):
    """simple_grpc_health_metadata.py: liveness with headers, readiness, the server's name (the
    program wants 'triton': run the server with --id triton) and the model's metadata."""
    assert gclient.is_server_live(headers={"test": "1", "dummy": "2"})
    assert gclient.is_server_ready() and gclient.is_model_ready("simple")
    assert gclient.get_server_metadata().name == ex_server.id
    meta = gclient.get_model_metadata("simple", headers={"test": "1", "dummy": "2"})
    assert meta.name == "simple"
    with pytest.raises(InferenceServerException, match="Request for unknown model"):
        gclient.get_model_metadata("wrong_model_name")


def test_channel_with_small_message_limits_and_keepalive(ex_server):
    """simple_grpc_custom_args_client.py and simple_grpc_keepalive_client.py: a channel with 1 MiB
    message limits and keepalive settings, and custom headers on the call."""
    c = grpcclient.InferenceServerClient(ex_server.grpc_url, channel_args=KEEPALIVE_ARGS)
    try:
        r = c.infer("simple", _inputs("INT32", IN0, IN1), headers={"test": "1"})
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), IN0 + IN1)
    finally:
        c.close()


def test_strings_as_decimal_sums_and_identity(gclient):
    """simple_grpc_string_infer_client.py: BYTES inputs to simple_string, answered in decimal text,
    and simple_identity's bytes back unchanged."""
    a = np.array([[str(i).encode() for i in range(16)]], dtype=np.object_)
    b = np.array([[b"1"] * 16], dtype=np.object_)
    r = gclient.infer("simple_string", _inputs("BYTES", a, b))
    assert [int(x) for x in r.as_numpy("OUTPUT0")[0]] == [i + 1 for i in range(16)]
    assert [int(x) for x in r.as_numpy("OUTPUT1")[0]] == [i - 1 for i in range(16)]
    r = gclient.infer("simple_identity", _inputs("BYTES", a))
    assert r.as_numpy("OUTPUT0").tolist() == a.tolist()


def _typed_request(model: str, datatype: str, field: str, a: list, b: list) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model)
    for name, values in (("INPUT0", a), ("INPUT1", b)):
        t = request.inputs.add(name=name, datatype=datatype, shape=[1, 16])
        getattr(t.contents, field)[:] = values
    request.outputs.add(name="OUTPUT0")
    request.outputs.add(name="OUTPUT1")
    return request


@pytest.mark.parametrize("model,datatype,dtype", [("simple", "INT32", np.int32), ("simple_int8", "INT8", np.int8)])
def test_explicit_int_contents(stub, model, datatype, dtype):
    """grpc_explicit_int_content_client.py and grpc_explicit_int8_content_client.py: typed
    int_contents in, raw outputs back, for simple and for Triton's simple_int8."""
    a, b = list(range(16)), [1] * 16
    response = stub.ModelInfer(_typed_request(model, datatype, "int_contents", a, b))
    out = [np.frombuffer(raw, dtype=dtype) for raw in response.raw_output_contents]
    assert out[0].tolist() == [x + 1 for x in a] and out[1].tolist() == [x - 1 for x in a]


@pytest.mark.parametrize("version,text", [
    ("wrong_specification", "failed to get model version from specified version string 'wrong_specification' "
                            "(details: stol), version should be an integral value > 0"),
    ("-2", "invalid model version specified '-2' , version should be an integral value > 0")])
def test_a_version_that_is_no_number_is_refused_as_triton_refuses_it(stub, version, text):
    """grpc_explicit_int8_content_client.py ends by sending model_version 'wrong_specification' and
    looks for Triton's text, which comes before the model is looked up."""
    request = _typed_request("simple", "INT32", "int_contents", list(range(16)), [1] * 16)
    request.model_version = version
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(request)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == text


@pytest.mark.parametrize("version,text", [
    ("abc", "failed to get model version from specified version string 'abc' (details: stol), version should be "
            "an integral value > 0"),
    ("-1", "invalid model version specified '-1' , version should be an integral value > 0")])
def test_model_calls_read_the_version_first(stub, version, text):
    """ModelReady, ModelMetadata, ModelConfig and ModelStatistics refuse such a version as
    ModelInfer does, before the model is looked up (checked on Triton 2.51)."""
    from tritonclient.grpc import service_pb2

    calls = [(stub.ModelReady, service_pb2.ModelReadyRequest(name="simple", version=version)),
             (stub.ModelMetadata, service_pb2.ModelMetadataRequest(name="simple", version=version)),
             (stub.ModelConfig, service_pb2.ModelConfigRequest(name="simple", version=version)),
             (stub.ModelStatistics, service_pb2.ModelStatisticsRequest(name="", version=version))]
    for call, request in calls:
        with pytest.raises(grpc.RpcError) as e:
            call(request)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == text, call
    for version in ("1", "+1", " 1", "01", "1abc"):  # std::stol's readings of version 1
        assert stub.ModelReady(service_pb2.ModelReadyRequest(name="simple", version=version)).ready, version
        config = stub.ModelConfig(service_pb2.ModelConfigRequest(name="simple", version=version)).config
        assert config.name == "simple", version
    for version in ("\u0661", str(1 << 63)):  # not an ASCII digit; past a long
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelReady(service_pb2.ModelReadyRequest(name="simple", version=version))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "(details: stol)" in e.value.details()


def test_explicit_byte_contents(stub):
    """grpc_explicit_byte_content_client.py: typed bytes_contents to simple_string; the outputs
    come back raw, each element behind its 4-byte length."""
    a, b = [str(i).encode() for i in range(16)], [b"1"] * 16
    response = stub.ModelInfer(_typed_request("simple_string", "BYTES", "bytes_contents", a, b))
    raw = response.raw_output_contents[0]
    assert raw == serialize_byte_tensor(np.array([str(i + 1).encode() for i in range(16)], dtype=np.object_)).item()


def _sequence(gclient, seq_id, values: list[int], stream: bool, model: str = "simple_sequence") -> list[int]:
    """One sequence to ``model``, as the sequence examples send it (START on the first
    request, END on the last), its answers in order."""
    answers: queue.Queue = queue.Queue()
    if stream:
        gclient.start_stream(callback=lambda result, error: answers.put(error or result))
    results = []
    try:
        for i, v in enumerate(values):
            t = grpcclient.InferInput("INPUT", [1, 1], "INT32")
            t.set_data_from_numpy(np.array([[v]], dtype=np.int32))
            kw = dict(sequence_id=seq_id, sequence_start=i == 0, sequence_end=i == len(values) - 1,
                      request_id=f"{seq_id}_{i}")
            if stream:
                gclient.async_stream_infer(model, [t], **kw)
                r = answers.get(timeout=30)
                assert not isinstance(r, Exception), r
            else:
                r = gclient.infer(model, [t], **kw)
            results.append(int(r.as_numpy("OUTPUT")[0][0]))
    finally:
        if stream:
            gclient.stop_stream()
    return results


@pytest.mark.parametrize("stream", [False, True])
def test_sequences_with_integer_and_string_ids(gclient, stream):
    """simple_grpc_sequence_sync_infer_client.py and ..._stream_infer_client.py (and the aio
    one): integer and UUID string sequence ids, over unary calls and over one stream."""
    values = [11, 7, 5, 3, 2, 0, 1]
    for seq_id in (1000, str(uuid.uuid4())):
        assert _sequence(gclient, seq_id, values, stream) == [values[0] + 1] + values[1:]


def test_sequences_pipelined_on_one_stream_answer_in_the_order_sent(gclient):
    """simple_grpc_sequence_stream_infer_client.py (and the aio one) as they run: two sequences'
    requests interleaved and all sent before any answer is read, each answer placed by the order
    it came in. Every round pipelines them anew (the answers' order is the server's to keep)."""
    values = [11, 7, 5, 3, 2, 0, 1]
    expected = [values[0] + 1] + values[1:]
    for attempt in range(5):
        answers: queue.Queue = queue.Queue()  # (one per stream: nothing late from the one before)
        gclient.start_stream(callback=lambda result, error, answers=answers: answers.put(error or result))
        try:
            seqs = (1000 + 2 * attempt, 1001 + 2 * attempt)
            for i, v in enumerate(values):
                for seq_id in seqs:
                    t = grpcclient.InferInput("INPUT", [1, 1], "INT32")
                    t.set_data_from_numpy(np.array([[v]], dtype=np.int32))
                    gclient.async_stream_infer("simple_sequence", [t], sequence_id=seq_id, sequence_start=i == 0,
                                               sequence_end=i == len(values) - 1, request_id=f"{seq_id}_{i}")
            came: dict[int, list[int]] = {seq_id: [] for seq_id in seqs}
            for _ in range(2 * len(values)):
                r = answers.get(timeout=30)
                assert not isinstance(r, Exception), r
                came[int(r.get_response().id.split("_")[0])].append(int(r.as_numpy("OUTPUT")[0][0]))
        finally:
            gclient.stop_stream()
        assert came == {seq_id: expected for seq_id in seqs}, (attempt, came)


def test_decoupled_repeat_streams_one_response_per_element(gclient):
    """simple_grpc_custom_repeat.py: Triton's repeat_int32 answers one streamed response per
    element of IN (OUT = IN[i], IDX = i), DELAY[i] ms apart."""
    answers: queue.Queue = queue.Queue()
    gclient.start_stream(callback=lambda result, error: answers.put(error or result))
    try:
        values = np.arange(100, 105, dtype=np.int32)
        inputs = [grpcclient.InferInput("IN", [5], "INT32"), grpcclient.InferInput("DELAY", [5], "UINT32"),
                  grpcclient.InferInput("WAIT", [1], "UINT32")]
        inputs[0].set_data_from_numpy(values)
        inputs[1].set_data_from_numpy(np.full(5, 10, dtype=np.uint32))
        inputs[2].set_data_from_numpy(np.array([10], dtype=np.uint32))
        gclient.async_stream_infer("repeat_int32", inputs, outputs=[grpcclient.InferRequestedOutput("OUT")])
        got = [answers.get(timeout=30) for _ in range(5)]
    finally:
        gclient.stop_stream()
    assert not any(isinstance(r, Exception) for r in got), got
    assert [r.as_numpy("OUT").tolist() for r in got] == [[v] for v in values.tolist()]


def test_system_shared_memory_numbers_and_strings(ex_server, gclient):
    """simple_grpc_shm_client.py and simple_grpc_shm_string_client.py: inputs and outputs in
    registered regions (one region holding both inputs at offsets), region status, unregister."""
    key = f"/gex_{uuid.uuid4().hex[:8]}"
    handles = {}
    try:
        handles["in"] = shm.create_shared_memory_region("in", key + "_in", 128)
        handles["out"] = shm.create_shared_memory_region("out", key + "_out", 128)
        shm.set_shared_memory_region(handles["in"], [IN0, IN1])
        gclient.register_system_shared_memory("in", key + "_in", 128)
        gclient.register_system_shared_memory("out", key + "_out", 128)
        assert {r for r in gclient.get_system_shared_memory_status().regions} == {"in", "out"}
        inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_shared_memory("in", 64)
        inputs[1].set_shared_memory("in", 64, offset=64)
        outputs = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT1")]
        outputs[0].set_shared_memory("out", 64)
        outputs[1].set_shared_memory("out", 64, offset=64)
        r = gclient.infer("simple", inputs, outputs=outputs)
        assert r.get_output("OUTPUT0").parameters["shared_memory_region"].string_param == "out"
        np.testing.assert_array_equal(shm.get_contents_as_numpy(handles["out"], np.int32, [1, 16]), IN0 + IN1)
        np.testing.assert_array_equal(shm.get_contents_as_numpy(handles["out"], np.int32, [1, 16], offset=64),
                                      IN0 - IN1)

        a = serialize_byte_tensor(np.array([str(i).encode() for i in range(16)], dtype=np.object_))
        b = serialize_byte_tensor(np.array([b"1"] * 16, dtype=np.object_))
        size = serialized_byte_size(a) + serialized_byte_size(b)
        handles["sin"] = shm.create_shared_memory_region("sin", key + "_sin", size)
        handles["sout"] = shm.create_shared_memory_region("sout", key + "_sout", size)
        shm.set_shared_memory_region(handles["sin"], [a, b])
        gclient.register_system_shared_memory("sin", key + "_sin", size)
        gclient.register_system_shared_memory("sout", key + "_sout", size)
        inputs = [grpcclient.InferInput("INPUT0", [1, 16], "BYTES"), grpcclient.InferInput("INPUT1", [1, 16], "BYTES")]
        inputs[0].set_shared_memory("sin", serialized_byte_size(a))
        inputs[1].set_shared_memory("sin", serialized_byte_size(b), offset=serialized_byte_size(a))
        outputs = [grpcclient.InferRequestedOutput("OUTPUT0")]
        outputs[0].set_shared_memory("sout", size)
        r = gclient.infer("simple_string", inputs, outputs=outputs)
        out = r.get_output("OUTPUT0")
        sums = shm.get_contents_as_numpy(handles["sout"], np.object_, list(out.shape))
        assert [int(x) for x in sums[0]] == [i + 1 for i in range(16)]
    finally:
        gclient.unregister_system_shared_memory()
        assert len(gclient.get_system_shared_memory_status().regions) == 0
        for handle in handles.values():
            shm.destroy_shared_memory_region(handle)


def test_dyna_sequences_add_the_correlation_id_at_the_end(gclient):
    """The sequence examples with --dyna: simple_dyna_sequence (UINT64 ids) answers as
    simple_sequence plus the id on the last request; simple_string_dyna_sequence (string ids
    that hold integers) answers the running sum, plus the id on the last request."""
    values = [0, 11, 7, 1]
    for stream in (False, True):
        int_out = _sequence(gclient, 1000, values, stream, "simple_dyna_sequence")
        assert int_out == [1, 11, 7, 1 + 1000]
        str_out = _sequence(gclient, "1002", values, stream, "simple_string_dyna_sequence")
        assert str_out == [0, 11, 18, 19 + 1002]


def test_model_control_in_explicit_mode(module_factory):
    """simple_grpc_model_control.py: eight models in the index (it counts Triton's example
    repository), load and unload, a malformed override refused with 'failed to load', a JSON
    override that changes max_batch_size, a file name longer than NAME_MAX refused as Triton
    refuses it (INTERNAL, 'failed to poll from model repository') with the server still live,
    and an unknown model that fails to load."""
    s = module_factory.start([EXAMPLES], ["--model-control-mode", "explicit",
                                         "--allow-model-file-uploads"]).wait_grpc_ready()
    with grpcclient.InferenceServerClient(s.grpc_url) as c:
        assert len(c.get_model_repository_index().models) == 8
        c.load_model("simple")
        assert c.is_model_ready("simple")
        with pytest.raises(InferenceServerException, match="failed to load"):
            c.load_model("simple", config='"parameters": {"config": {{"max_batch_size": "16"}}}')
        c.load_model("simple", config='{"max_batch_size":"16"}')
        assert c.get_model_config("simple").config.max_batch_size == 16
        c.unload_model("simple")
        assert not c.is_model_ready("simple")
        with pytest.raises(InferenceServerException) as e:
            c.load_model("simple", config="{}", files={"file:" + "A" * 256: b"a"})
        assert e.value.status() == "StatusCode.INTERNAL"
        assert "failed to poll from model repository" in e.value.message()
        assert c.is_server_live()
        with pytest.raises(InferenceServerException, match="failed to load"):
            c.load_model("wrong_model_name")
