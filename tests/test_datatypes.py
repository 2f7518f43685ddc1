"""Every Triton datatype through the identity_all Python model, in JSON and in binary mode.

Values include each type's extremes; they must come back bit for bit.
"""
from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import triton_to_np_dtype

from conftest import raw_request


def _ints(dtype) -> np.ndarray:
    info = np.iinfo(dtype)
    return np.array([[info.min, info.max, 0], [1, info.max - 1, info.min + 1]], dtype=dtype)


VALUES: dict[str, np.ndarray] = {
    "BOOL": np.array([[True, False, True], [False, False, True]], dtype=np.bool_),
    "UINT8": _ints(np.uint8),
    "UINT16": _ints(np.uint16),
    "UINT32": _ints(np.uint32),
    "UINT64": _ints(np.uint64),
    "INT8": _ints(np.int8),
    "INT16": _ints(np.int16),
    "INT32": _ints(np.int32),
    "INT64": _ints(np.int64),
    "FP16": np.array([[0.0, -2.5, 65504.0], [np.finfo(np.float16).tiny, -0.0, 0.333251953125]], dtype=np.float16),
    "FP32": np.array([[np.float32(0.1), np.finfo(np.float32).max, -np.finfo(np.float32).max],
                      [np.float32(1e-45), -0.0, np.float32(-123.456)]], dtype=np.float32),
    "FP64": np.array([[0.1, np.finfo(np.float64).max, -np.finfo(np.float64).max],
                      [5e-324, -0.0, 2.0 ** -1022]], dtype=np.float64),
    "BYTES": np.array([[b"hello", b"", "h\u00e9llo w\u00f6rld".encode()],
                       ["\u65e5\u672c\u8a9e".encode(), b"with space", b"{\"json\": [1, 2]}"]], dtype=np.object_),
}
# Binary mode can carry any bytes, including NUL and invalid UTF-8.
BINARY_BYTES = np.array([[b"\x00\x01\x02", b"\xff\xfe not utf-8", b""],
                         [b"a" * 1000, b"\x00", b"end"]], dtype=np.object_)
BF16 = np.array([[1.0, -2.0, 0.5], [3.140625, -0.0, 65280.0]], dtype=ml_dtypes.bfloat16)

DTYPES = list(VALUES)


def _roundtrip(client, datatype: str, data: np.ndarray, binary: bool):
    inp = httpclient.InferInput(f"IN_{datatype}", list(data.shape), datatype)
    inp.set_data_from_numpy(data, binary_data=binary)
    out = httpclient.InferRequestedOutput(f"OUT_{datatype}", binary_data=binary)
    return client.infer("identity_all", [inp], outputs=[out])


def _assert_same(datatype: str, got: np.ndarray, want: np.ndarray) -> None:
    assert got is not None
    assert list(got.shape) == list(want.shape)
    if datatype == "BYTES":
        as_bytes = [x if isinstance(x, bytes) else str(x).encode() for x in got.reshape(-1)]
        assert as_bytes == list(want.reshape(-1))
    elif want.dtype.kind == "f" or datatype == "BF16":
        # Bit for bit: -0.0 stays -0.0, denormals survive.
        width = {2: np.uint16, 4: np.uint32, 8: np.uint64}[want.dtype.itemsize]
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.ascontiguousarray(got).view(width), want.view(width))
    else:
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("datatype", DTYPES)
def test_binary_roundtrip(client, datatype):
    result = _roundtrip(client, datatype, VALUES[datatype], binary=True)
    out = result.get_output(f"OUT_{datatype}")
    assert out["datatype"] == datatype
    assert out["shape"] == [2, 3]
    assert "binary_data_size" in out["parameters"]
    _assert_same(datatype, result.as_numpy(f"OUT_{datatype}"), VALUES[datatype])


@pytest.mark.parametrize("datatype", DTYPES)
def test_json_roundtrip(client, datatype):
    result = _roundtrip(client, datatype, VALUES[datatype], binary=False)
    out = result.get_output(f"OUT_{datatype}")
    assert out["datatype"] == datatype
    assert out["shape"] == [2, 3]
    assert "data" in out
    assert "binary_data_size" not in out.get("parameters", {})
    _assert_same(datatype, result.as_numpy(f"OUT_{datatype}"), VALUES[datatype])


def test_binary_bytes_with_arbitrary_content(client):
    result = _roundtrip(client, "BYTES", BINARY_BYTES, binary=True)
    _assert_same("BYTES", result.as_numpy("OUT_BYTES"), BINARY_BYTES)


def test_bf16_binary_roundtrip(client):
    result = _roundtrip(client, "BF16", BF16, binary=True)
    out = result.get_output("OUT_BF16")
    assert out["datatype"] == "BF16"
    assert out["shape"] == [2, 3]
    assert out["parameters"]["binary_data_size"] == BF16.nbytes
    _assert_same("BF16", result.as_numpy("OUT_BF16"), BF16)


def test_all_datatypes_in_one_request(client):
    """Thirteen inputs of different types in one body: offsets in the binary tail must line up."""
    inputs, outputs = [], []
    for i, (dt, data) in enumerate(VALUES.items()):
        inp = httpclient.InferInput(f"IN_{dt}", list(data.shape), dt)
        inp.set_data_from_numpy(data, binary_data=i % 2 == 0)  # mix binary and JSON inputs
        inputs.append(inp)
        outputs.append(httpclient.InferRequestedOutput(f"OUT_{dt}", binary_data=i % 3 != 0))
    result = client.infer("identity_all", inputs, outputs=outputs)
    for dt, data in VALUES.items():
        _assert_same(dt, result.as_numpy(f"OUT_{dt}"), data)


@pytest.mark.parametrize("datatype", ["BF16", "FP16"])
def test_half_precision_as_json_both_ways(server, datatype):
    """tritonclient sends these only in binary (Triton refuses them as JSON input); a JSON answer
    must still carry the values, not the raw 16-bit words (BF16 is an FP32's high half)."""
    values = [1.5, -2.0, 3.0, 0.5, -0.0, 65280.0 if datatype == "BF16" else 65504.0]
    body = json.dumps({"inputs": [{"name": f"IN_{datatype}", "datatype": datatype, "shape": [2, 3],
                                   "data": values}],
                       "outputs": [{"name": f"OUT_{datatype}", "parameters": {"binary_data": False}}]}).encode()
    raw = raw_request(server.port, "POST", "/v2/models/identity_all/infer", body)
    assert raw.status == 200, raw
    out = raw.json()["outputs"][0]
    assert out["datatype"] == datatype and out["shape"] == [2, 3]
    assert out["data"] == values and math.copysign(1.0, out["data"][4]) == -1.0


def test_json_nested_data_is_accepted(server):
    """KServe allows 'data' as a flat list or nested to the tensor's shape."""
    body = json.dumps({"inputs": [{"name": "IN_INT16", "datatype": "INT16", "shape": [2, 3],
                                   "data": [[1, 2, 3], [4, 5, -6]]}],
                       "outputs": [{"name": "OUT_INT16"}]}).encode()
    raw = raw_request(server.port, "POST", "/v2/models/identity_all/infer", body)
    assert raw.status == 200, raw
    out = raw.json()["outputs"][0]
    assert out["data"] == [1, 2, 3, 4, 5, -6]
    assert out["shape"] == [2, 3]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_empty_tensor_roundtrip(client, binary):
    data = np.zeros((0, 3), dtype=np.float32)
    result = _roundtrip(client, "FP32", data, binary=binary)
    got = result.as_numpy("OUT_FP32")
    assert got.shape == (0, 3)
    assert got.dtype == np.float32


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_empty_inputs_and_empty_bytes_output(server, binary):
    """Zero-element inputs are accepted; an empty BYTES output (serialized, not cast) comes back."""
    body = {"inputs": [{"name": "IN_INT64", "datatype": "INT64", "shape": [1, 0], "data": []},
                       {"name": "IN_BYTES", "datatype": "BYTES", "shape": [0, 2], "data": []}],
            "outputs": [{"name": "OUT_BYTES", "parameters": {"binary_data": binary}}]}
    raw = raw_request(server.port, "POST", "/v2/models/identity_all/infer", json.dumps(body).encode())
    assert raw.status == 200, raw
    header_len = raw.headers.get("inference-header-content-length")
    doc = json.loads(raw.body[:int(header_len)] if header_len else raw.body)
    (out,) = doc["outputs"]
    assert out["name"] == "OUT_BYTES" and out["datatype"] == "BYTES" and out["shape"] == [0, 2]
    if binary:
        assert out["parameters"]["binary_data_size"] == 0
    else:
        assert out["data"] == []


OUT_OF_RANGE = "unable to parse 'data' of input 'IN_{}' as {}: a value is out of its range"  # (Triton cuts it)


@pytest.mark.parametrize("datatype,bad,error", [
    ("INT8", 128, OUT_OF_RANGE.format("INT8", "INT8")),
    ("UINT8", -1, "Unable to parse 'data': attempt to access JSON non-unsigned-integer as unsigned-integer"),
    ("UINT16", 70000, OUT_OF_RANGE.format("UINT16", "UINT16")),
    ("INT32", 2 ** 31, OUT_OF_RANGE.format("INT32", "INT32")),
])
def test_json_value_out_of_range_is_a_400(server, datatype, bad, error):
    body = json.dumps({"inputs": [{"name": f"IN_{datatype}", "datatype": datatype, "shape": [1, 1],
                                   "data": [bad]}]}).encode()
    raw = raw_request(server.port, "POST", "/v2/models/identity_all/infer", body)
    assert raw.status == 400, raw
    assert raw.json()["error"] == error


def test_json_bool_given_as_number_is_a_400(server):
    body = json.dumps({"inputs": [{"name": "IN_BOOL", "datatype": "BOOL", "shape": [1, 2],
                                   "data": [1, 0]}]}).encode()
    raw = raw_request(server.port, "POST", "/v2/models/identity_all/infer", body)
    assert raw.status == 400, raw
    assert raw.json()["error"] == "Unable to parse 'data': attempt to access JSON non-boolean as boolean"  # Triton's


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_large_tensor_roundtrip(client, compression):
    """16 MiB each way: larger than any ring record, so it must travel through the arenas."""
    data = np.random.default_rng(7).standard_normal((1024, 4096)).astype(np.float32)
    inp = httpclient.InferInput("IN_FP32", list(data.shape), "FP32")
    inp.set_data_from_numpy(data)
    result = client.infer("identity_all", [inp], outputs=[httpclient.InferRequestedOutput("OUT_FP32")],
                          request_compression_algorithm=compression, response_compression_algorithm=compression)
    got = result.as_numpy("OUT_FP32")
    assert got.shape == data.shape
    np.testing.assert_array_equal(got.view(np.uint32), data.view(np.uint32))


@pytest.mark.parametrize("array", [
    np.arange(6, dtype=np.int32).reshape(2, 3),
    np.zeros((2, 0, 3), np.float32),
    np.array(7, np.int64),
    np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2],
    np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
    np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16),
    np.array([True, False]),
], ids=["contiguous", "zero_in_shape", "scalar", "strided", "fortran", "bf16", "bool"])
def test_byte_view_is_the_tensors_bytes_in_c_order(array):
    """The fast way (a cast of the array's own buffer) and the numpy way give the same bytes, and
    a contiguous array is viewed, not copied."""
    from shmserve.shm.tensors import byte_view

    view = byte_view(array)
    assert view.tobytes() == array.tobytes() and view.nbytes == array.nbytes
    if array.flags.c_contiguous and array.size:
        assert np.shares_memory(np.frombuffer(view, np.uint8), array)


def test_from_buffer_views_exact_sizes_only():
    from shmserve.shm.tensors import from_buffer

    raw = bytearray(np.arange(6, dtype=np.int32).tobytes())
    arr = from_buffer(memoryview(raw), "INT32", [2, 3])
    assert arr.tolist() == [[0, 1, 2], [3, 4, 5]]
    arr[0, 0] = 9  # a view: the bytes change under it
    assert np.frombuffer(raw, np.int32)[0] == 9
    assert from_buffer(memoryview(raw)[:0], "FP32", [0, 4]).shape == (0, 4)
    for shape in ([2, 2], [4, 2], [-2, -3]):
        with pytest.raises(ValueError):
            from_buffer(memoryview(raw), "INT32", shape)


def test_repeated_answers_keep_their_own_shapes_and_types(client):
    """The frontend keeps the answer head it built for a repeated worker answer: answers that
    alternate shapes, datatypes (BF16 through torch, BYTES), output subsets, orders and binary or
    JSON outputs must each describe their own outputs."""
    rng = np.random.default_rng(11)
    plans = [(("INT32", (2, 3)),), (("INT32", (3, 2)),), (("FP32", (2, 3)),), (("INT32", (2, 3)), ("FP16", (1, 4))),
             (("FP16", (1, 4)), ("INT32", (2, 3))), (("BF16", (2, 3)),), (("BYTES", (2, 2)), ("INT32", (2, 3))),
             (("INT32", (0, 3)),), (("BOOL", (2, 3)),)]
    for round_ in range(3):
        for plan in plans:
            inputs, outputs, want = [], [], {}
            for datatype, shape in plan:
                if datatype == "BYTES":
                    data = np.array([str(x).encode() for x in rng.integers(0, 1000, int(np.prod(shape)))],
                                    dtype=np.object_).reshape(shape)
                elif datatype == "BOOL":
                    data = rng.integers(0, 2, shape).astype(bool)
                elif datatype == "BF16":
                    data = rng.integers(-50, 50, shape).astype(ml_dtypes.bfloat16)
                else:
                    data = rng.integers(-50, 50, shape).astype(triton_to_np_dtype(datatype))
                inp = httpclient.InferInput(f"IN_{datatype}", list(shape), datatype)
                inp.set_data_from_numpy(data, binary_data=True)
                inputs.append(inp)
                outputs.append(httpclient.InferRequestedOutput(f"OUT_{datatype}", binary_data=round_ != 1))
                want[f"OUT_{datatype}"] = (datatype, data)
            result = client.infer("identity_all", inputs, outputs=None if round_ == 2 else outputs)
            described = {o["name"]: o for o in result.get_response()["outputs"]}
            assert set(described) == set(want)
            for name, (datatype, data) in want.items():
                assert described[name]["datatype"] == datatype and described[name]["shape"] == list(data.shape)
                _assert_same(datatype, result.as_numpy(name), data)


def test_a_local_client_takes_torch_tensors_of_every_dtype(server):
    """CPU torch tensors of each dtype Triton has go in as they are, non-contiguous and
    grad-tracking ones too; bfloat16 too, which ``Tensor.numpy`` refuses (it failed with
    "Got unsupported ScalarType BFloat16"), and comes back as ml_dtypes' bfloat16."""
    import torch

    from shmserve import Client

    names = {torch.bool: "BOOL", torch.uint8: "UINT8", torch.int8: "INT8", torch.int16: "INT16",
             torch.int32: "INT32", torch.int64: "INT64", torch.float16: "FP16", torch.float32: "FP32",
             torch.float64: "FP64", torch.bfloat16: "BF16"}
    base = torch.arange(-6, 6, dtype=torch.float32).reshape(3, 4)
    with Client(server.id) as client:
        for dtype, name in names.items():
            t = base.to(dtype)
            got = client.infer("identity_all", {f"IN_{name}": t})[f"OUT_{name}"]
            want = t.float().numpy() if dtype == torch.bfloat16 else t.numpy()
            assert got.shape == (3, 4) and np.array_equal(got.astype(want.dtype), want), name
        assert client.infer("identity_all", {"IN_BF16": base.to(torch.bfloat16)})["OUT_BF16"].dtype == ml_dtypes.bfloat16
        strided = base.t()  # (not contiguous)
        assert client.infer("identity_all", {"IN_FP32": strided})["OUT_FP32"].tolist() == strided.tolist()
        tracked = base.clone().requires_grad_(True)
        assert client.infer("identity_all", {"IN_FP32": tracked})["OUT_FP32"].tolist() == base.tolist()
        half = base.to(torch.bfloat16).t()
        assert client.infer("identity_all", {"IN_BF16": half})["OUT_BF16"].astype(np.float32).tolist() == \
            half.float().tolist()
