"""BLS: Python models calling other models from inside execute(), synchronously and with
async_exec, through a real server."""
from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

ROOT = Path(__file__).resolve().parent.parent


MODELS = Path(__file__).parent / "models"


@pytest.fixture(scope="module")
def server(module_factory):
    return module_factory.start([MODELS / "bls", MODELS / "decoupled", ROOT / "model_repository"])


def string_input(name: str, text: str) -> httpclient.InferInput:
    t = httpclient.InferInput(name, [1], "BYTES")
    t.set_data_from_numpy(np.array([text.encode()], dtype=object))
    return t


def add_sub_inputs(a: np.ndarray, b: np.ndarray) -> list:
    out = []
    for name, arr in (("INPUT0", a), ("INPUT1", b)):
        t = httpclient.InferInput(name, [16], "INT32")
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def test_bls_exec_calls_another_model(server):
    a = np.arange(16, dtype=np.int32)
    b = np.full(16, 3, np.int32)
    result = server.client().infer("add_sub_bls", add_sub_inputs(a, b))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), (a + b) * (a - b))


def test_bls_under_concurrency_keeps_requests_apart(server):
    def one(k: int) -> bool:
        a = np.full(16, k, np.int32)
        b = np.arange(16, dtype=np.int32)
        c = httpclient.InferenceServerClient(server.url)
        try:
            out = c.infer("add_sub_bls", add_sub_inputs(a, b)).as_numpy("OUTPUT0")
        finally:
            c.close()
        return bool(np.array_equal(out, (a + b) * (a - b)))

    with cf.ThreadPoolExecutor(6) as pool:
        assert all(pool.map(one, range(30)))


def test_async_exec_gathers_and_reports_errors(server):
    a = np.arange(16, dtype=np.int32)
    b = np.ones(16, np.int32)
    result = server.client().infer("bls_async", add_sub_inputs(a, b))
    np.testing.assert_array_equal(result.as_numpy("SUM"), a + b)
    error = result.as_numpy("ERROR")[0].decode()
    assert "Request for unknown model: 'no_such_model' is not found" in error
    assert error.endswith("[NOT_FOUND]")  # the code Triton's BLS gives a missing model


def test_exec_decoupled_iterates_a_streaming_models_responses(server):
    """exec(decoupled=True): every response of word_stream, in order; err_stream's values and
    then its error response (has_error), as Triton gives them."""
    n = httpclient.InferInput("N", [1], "INT32")
    n.set_data_from_numpy(np.array([3], np.int32))
    result = server.client().infer("bls_stream", [string_input("TEXT", "the words come one by one"), n])
    assert result.as_numpy("WORDS")[0].decode() == "the words come one by one"
    assert result.as_numpy("OUTS").tolist() == [0, 1, 2]
    assert result.as_numpy("ERROR")[0].decode() == "stream broke"


def test_async_exec_decoupled_gathers_streams(server):
    result = server.client().infer("bls_stream_async", [string_input("TEXT", "alpha beta gamma")])
    assert [w.decode() for w in result.as_numpy("WORDS")] == ["alpha beta gamma", "gamma beta alpha"]


def loader_action(server, action: str) -> dict:
    import json

    result = server.client().infer("bls_loader", [string_input("ACTION", action)])
    return json.loads(result.as_numpy("RESULT")[0])


def test_model_loading_api_needs_explicit_mode(server):
    assert "explicit model load / unload is not allowed" in loader_action(server, "load")["error"]


def test_model_loading_api_from_a_model(module_factory):
    """pb_utils.load_model (config and files uploaded), is_model_ready and unload_model from
    inside execute(), on a server in explicit mode; a failed load raises TritonModelException."""
    s = module_factory.start([MODELS / "bls", MODELS / "decoupled", ROOT / "model_repository"],
                             ["--model-control-mode", "explicit", "--load-model", "bls_loader"])
    assert loader_action(s, "ready") == {"ready": False}
    assert loader_action(s, "load") == {"ready": True, "y": 42}
    assert s.client().is_model_ready("add_one")
    assert loader_action(s, "unload") == {"ready": False}
    assert not s.client().is_model_ready("add_one")
    assert "failed to load 'no_such_model_anywhere'" in loader_action(s, "load_missing")["error"]


@pytest.mark.parametrize("code", range(8))
def test_bls_error_keeps_its_code(server, code):
    """The code of a TritonError the called model answers reaches the caller (NOT_FOUND stays
    NOT_FOUND, not INTERNAL); the target's name may be given as bytes, as Triton allows."""
    c = httpclient.InferInput("CODE", [1], "INT32")
    c.set_data_from_numpy(np.array([code], np.int32))
    result = server.client().infer("error_caller", [c, string_input("TARGET", "error_source")])
    assert result.as_numpy("GOT").tolist() == [code]
    assert result.as_numpy("MESSAGE")[0].decode() == f"failed with code {code}"


ORDER_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("M", x + 1), pb_utils.Tensor("Z", x + 2),
                                                   pb_utils.Tensor("A", x + 3)]))
        return out
'''
ORDER_CONFIG = ('backend: "python"\nmax_batch_size: 0\ninput [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
                'output [ { name: "Z" data_type: TYPE_FP32 dims: [ 1 ] }, { name: "A" data_type: TYPE_FP32 dims: [ 1 ] },\n'
                '         { name: "M" data_type: TYPE_FP32 dims: [ 1 ] } ]\n')
CALLER_PY = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            asked = json.loads(r.parameters()).get("asked", "").split(",")
            got = pb_utils.InferenceRequest(model_name="order", inputs=[pb_utils.Tensor("X", np.ones(1, np.float32))],
                                            requested_output_names=[a for a in asked if a]).exec()
            names = ",".join(t.name() for t in got.output_tensors())
            first = got.output_tensors()[0].as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("NAMES", np.array([names.encode()], np.object_)),
                                                   pb_utils.Tensor("FIRST", first)]))
        return out
'''
CALLER_CONFIG = ('backend: "python"\nmax_batch_size: 0\ninput [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
                 'output [ { name: "NAMES" data_type: TYPE_STRING dims: [ 1 ] }, '
                 '{ name: "FIRST" data_type: TYPE_FP32 dims: [ 1 ] } ]\n')


def test_outputs_come_in_the_order_the_model_returned_them(module_factory, tmp_path):
    """As Triton answers: the model's own order, filtered to the outputs asked for, over HTTP and
    to a BLS caller, whose ``output_tensors()[0]`` is the first tensor the callee returned."""
    repo = tmp_path / "repo"
    for name, code, config in (("order", ORDER_PY, ORDER_CONFIG), ("order_caller", CALLER_PY, CALLER_CONFIG)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(code)
        (repo / name / "config.pbtxt").write_text(config)
    s = module_factory.start([repo])
    c = s.client()
    x = httpclient.InferInput("X", [1], "FP32")
    x.set_data_from_numpy(np.ones(1, np.float32))
    for asked, expected in ((["A", "Z"], ["Z", "A"]), (["M", "A", "Z"], ["M", "Z", "A"]), ([], ["M", "Z", "A"])):
        outs = [httpclient.InferRequestedOutput(n) for n in asked] or None
        got = c.infer("order", [x], outputs=outs).get_response()["outputs"]
        assert [o["name"] for o in got] == expected, asked
        answer = c.infer("order_caller", [x], parameters={"asked": ",".join(asked)})
        assert answer.as_numpy("NAMES")[0].decode() == ",".join(expected), asked
        assert answer.as_numpy("FIRST").tolist() == [{"M": 2.0, "Z": 3.0, "A": 4.0}[expected[0]]]


BYTES_NAMED_PY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        np = pb_utils.np  # (Triton's module carries numpy)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(b"Y", pb_utils.get_input_tensor_by_name(r, "X")
                                                            .as_numpy() * np.float32(2))]) for r in requests]
'''


def test_a_tensor_named_with_bytes_reaches_the_client_by_its_name(module_factory, tmp_path):
    """pb_utils.Tensor(b"Y", ...) and pb_utils.np, as Triton's Python backend takes them."""
    repo = tmp_path / "repo"
    (repo / "bytes_named" / "1").mkdir(parents=True)
    (repo / "bytes_named" / "1" / "model.py").write_text(BYTES_NAMED_PY)
    (repo / "bytes_named" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\ninput [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n')
    s = module_factory.start([repo])
    x = httpclient.InferInput("X", [1], "FP32")
    x.set_data_from_numpy(np.array([3.0], np.float32))
    assert s.client().infer("bytes_named", [x]).as_numpy("Y").tolist() == [6.0]


VERSION_CALLER_PY = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


def attempt(make):
    try:
        return make()
    except Exception as e:
        return "%s: %s" % (type(e).__name__, e)


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = [pb_utils.Tensor("X", np.ones(1, np.float32))]
            report = {}
            for version in (-1, 0, 1, -2, 2):
                got = pb_utils.InferenceRequest(model_name="order", model_version=version, inputs=x,
                                                requested_output_names=["M"]).exec()
                report[str(version)] = got.error().message() if got.has_error() else got.output_tensors()[0].as_numpy().tolist()
            made = lambda **kw: pb_utils.InferenceRequest(model_name="order", inputs=x, requested_output_names=["M"], **kw)
            report["parameters"] = made(parameters={"a": 1, "b": "x"}).parameters()
            report["incoming"] = r.parameters()
            report["list value"] = attempt(lambda: made(parameters={"a": [1]}))
            report["key"] = attempt(lambda: made(parameters={1: 1}))
            report["timeout"] = attempt(lambda: made(timeout=-1))
            report["flags"] = attempt(lambda: made(flags=-1))
            for _ in range(2):
                gpu = made(preferred_memory=pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_GPU, 0)).exec()
            report["gpu"] = [t.is_cpu() for t in gpu.output_tensors()]
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("R", np.array([json.dumps(report).encode()], np.object_))]))
        return out
'''


def test_bls_version_numbers_and_request_arguments_as_triton(module_factory, tmp_path):
    """model_version -1 is the latest; any other number names that version, 0 and -2 too, which
    do not exist (as Triton's core refuses them: 0 was taken for the latest here). A request a
    model builds reads its parameters() as Triton's stub writes them (json.dumps, with spaces), an
    incoming one compact; a parameter of a bad type names it as Triton does (``<class 'list'>``),
    and a negative timeout or flags is a TypeError, as for Triton's unsigned arguments.
    preferred_memory GPU is not acted on (the outputs are on the CPU): the log says so, once."""
    import json

    repo = tmp_path / "repo"
    for name, code, config in (("order", ORDER_PY, ORDER_CONFIG), ("vcall", VERSION_CALLER_PY, (
            'backend: "python"\nmax_batch_size: 0\ninput [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
            'output [ { name: "R" data_type: TYPE_STRING dims: [ 1 ] } ]\n'))):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(code)
        (repo / name / "config.pbtxt").write_text(config)
    s = module_factory.start([repo])
    x = httpclient.InferInput("X", [1], "FP32")
    x.set_data_from_numpy(np.ones(1, np.float32))
    report = json.loads(s.client().infer("vcall", [x], parameters={"a": 1, "b": "x"}).as_numpy("R")[0])
    assert report["-1"] == [2.0] and report["1"] == [2.0]
    for version in ("0", "-2", "2"):
        assert report[version] == f"Request for unknown model: 'order' version {version} is not found"
    assert report["parameters"] == '{"a": 1, "b": "x"}'
    assert report["incoming"] == '{"a":1,"b":"x"}'
    assert report["list value"] == ("TritonModelException: Expect parameters values to have type bool/int/str, "
                                    "found type <class 'list'>")
    assert report["key"] == "TritonModelException: Expect parameters keys to have type str, found type <class 'int'>"
    assert report["timeout"].startswith("TypeError: ") and "timeout" in report["timeout"]
    assert report["flags"].startswith("TypeError: ") and "flags" in report["flags"]
    assert report["gpu"] == [True]
    assert s.log().count("preferred_memory TRITONSERVER_MEMORY_GPU is not acted on") == 1
