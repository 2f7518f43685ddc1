"""What Triton's own HTTP client examples (simple_http_*.py in triton-inference-server/client) ask
of a server, checked with tritonclient against examples/triton_client_models: the four models
those programs call, Triton's example configs, and the server behaviour each program relies on.
The programs themselves were run unchanged against this repository (see the README); these
tests keep what they depend on from regressing.
"""
from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException, serialize_byte_tensor, serialized_byte_size

from conftest import ROOT, raw_request

EXAMPLES = ROOT / "examples" / "triton_client_models"
IN0 = np.arange(16, dtype=np.int32).reshape(1, 16)
IN1 = np.full((1, 16), -1, dtype=np.int32)


@pytest.fixture(scope="module")
def ex_server(module_factory):
    return module_factory.start([EXAMPLES])


@pytest.fixture
def http(ex_server):
    c = ex_server.client()
    yield c
    c.close()


def _input(name: str, arr: np.ndarray, datatype: str, binary: bool) -> httpclient.InferInput:
    t = httpclient.InferInput(name, list(arr.shape), datatype)
    t.set_data_from_numpy(arr, binary_data=binary)
    return t


def test_simple_with_json_and_binary_inputs_and_outputs(http):
    """simple_http_infer_client.py: INPUT0 as JSON, INPUT1 binary, one output of each kind, query
    parameters on the URL; then no outputs named, so all come back binary."""
    inputs = [_input("INPUT0", IN0, "INT32", False), _input("INPUT1", IN1, "INT32", True)]
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)]
    for asked in (outputs, None):
        r = http.infer("simple", inputs, outputs=asked, query_params={"test_1": 1, "test_2": 2})
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), IN0 + IN1)
        np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), IN0 - IN1)
        assert r.as_numpy("OUTPUT0").shape == (1, 16)
    stats = http.get_inference_statistics(model_name="simple")
    assert len(stats["model_stats"]) == 1
    with pytest.raises(InferenceServerException) as e:
        http.infer("wrong_model_name", inputs)
    assert e.value.message().startswith("Request for unknown model")


def test_health_and_metadata(ex_server, http):
    """simple_http_health_metadata.py (it also wants the server's name 'triton': the --id)."""
    assert http.is_server_live(query_params={"test_1": 1, "test_2": 2})
    assert http.is_server_ready() and http.is_model_ready("simple")
    assert http.get_server_metadata()["name"] == ex_server.id
    meta = http.get_model_metadata("simple", query_params={"test_1": 1, "test_2": 2})
    assert meta["name"] == "simple"
    assert meta["inputs"][0] == {"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]}
    with pytest.raises(InferenceServerException, match="Request for unknown model"):
        http.get_model_metadata("wrong_model_name")


def test_simple_string_decimal_sum_and_difference(http):
    """simple_http_string_infer_client.py: BYTES in binary and in JSON, results as decimal text."""
    a = np.array([[str(i).encode() for i in range(16)]], dtype=np.object_)
    b = np.array([[b"1"] * 16], dtype=np.object_)
    r = http.infer("simple_string", [_input("INPUT0", a, "BYTES", True), _input("INPUT1", b, "BYTES", False)],
                   outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
                            httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)])
    assert [int(x) for x in r.as_numpy("OUTPUT0")[0]] == [i + 1 for i in range(16)]
    assert [int(x) for x in r.as_numpy("OUTPUT1")[0]] == [i - 1 for i in range(16)]


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("element", [b"he\x00llo", b"\x00\x01\x02\x03"])
def test_simple_identity_keeps_every_byte(http, binary, element):
    """The string example's identity calls: embedded NULs and control characters survive both
    the binary form and JSON (where they travel as \\u0000 escapes)."""
    data = np.array([[element] * 16], dtype=np.object_)
    r = http.infer("simple_identity", [_input("INPUT0", data, "BYTES", binary)],
                   outputs=[httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)])
    got = [x if isinstance(x, bytes) else x.encode() for x in r.as_numpy("OUTPUT0")[0]]  # JSON gives str
    assert got == [element] * 16


def test_simple_sequence_with_integer_and_string_ids(http):
    """simple_http_sequence_sync_infer_client.py: OUTPUT is INPUT plus START; two integer ids
    and a UUID string id."""
    values = [11, 7, 5, 3, 2, 0, 1]
    for seq_id, first, sign in ((1000, 0, 1), (1001, 100, -1), (str(uuid.uuid4()), 20, -1)):
        sent = [first] + [sign * v for v in values]
        got = []
        for i, value in enumerate(sent):
            r = http.infer("simple_sequence", [_input("INPUT", np.full((1, 1), value, np.int32), "INT32", True)],
                           outputs=[httpclient.InferRequestedOutput("OUTPUT")], sequence_id=seq_id,
                           sequence_start=i == 0, sequence_end=i == len(sent) - 1)
            got.append(int(r.as_numpy("OUTPUT")[0][0]))
        assert got == [first + 1] + sent[1:], seq_id


def test_shared_memory_strings_fill_regions_of_exact_size(ex_server, http):
    """simple_http_shm_string_client.py: the CUDA unregister-all answers on a server without a
    GPU; serialized BYTES inputs in regions; outputs written into regions sized exactly."""
    http.unregister_system_shared_memory()
    http.unregister_cuda_shared_memory()
    a = np.array([[str(i).encode() for i in range(16)]], dtype=np.object_)
    b = np.array([[b"1"] * 16], dtype=np.object_)
    expected = {"OUTPUT0": [str(i + 1).encode() for i in range(16)],
                "OUTPUT1": [str(i - 1).encode() for i in range(16)]}
    sizes = {"INPUT0": serialized_byte_size(serialize_byte_tensor(a)),
             "INPUT1": serialized_byte_size(serialize_byte_tensor(b)),
             "OUTPUT0": serialized_byte_size(serialize_byte_tensor(np.array(expected["OUTPUT0"], np.object_))),
             "OUTPUT1": serialized_byte_size(serialize_byte_tensor(np.array(expected["OUTPUT1"], np.object_)))}
    assert (sizes["OUTPUT0"], sizes["OUTPUT1"]) == (87, 86)  # the example's own region sizes
    handles = {}
    try:
        for name, size in sizes.items():
            key = f"/tex_{ex_server.id}_{name}"
            handles[name] = shm.create_shared_memory_region(f"{name}_data", key, size)
            http.register_system_shared_memory(f"{name}_data", key, size)
        shm.set_shared_memory_region(handles["INPUT0"], [serialize_byte_tensor(a)])
        shm.set_shared_memory_region(handles["INPUT1"], [serialize_byte_tensor(b)])
        inputs = []
        for name, arr in (("INPUT0", a), ("INPUT1", b)):
            t = httpclient.InferInput(name, [1, 16], "BYTES")
            t.set_shared_memory(f"{name}_data", sizes[name])
            inputs.append(t)
        outputs = []
        for name in ("OUTPUT0", "OUTPUT1"):
            o = httpclient.InferRequestedOutput(name, binary_data=True)
            o.set_shared_memory(f"{name}_data", sizes[name])
            outputs.append(o)
        r = http.infer("simple_string", inputs, outputs=outputs)
        for name in ("OUTPUT0", "OUTPUT1"):
            out = r.get_output(name)
            assert out["datatype"] == "BYTES" and out["shape"] == [1, 16]
            got = shm.get_contents_as_numpy(handles[name], np.object_, [1, 16])
            assert got[0].tolist() == expected[name]
        assert len(http.get_system_shared_memory_status()) == 4
    finally:
        http.unregister_system_shared_memory()
        for handle in handles.values():
            shm.destroy_shared_memory_region(handle)


def test_model_control_with_a_config_override(module_factory):
    """simple_http_model_control.py (explicit mode): the index, load and unload, a malformed
    override refused with 'failed to load', a JSON override that changes max_batch_size, and an
    unknown model that fails without entering the index."""
    s = module_factory.start([EXAMPLES], ["--model-control-mode", "explicit"])
    c = s.client()
    try:
        assert len(c.get_model_repository_index()) == len([p for p in EXAMPLES.iterdir() if p.is_dir()])
        c.load_model("simple")
        assert c.is_model_ready("simple")
        with pytest.raises(InferenceServerException, match="failed to load"):
            c.load_model("simple", config='"parameters": {"config": {{"max_batch_size": "16"}}}')
        c.load_model("simple", config='{"max_batch_size":"16"}')
        assert c.get_model_config("simple")["max_batch_size"] == 16
        c.unload_model("simple")
        assert not c.is_model_ready("simple")
        with pytest.raises(InferenceServerException, match="failed to load"):
            c.load_model("wrong_model_name")
        assert len(c.get_model_repository_index()) == len([p for p in EXAMPLES.iterdir() if p.is_dir()])
        raw = raw_request(s.port, "GET", "/v2/health/ready")
        assert raw.status == 200
    finally:
        c.close()


def test_example_configs_are_tritons(ex_server, http):
    """Triton's example configs: batching up to 8, [16] tensors (strings for simple_string)."""
    for model, datatype in (("simple", "TYPE_INT32"), ("simple_string", "TYPE_STRING")):
        cfg = http.get_model_config(model)
        assert cfg["max_batch_size"] == 8
        assert [(t["name"], t["data_type"], t["dims"]) for t in cfg["input"]] == \
            [("INPUT0", datatype, [16]), ("INPUT1", datatype, [16])]
    assert Path(EXAMPLES / "simple_sequence" / "config.pbtxt").read_text().count("CONTROL_SEQUENCE_") == 2
