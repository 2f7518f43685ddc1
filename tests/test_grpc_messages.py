"""A ModelInferRequest read straight into the broker's descriptor (server/grpc/requests.py), with
no KServe document between: what that document used to carry must still arrive, and what
HTTP's checks refused must still be refused, with the same texts. Raw protobuf messages against
a real server."""
from __future__ import annotations

import json
import struct

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from conftest import PRODUCT_MODELS, SHM_MODELS, TEST_MODELS

NUMERIC = {"BOOL": ("bool_contents", np.bool_), "INT8": ("int_contents", np.int8),
           "INT16": ("int_contents", np.int16), "INT32": ("int_contents", np.int32),
           "INT64": ("int64_contents", np.int64), "UINT8": ("uint_contents", np.uint8),
           "UINT16": ("uint_contents", np.uint16), "UINT32": ("uint_contents", np.uint32),
           "UINT64": ("uint64_contents", np.uint64), "FP32": ("fp32_contents", np.float32),
           "FP64": ("fp64_contents", np.float64)}
MAX_ELEMENTS = 1_000_000


@pytest.fixture(scope="module")
def channel(module_factory):
    server = module_factory.start([PRODUCT_MODELS, TEST_MODELS, SHM_MODELS],
                                  ["--model-control-mode=explicit", "--load-model", "identity_all",
                                   "--load-model", "meta_echo", "--load-model", "add_sub",
                                   f"--http-max-tensor-elements={MAX_ELEMENTS}"])
    server.wait_grpc_ready()
    channel = grpc.insecure_channel(server.grpc_url)
    yield channel
    channel.close()


@pytest.fixture(scope="module")
def stub(channel):
    return service_pb2_grpc.GRPCInferenceServiceStub(channel)


def _refusal(stub, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request)
    return info.value.code(), info.value.details()


def _echo_request(**parameters) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="meta_echo", id="q1")
    request.inputs.add(name="X", datatype="INT32", shape=[2])
    request.raw_input_contents.append(np.array([1, 2], dtype=np.int32).tobytes())
    for key, (field, value) in parameters.items():
        setattr(request.parameters[key], field, value)
    return request


@pytest.mark.parametrize("datatype", sorted(NUMERIC))
def test_typed_contents_and_raw_give_the_same_answer(stub, datatype):
    field, dtype = NUMERIC[datatype]
    values = np.array([0, 1, 1, 0] if datatype == "BOOL" else [0, 1, 7, 100], dtype=dtype)
    answers = []
    for typed in (True, False):
        request = service_pb2.ModelInferRequest(model_name="identity_all")
        t = request.inputs.add(name=f"IN_{datatype}", datatype=datatype, shape=[2, 2])
        if typed:
            getattr(t.contents, field).extend(values.tolist())
        else:
            request.raw_input_contents.append(values.tobytes())
        response = stub.ModelInfer(request)
        assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == \
            [(f"OUT_{datatype}", datatype, [2, 2])]
        answers.append(response.raw_output_contents[0])
    assert answers[0] == answers[1] == values.tobytes()


def test_bytes_contents_and_raw_give_the_same_answer(stub):
    items = [b"a", b"", b"\xffz", b"long" * 50]
    raw = b"".join(len(x).to_bytes(4, "little") + x for x in items)
    answers = []
    for typed in (True, False):
        request = service_pb2.ModelInferRequest(model_name="identity_all")
        t = request.inputs.add(name="IN_BYTES", datatype="BYTES", shape=[1, 4])
        if typed:
            t.contents.bytes_contents.extend(items)
        else:
            request.raw_input_contents.append(raw)
        answers.append(stub.ModelInfer(request).raw_output_contents[0])
    assert answers == [raw, raw]


@pytest.mark.parametrize("datatype", ["FP16", "BF16"])
def test_contents_of_a_raw_only_datatype_are_refused(stub, datatype):
    request = service_pb2.ModelInferRequest(model_name="identity_all")
    t = request.inputs.add(name=f"IN_{datatype}", datatype=datatype, shape=[1, 1])
    t.contents.fp32_contents.append(1.0)
    code, details = _refusal(stub, request)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    # Triton's words (checked with reference-triton): the field given, and the datatype it is not
    assert details == f"unexpected explicit tensor data for input tensor 'IN_{datatype}' for model 'identity_all' " \
                      f"of type 'FP32', expected datatype '{datatype}'"


def test_raw_and_contents_together_are_refused_as_triton_does(stub):
    request = service_pb2.ModelInferRequest(model_name="add_sub")
    a = request.inputs.add(name="INPUT0", datatype="INT32", shape=[16])
    a.contents.int_contents.extend(range(16))
    request.inputs.add(name="INPUT1", datatype="INT32", shape=[16])
    request.raw_input_contents.append(np.zeros(16, np.int32).tobytes())
    assert _refusal(stub, request) == (grpc.StatusCode.INVALID_ARGUMENT,
                                       "contents field must not be specified when using raw_input_contents for "
                                       "'INPUT0' for model 'add_sub'")


def test_raw_contents_must_match_the_inputs_one_for_one(stub):
    request = service_pb2.ModelInferRequest(model_name="add_sub")
    request.inputs.add(name="INPUT0", datatype="INT32", shape=[16])
    request.inputs.add(name="INPUT1", datatype="INT32", shape=[16])
    request.raw_input_contents.append(np.zeros(16, np.int32).tobytes())
    assert _refusal(stub, request) == (grpc.StatusCode.INVALID_ARGUMENT,
                                       "unable to find data for input tensor 'INPUT1' for model 'add_sub' in request.")
    request.raw_input_contents.extend([np.zeros(16, np.int32).tobytes()] * 2)
    assert _refusal(stub, request) == (grpc.StatusCode.INVALID_ARGUMENT,
                                       "the request has 1 raw_input_contents that no input claims")


def test_sizes_and_shapes_are_checked(stub):
    request = service_pb2.ModelInferRequest(model_name="add_sub", id="r7")
    request.inputs.add(name="INPUT0", datatype="INT32", shape=[16])
    request.inputs.add(name="INPUT1", datatype="INT32", shape=[16])
    request.raw_input_contents.extend([np.zeros(16, np.int32).tobytes(), b"\x00" * 60])
    assert _refusal(stub, request) == (grpc.StatusCode.INVALID_ARGUMENT,
                                       "[request id: r7] input byte size mismatch for input 'INPUT1' for model "
                                       "'add_sub'. Expected 64, got 60")
    request.inputs[1].shape[:] = [-16]  # Triton's core: a shape the model does not take
    assert _refusal(stub, request) == (grpc.StatusCode.INVALID_ARGUMENT,
                                       "[request id: r7] unexpected shape for input 'INPUT1' for model 'add_sub'. "
                                       "Expected [16], got [-16]. ")
    request.inputs[1].shape[:] = [-1]  # Triton's core: a -1 where its dims are compared
    assert _refusal(stub, request) == (grpc.StatusCode.INVALID_ARGUMENT,
                                       "[request id: r7] All input dimensions should be specified for input "
                                       "'INPUT1' for model 'add_sub', got [-1]")
    request.inputs[1].shape[:] = [16]
    request.inputs[1].datatype = "INT33"
    assert _refusal(stub, request) == (grpc.StatusCode.INVALID_ARGUMENT, "input 'INPUT1': unknown datatype 'INT33'")


@pytest.mark.parametrize("datatype,shape,details", [
    ("INT8", [1, MAX_ELEMENTS + 1], f"input 'IN_INT8': shape [1, {MAX_ELEMENTS + 1}] declares more than "
                                    f"{MAX_ELEMENTS} elements (--http-max-tensor-elements)"),
    ("INT8", [0, MAX_ELEMENTS + 1], f"input 'IN_INT8': shape [0, {MAX_ELEMENTS + 1}] declares more than "
                                    f"{MAX_ELEMENTS} elements (--http-max-tensor-elements)"),
    ("INT8", [1 << 62, 4], f"invalid shape for input 'IN_INT8': shape [{1 << 62},4] causes total element count "
                           f"to exceed maximum size of {(1 << 63) - 1}"),
    ("INT64", [1 << 61, 1], f"byte size overflow for input 'IN_INT64': element count ({1 << 61}) * data type "
                            f"size (8) exceeds maximum allowed size ({(1 << 63) - 1})"),
    ("INT8", [1] * 65, "input 'IN_INT8': 'shape' has 65 dimensions, more than the 64 allowed"),
])
def test_shapes_past_the_limits_are_refused_before_any_data_is_read(stub, datatype, shape, details):
    request = service_pb2.ModelInferRequest(model_name="identity_all")
    request.inputs.add(name=f"IN_{datatype}", datatype=datatype, shape=shape)
    request.raw_input_contents.append(b"\x00")
    assert _refusal(stub, request) == (grpc.StatusCode.INVALID_ARGUMENT, details)


def test_bytes_need_a_length_prefix_per_element(stub):
    request = service_pb2.ModelInferRequest(model_name="identity_all")
    request.inputs.add(name="IN_BYTES", datatype="BYTES", shape=[1, 3])
    request.raw_input_contents.append(b"\x00\x00\x00\x00" * 2)
    assert _refusal(stub, request) == (grpc.StatusCode.INVALID_ARGUMENT,
                                       "[request id: <id_unknown>] expected 3 string elements for inference input "
                                       "'IN_BYTES' for model 'identity_all', got 2")


@pytest.mark.parametrize("shape,raw,contents,details", [  # each compared with Triton 2.51's (strid there)
    ([1, 2], struct.pack("<I", 50) + b"ab", None,
     "[request id: <id_unknown>] expected 2 string elements for inference input 'IN_BYTES' for model "
     "'identity_all', got 1"),
    ([1, 3], b"\x02\x00\x00\x00ab\x01\x00\x00\x00c", None,
     "[request id: <id_unknown>] expected 3 string elements for inference input 'IN_BYTES' for model "
     "'identity_all', got 2"),
    ([1, 3], b"\x02\x00\x00\x00ab\x01\x00", None,
     "[request id: <id_unknown>] incomplete string length indicator for inference input 'IN_BYTES' for model "
     "'identity_all', expecting 4 bytes but only 2 bytes available. Please make sure the string length indicator "
     "is in one buffer."),
    ([1, 3], None, [b"ab"],
     "[request id: <id_unknown>] expected 3 string elements for inference input 'IN_BYTES' for model "
     "'identity_all', got 1"),
    ([1, 2], b"", None,
     "[request id: <id_unknown>] expected 2 string elements for inference input 'IN_BYTES' for model "
     "'identity_all', got 0"),
    # found by the model's process, which names the input as Triton's core does
    ([1, 1], b"\x02\x00\x00\x00ab\x01\x00\x00\x00c", None,
     "[request id: <id_unknown>] unexpected number of string elements 2 for inference input 'IN_BYTES' for model "
     "'identity_all', expecting 1"),
], ids=["cut-off-element", "fewer", "cut-off-length", "contents-fewer", "empty", "more"])
def test_bytes_element_counts_are_refused_in_tritons_words(stub, shape, raw, contents, details):
    request = service_pb2.ModelInferRequest(model_name="identity_all")
    tensor = request.inputs.add(name="IN_BYTES", datatype="BYTES", shape=shape)
    if contents is None:
        request.raw_input_contents.append(raw)
    else:
        tensor.contents.bytes_contents.extend(contents)
    assert _refusal(stub, request) == (grpc.StatusCode.INVALID_ARGUMENT, details)


@pytest.mark.parametrize("field,values,datatype", [("fp32_contents", [0.0] * 16, "FP32"),
                                                   ("int64_contents", [0] * 16, "INT64"),
                                                   ("bytes_contents", [b"a"] * 16, "BYTES")])
def test_contents_in_another_datatypes_field_are_refused_in_tritons_words(stub, field, values, datatype):
    request = service_pb2.ModelInferRequest(model_name="add_sub")
    getattr(request.inputs.add(name="INPUT0", datatype="INT32", shape=[16]).contents, field).extend(values)
    request.inputs.add(name="INPUT1", datatype="INT32", shape=[16]).contents.int_contents.extend(range(16))
    assert _refusal(stub, request) == (grpc.StatusCode.INVALID_ARGUMENT,
                                       f"unexpected explicit tensor data for input tensor 'INPUT0' for model "
                                       f"'add_sub' of type '{datatype}', expected datatype 'INT32'")


def test_parameters_of_every_type_reach_the_model(stub):
    request = _echo_request(flag=("bool_param", True), count=("int64_param", -3),
                            big=("uint64_param", (1 << 64) - 1), ratio=("double_param", 0.25),
                            note=("string_param", "héllo"), priority=("uint64_param", 2),
                            sequence_id=("string_param", "ignored for a model without sequences"),
                            triton_enable_empty_final_response=("bool_param", True),
                            binary_data_output=("string_param", "x"), headers=("string_param", "h"))
    response = stub.ModelInfer(request)
    assert response.id == "q1" and response.model_name == "meta_echo" and response.model_version == "1"
    outputs = dict(zip((o.name for o in response.outputs), response.raw_output_contents))
    params = json.loads(outputs["PARAMETERS"][4:])  # one BYTES element: its length, then the text
    # As in Triton 2.51: sequence_id, priority and triton_enable_empty_final_response are the
    # server's own, and do not reach the model; binary_data_output, an HTTP word, does; headers is
    # reserved by Triton's docs, and does not.
    assert params == {"flag": True, "count": -3, "big": (1 << 64) - 1, "ratio": 0.25, "note": "héllo",
                      "binary_data_output": "x"}
    assert np.frombuffer(outputs["Y"], np.int32).tolist() == [2, 3]


@pytest.mark.parametrize("parameters,details", [  # Triton 2.51's words, but for a negative sequence_id or
    # timeout, which Triton takes (and wraps)
    ({"sequence_id": ("int64_param", -1)}, "'sequence_id' must be an unsigned 64-bit integer or a string"),
    ({"sequence_id": ("bool_param", True)},
     "invalid value type for 'sequence_id' parameter, expected int64_param or string_param."),
    ({"sequence_start": ("int64_param", 1)}, "invalid value type for 'sequence_start' parameter, expected bool_param."),
    ({"priority": ("int64_param", -2)}, "invalid value for 'priority', expected value >= 0."),
    ({"priority": ("string_param", "high")},
     "invalid value type for 'priority' parameter, expected int64_param or uint64_param."),
    ({"priority": ("double_param", 1.0)},
     "invalid value type for 'priority' parameter, expected int64_param or uint64_param."),
    ({"timeout": ("string_param", "10")}, "invalid value type for 'timeout' parameter, expected int64_param."),
    ({"timeout": ("bool_param", True)}, "invalid value type for 'timeout' parameter, expected int64_param."),
    ({"timeout": ("int64_param", -5)}, "'timeout' must be a non-negative integer"),
    ({"triton_enable_empty_final_response": ("int64_param", 1)},
     "invalid value type for 'triton_enable_empty_final_response' parameter, expected bool_param."),
])
def test_the_servers_own_parameters_are_checked(stub, parameters, details):
    assert _refusal(stub, _echo_request(**parameters)) == (grpc.StatusCode.INVALID_ARGUMENT, details)


def test_an_output_asked_twice_is_refused(stub):
    request = _echo_request()
    request.outputs.add(name="Y")
    request.outputs.add(name="Y")
    assert _refusal(stub, request) == (grpc.StatusCode.INVALID_ARGUMENT,
                                       "[request id: q1] output 'Y' already exists in request")


def test_requested_outputs_and_their_parameters(stub):
    request = _echo_request()
    request.outputs.add(name="PID")
    request.outputs.add(name="Y").parameters["binary_data"].bool_param = True
    response = stub.ModelInfer(request)
    assert [o.name for o in response.outputs] == ["Y", "PID"]  # the model's order, as Triton answers
    assert np.frombuffer(response.raw_output_contents[0], np.int32).tolist() == [2, 3]
    request.outputs[1].parameters["binary_data"].int64_param = 1
    assert _refusal(stub, request) == (grpc.StatusCode.INVALID_ARGUMENT,
                                       "output 'Y': parameter 'binary_data' must be true or false")
    request.outputs[1].parameters.clear()
    request.outputs[1].parameters["classification"].int64_param = -1  # Triton's words for these two
    assert _refusal(stub, request) == (grpc.StatusCode.INVALID_ARGUMENT,
                                       "invalid value for 'classification' parameter, expected >= 0")
    request.outputs[1].parameters["classification"].string_param = "2"
    assert _refusal(stub, request) == (grpc.StatusCode.INVALID_ARGUMENT,
                                       "invalid value type for 'classification' parameter, expected int64_param")


def test_a_stream_answers_in_one_well_formed_message_each(stub):
    requests = [_echo_request(), _echo_request()]
    requests[1].id = "q2"
    answers = list(stub.ModelStreamInfer(iter(requests)))
    assert [a.error_message for a in answers] == ["", ""]
    assert [a.infer_response.id for a in answers] == ["q1", "q2"]
    for a in answers:
        assert a.infer_response.parameters["triton_final_response"].bool_param is True
        outputs = dict(zip((o.name for o in a.infer_response.outputs), a.infer_response.raw_output_contents))
        assert np.frombuffer(outputs["Y"], np.int32).tolist() == [2, 3]


# -- large messages: raw tensors read as views of the received bytes (read_infer_request) --------

def test_a_large_message_keeps_every_raw_tensor_in_order(stub):
    big = (np.arange(300_000, dtype=np.int64) * 7).reshape(1, -1)
    small = np.array([[1, 2, 3]], dtype=np.int16)
    request = service_pb2.ModelInferRequest(model_name="identity_all", id="big")
    request.inputs.add(name="IN_INT64", datatype="INT64", shape=list(big.shape))
    request.inputs.add(name="IN_INT16", datatype="INT16", shape=list(small.shape))
    request.raw_input_contents.extend([big.tobytes(), small.tobytes()])
    request.parameters["note"].string_param = "kept"
    response = stub.ModelInfer(request)
    assert response.id == "big"
    outputs = dict(zip((o.name for o in response.outputs), response.raw_output_contents))
    assert outputs == {"OUT_INT64": big.tobytes(), "OUT_INT16": small.tobytes()}
    answers = list(stub.ModelStreamInfer(iter([request])))
    assert answers[0].error_message == ""
    assert list(answers[0].infer_response.raw_output_contents) == [big.tobytes(), small.tobytes()]


def test_a_large_message_with_raw_and_contents_is_refused(stub):
    request = service_pb2.ModelInferRequest(model_name="identity_all")
    t = request.inputs.add(name="IN_INT32", datatype="INT32", shape=[1, 4])
    t.contents.int_contents.extend([1, 2, 3, 4])
    request.inputs.add(name="IN_UINT8", datatype="UINT8", shape=[1, 100_000])
    request.raw_input_contents.append(b"\x01" * 100_000)
    assert _refusal(stub, request) == (grpc.StatusCode.INVALID_ARGUMENT,
                                       "contents field must not be specified when using raw_input_contents for "
                                       "'IN_INT32' for model 'identity_all'")


@pytest.mark.parametrize("cut", [1, 10, 99_990])
def test_a_truncated_large_message_is_invalid(channel, cut):
    request = service_pb2.ModelInferRequest(model_name="identity_all")
    request.inputs.add(name="IN_UINT8", datatype="UINT8", shape=[1, 100_000])
    request.raw_input_contents.append(b"\x01" * 100_000)
    data = request.SerializeToString()[:-cut]
    call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # bytes as they are
    with pytest.raises(grpc.RpcError) as info:
        call(data, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "the request is not a valid inference.ModelInferRequest message"


_LOG = service_pb2.LogSettingsRequest.SettingValue
_TRACE = service_pb2.TraceSettingRequest.SettingValue


@pytest.mark.parametrize("settings,details", [  # each compared with Triton 2.51's
    ({"log_info": _LOG(string_param="yes")}, "expect boolean for 'log_info'"),
    ({"log_error": _LOG(uint32_param=0)}, "expect boolean for 'log_error'"),
    ({"log_verbose_level": _LOG(bool_param=True)}, "expect int32 for 'log_verbose_level'"),
    ({"log_verbose_level": _LOG(string_param="1")}, "expect int32 for 'log_verbose_level'"),
    ({"log_format": _LOG(bool_param=True)}, "expect string for 'log_format'"),
    ({"log_format": _LOG(string_param="xml")}, "invalid argument for log_format, got: xml"),
])
def test_log_settings_of_the_wrong_type_are_refused_in_tritons_words(stub, settings, details):
    with pytest.raises(grpc.RpcError) as info:
        stub.LogSettings(service_pb2.LogSettingsRequest(settings=settings))
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, details)


@pytest.mark.parametrize("key,values,details", [  # each compared with Triton 2.51's
    ("trace_rate", ["abc"], "Unable to parse 'trace_rate', got: abc"),
    ("trace_count", ["x1"], "Unable to parse 'trace_count', got: x1"),
    ("log_frequency", ["abc"], "Unable to parse 'log_frequency', got: abc"),
    ("trace_rate", ["1", "2"], "expect only 1 value for 'trace_rate'"),
])
def test_trace_numbers_that_are_not_numbers_are_refused_in_tritons_words(stub, key, values, details):
    with pytest.raises(grpc.RpcError) as info:
        stub.TraceSetting(service_pb2.TraceSettingRequest(settings={key: _TRACE(value=values)}))
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, details)
