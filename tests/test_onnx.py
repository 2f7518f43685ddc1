"""The ONNX Runtime backend against a real server with tritonclient: Triton's auto-complete from the
graph (and --disable-auto-complete-config turning it off), configs that disagree with the graph
refused with the tensor named, session options and execution accelerators, dynamic batching,
implicit sequence state, every datatype, ensembles and BLS calls mixing ONNX and Python steps,
warm-up, external data, and the bundled digits_onnx answering as its TorchScript twin.

The graphs are built at test time with the onnx package's helpers (tests/onnx_models.py).
"""
from __future__ import annotations

import concurrent.futures
import os
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import onnx_models as om
from conftest import PRODUCT_MODELS, raw_request

ADD_SUB_IO = textwrap.dedent("""\
    input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
    output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
    """)


def add_sub_config(name: str, extra: str = "", io: str = ADD_SUB_IO, max_batch: int = 8) -> str:
    return f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {max_batch}\n{io}{extra}\n'


def accumulator_config(name: str, start_values: str) -> str:
    """The sequence model of om.accumulator: START is a control of the kind ``start_values``
    (the graph takes FP32), STATE_IN/STATE_OUT its implicit state."""
    return textwrap.dedent(f"""\
        name: "{name}"
        platform: "onnxruntime_onnx"
        max_batch_size: 4
        input [ {{ name: "VALUE" data_type: TYPE_FP32 dims: [ 1 ] }} ]
        output [ {{ name: "SUM" data_type: TYPE_FP32 dims: [ 1 ] }} ]
        sequence_batching {{
          max_sequence_idle_microseconds: 60000000
          control_input [ {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START {start_values}: [ 0, 1 ] }} ] }} ]
          state [ {{ input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
        }}
        """)


SCALE_PY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """SCALED = X * 10: the Python step in front of the ONNX one in the ensemble."""

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("SCALED", pb_utils.get_input_tensor_by_name(r, "X")
                                                            .as_numpy() * 10)]) for r in requests]
'''

BLS_PY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """PRODUCT = (a + b) * (a - b), asking the ONNX model add_sub_onnx for the sum and difference."""

    def execute(self, requests):
        out = []
        for r in requests:
            answer = pb_utils.InferenceRequest(
                model_name="add_sub_onnx", requested_output_names=["OUTPUT0", "OUTPUT1"],
                inputs=[pb_utils.get_input_tensor_by_name(r, "INPUT0"),
                        pb_utils.get_input_tensor_by_name(r, "INPUT1")]).exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            total = pb_utils.get_output_tensor_by_name(answer, "OUTPUT0").as_numpy()
            diff = pb_utils.get_output_tensor_by_name(answer, "OUTPUT1").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("PRODUCT", total * diff)]))
        return out
'''

# model -> words its load error must hold (besides the model's name)
LOAD_ERRORS = {
    "wrong_dtype": ["configuration expects datatype TYPE_INT32 for input 'INPUT0'", "model provides TYPE_FP32"],
    "wrong_dims": ["model 'wrong_dims', tensor 'INPUT0': the model expects 2 dimensions (shape [-1,4]) but the "
                   "model configuration specifies 2 dimensions (an initial batch dimension because max_batch_size > 0 "
                   "followed by the explicit tensor shape, making complete shape [-1,5])"],
    "wrong_rank": ["model 'wrong_rank', tensor 'INPUT0': the model expects 2 dimensions (shape [2,4]) but the "
                   "model configuration specifies 1 dimensions (shape [8])"],
    "free_output": ["tensor 'OUTPUT0': the model expects 2 dimensions (shape [-1,4])",
                    "making complete shape [-1,-1])"],
    "fixed_batch": ["model 'fixed_batch', tensor 'INPUT0': for the model to support batching the shape should have at "
                    "least 1 dimension and the first dimension must be -1; but shape expected by the model is [2,4]"],
    "cannot_batch": ["autofill failed", "does not support batching while non-zero max_batch_size"],
    "extra_input": ["unable to load model 'extra_input', configuration expects 3 inputs, model provides 2"],
    "unknown_input": [": unexpected inference input 'EXTRA', allowed inputs are: INPUT0, INPUT1"],
    "unknown_output": [": unexpected inference output 'EXTRA', allowed outputs are: OUTPUT0, OUTPUT1"],
    "unfed_input": ["unable to load model 'unfed_input', configuration expects 1 inputs, model provides 2"],
    "ragged_not_flat": ["configuration expects model provides input with shape [-1]  for ragged input 'INPUT0'",
                        "model provides [-1,4]"],
    "openvino": ["cpu_execution_accelerator 'openvino'", "OpenVINOExecutionProvider"],
    "unknown_accel": ["unknown Execution Accelerator 'fpga' is requested"],
    "bad_mode": ["execution_mode are 0 or 1 but got 2"],
    "bad_threads": ["parameter 'intra_op_thread_count'", "'many'"],
    "strings_to_bf16": ["takes string tensors and gives bfloat16"],
    "bad_control": ["unable to load model 'bad_control', sequence control 'START', the model expects data-type FLOAT "
                    "but the model configuration specifies data-type TYPE_INT32"],
}


def build_repository(repo: Path) -> Path:
    db = "dynamic_batching { max_queue_delay_microseconds: 100000 preferred_batch_size: [ 8 ] }\n"
    om.write(repo, "add_sub_onnx", om.add_sub(), add_sub_config("add_sub_onnx", db))
    om.write(repo, "add_sub_auto", om.add_sub(), None)  # no config.pbtxt at all
    om.write(repo, "add_sub_fixed", om.add_sub(batch=2), None)
    om.write(repo, "per_row", om.per_row_scalar(), None)
    om.write(repo, "zeros", om.zeros_of_shape(), 'platform: "onnxruntime_onnx"\nmax_batch_size: 0\n'
             'input [ { name: "SHAPE" data_type: TYPE_INT64 dims: [ 1 ] } ]\n'
             'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]\n')
    om.write(repo, "batcher_only", om.add_sub(),
             'platform: "onnxruntime_onnx"\ndynamic_batching { max_queue_delay_microseconds: 100 }\n')
    om.write(repo, "named_file", om.add_sub(), add_sub_config("named_file", 'default_model_filename: "net.onnx"\n'),
             filename="net.onnx")
    om.matmul_external(repo, "external", np.arange(12, dtype=np.float32).reshape(3, 4),
                       'name: "external"\nbackend: "onnxruntime"\nmax_batch_size: 2\n')
    om.write(repo, "types", om.identity_all([dt for dt in om.ELEMENT_TYPES if dt != "BF16"]), None)
    om.write(repo, "bf16", om.identity_all(["BF16", "FP32"]), None)
    om.write(repo, "accumulate", om.accumulator(), accumulator_config("accumulate", "fp32_false_true"))
    om.write(repo, "row_sums", om.row_sum(), textwrap.dedent("""\
        name: "row_sums"
        platform: "onnxruntime_onnx"
        max_batch_size: 4
        input [ { name: "VALUE" data_type: TYPE_FP32 dims: [ -1 ] } ]
        output [ { name: "SUM" data_type: TYPE_FP32 dims: [ 1 ] } ]
        sequence_batching {
          max_sequence_idle_microseconds: 60000000
          control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] } ]
        }
        instance_group [ { count: 1 kind: KIND_CPU } ]
        """))
    om.write(repo, "warm", om.add_sub(), add_sub_config("warm", textwrap.dedent("""\
        model_warmup [ { name: "zeros" batch_size: 2 count: 3
          inputs { key: "INPUT0" value: { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } }
          inputs { key: "INPUT1" value: { data_type: TYPE_FP32 dims: [ 4 ] random_data: true } } } ]
        """)))
    om.write(repo, "tuned", om.add_sub(), add_sub_config("tuned", textwrap.dedent("""\
        optimization { graph { level: 1 }
          execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt" } ] } }
        parameters { key: "intra_op_thread_count" value: { string_value: "1" } }
        parameters { key: "inter_op_thread_count" value: { string_value: "2" } }
        parameters { key: "execution_mode" value: { string_value: "1" } }
        parameters { key: "enable_mem_arena" value: { string_value: "1" } }
        parameters { key: "enable_mem_pattern" value: { string_value: "false" } }
        parameters { key: "memory.enable_memory_arena_shrinkage" value: { string_value: "cpu:0" } }
        """)))
    # an ensemble: a Python step scales X, the ONNX step adds and subtracts
    (repo / "scale" / "1").mkdir(parents=True)
    (repo / "scale" / "1" / "model.py").write_text(SCALE_PY)
    (repo / "scale" / "config.pbtxt").write_text(
        'name: "scale"\nbackend: "python"\nmax_batch_size: 8\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "SCALED" data_type: TYPE_FP32 dims: [ 4 ] } ]\n')
    (repo / "scaled_add_sub" / "1").mkdir(parents=True)
    (repo / "scaled_add_sub" / "config.pbtxt").write_text(textwrap.dedent("""\
        name: "scaled_add_sub"
        platform: "ensemble"
        max_batch_size: 8
        input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
        output [ { name: "SUM" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "DIFF" data_type: TYPE_FP32 dims: [ 4 ] } ]
        ensemble_scheduling { step [
          { model_name: "scale" input_map { key: "X" value: "X" } output_map { key: "SCALED" value: "x10" } },
          { model_name: "add_sub_onnx" input_map [ { key: "INPUT0" value: "x10" }, { key: "INPUT1" value: "Y" } ]
            output_map [ { key: "OUTPUT0" value: "SUM" }, { key: "OUTPUT1" value: "DIFF" } ] } ] }
        """))
    (repo / "product" / "1").mkdir(parents=True)
    (repo / "product" / "1" / "model.py").write_text(BLS_PY)
    (repo / "product" / "config.pbtxt").write_text(
        'name: "product"\nbackend: "python"\nmax_batch_size: 8\n' + ADD_SUB_IO.split("output")[0]
        + 'output [ { name: "PRODUCT" data_type: TYPE_FP32 dims: [ 4 ] } ]\n')
    # -- configs the graph cannot serve ------------------------------------------------------
    om.write(repo, "wrong_dtype", om.add_sub(), add_sub_config("wrong_dtype", io=ADD_SUB_IO.replace(
        'name: "INPUT0" data_type: TYPE_FP32', 'name: "INPUT0" data_type: TYPE_INT32')))
    om.write(repo, "wrong_dims", om.add_sub(), add_sub_config("wrong_dims", io=ADD_SUB_IO.replace(
        'name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ]', 'name: "INPUT0" data_type: TYPE_FP32 dims: [ 5 ]')))
    om.write(repo, "fixed_batch", om.add_sub(batch=2), add_sub_config("fixed_batch"))
    om.write(repo, "cannot_batch", om.add_sub(batch=2), 'platform: "onnxruntime_onnx"\nmax_batch_size: 4\n')
    om.write(repo, "extra_input", om.add_sub(), add_sub_config("extra_input", io=ADD_SUB_IO.replace(
        "input [ ", 'input [ { name: "EXTRA" data_type: TYPE_FP32 dims: [ 4 ] }, ')))
    om.write(repo, "unknown_input", om.add_sub(), add_sub_config("unknown_input", io=ADD_SUB_IO.replace(
        'name: "INPUT1"', 'name: "EXTRA"')))
    om.write(repo, "wrong_rank", om.add_sub(batch=2), add_sub_config("wrong_rank", max_batch=0, io=ADD_SUB_IO.replace(
        'name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ]', 'name: "INPUT0" data_type: TYPE_FP32 dims: [ 8 ]')))
    om.write(repo, "free_output", om.add_sub(), add_sub_config("free_output", io=ADD_SUB_IO.replace(
        'name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ]', 'name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ]')))
    om.write(repo, "unknown_output", om.add_sub(), add_sub_config("unknown_output", io=ADD_SUB_IO.replace(
        "output [ ", 'output [ { name: "EXTRA" data_type: TYPE_FP32 dims: [ 4 ] }, ')))
    om.write(repo, "unfed_input", om.add_sub(), add_sub_config("unfed_input", io=ADD_SUB_IO.replace(
        ', { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]', " ]")))
    om.write(repo, "ragged_not_flat", om.add_sub(), add_sub_config("ragged_not_flat", io=ADD_SUB_IO.replace(
        'dims: [ 4 ] }, { name: "INPUT1"', 'dims: [ 4 ] allow_ragged_batch: true }, { name: "INPUT1"')))
    om.write(repo, "openvino", om.add_sub(), add_sub_config(
        "openvino", 'optimization { execution_accelerators { cpu_execution_accelerator [ { name: "openvino" } ] } }'))
    om.write(repo, "unknown_accel", om.add_sub(), add_sub_config(
        "unknown_accel", 'optimization { execution_accelerators { cpu_execution_accelerator [ { name: "fpga" } ] } }'))
    om.write(repo, "bad_mode", om.add_sub(), add_sub_config(
        "bad_mode", 'parameters { key: "execution_mode" value: { string_value: "2" } }'))
    om.write(repo, "bad_threads", om.add_sub(), add_sub_config(
        "bad_threads", 'parameters { key: "intra_op_thread_count" value: { string_value: "many" } }'))
    om.write(repo, "strings_to_bf16", om.identity_all(["BYTES", "BF16"]), None)
    om.write(repo, "bad_control", om.accumulator(), accumulator_config("bad_control", "int32_false_true"))
    return repo


def _index(server) -> dict[str, dict]:
    raw = raw_request(server.port, "POST", "/v2/repository/index", b"{}")
    assert raw.status == 200, raw
    return {e["name"]: e for e in raw.json()}


def _states(server) -> dict[str, str]:
    """Each model's state in the repository index ({} while the server is still starting)."""
    try:
        return {name: e.get("state", "") for name, e in _index(server).items()}
    except (OSError, AssertionError):
        return {}


@pytest.fixture(scope="module")
def onnx_server(module_factory, tmp_path_factory):
    repo = build_repository(tmp_path_factory.mktemp("onnx_repo"))
    names = {p.name for p in repo.iterdir()}
    server = module_factory.create([repo], ["--exit-on-error=false"]).start()

    def settled() -> bool:
        states = _states(server)
        return set(states) >= names and all(s in ("READY", "UNAVAILABLE") for s in states.values())

    server.wait_until(settled, "every ONNX model loaded or refused")
    return server


@pytest.fixture
def onnx_client(onnx_server):
    c = onnx_server.client()
    yield c
    c.close()


def _input(name: str, data: np.ndarray, datatype: str) -> httpclient.InferInput:
    t = httpclient.InferInput(name, list(data.shape), datatype)
    t.set_data_from_numpy(data)
    return t


def _add_sub(client, model: str, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    result = client.infer(model, [_input("INPUT0", a, "FP32"), _input("INPUT1", b, "FP32")])
    return result.as_numpy("OUTPUT0"), result.as_numpy("OUTPUT1")


def _rows(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 4), dtype=np.float32), rng.standard_normal((n, 4), dtype=np.float32)


# -- serving ------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["add_sub_onnx", "add_sub_auto", "batcher_only", "named_file", "warm", "tuned"])
def test_a_batching_onnx_model_adds_and_subtracts(onnx_client, model):
    a, b = _rows(3, 1)
    total, diff = _add_sub(onnx_client, model, a, b)
    np.testing.assert_allclose(total, a + b, rtol=1e-6)
    np.testing.assert_allclose(diff, a - b, rtol=1e-6)


def test_concurrent_requests_are_batched_and_each_gets_its_own_rows(onnx_server):
    """16 requests of 1-3 rows at once, under a 100 ms queue delay and a preferred batch of 8: the
    server runs them in batches of several requests, and each answer holds its own rows."""
    inputs = [_rows(1 + i % 3, 100 + i) for i in range(16)]

    def call(pair: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        c = onnx_server.client()
        try:
            return _add_sub(c, "add_sub_onnx", *pair)
        finally:
            c.close()

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(call, inputs))
    for (a, b), (total, diff) in zip(inputs, answers):
        np.testing.assert_allclose(total, a + b, rtol=1e-6)
        np.testing.assert_allclose(diff, a - b, rtol=1e-6)
    c = onnx_server.client()
    try:
        stats = c.get_inference_statistics("add_sub_onnx")["model_stats"][0]
    finally:
        c.close()
    assert any(int(s["batch_size"]) > 3 for s in stats["batch_stats"]), stats["batch_stats"]


def test_a_scalar_per_row_is_declared_dims_1_and_reshaped_for_the_graph(onnx_client):
    """A graph tensor [batch] is auto-completed as Triton does: dims [1] with an empty reshape;
    clients send [n, 1] and get [n, 1] back, the graph sees [n]."""
    config = onnx_client.get_model_config("per_row")
    assert config["max_batch_size"] == 4
    assert config["input"][0]["dims"] == [1] and config["input"][0]["reshape"] == {"shape": []}
    result = onnx_client.infer("per_row", [_input("X", np.array([[1.5], [-2.0]], np.float32), "FP32")])
    np.testing.assert_array_equal(result.as_numpy("Y"), [[3.0], [-4.0]])


def test_a_directory_model_with_external_data(onnx_client):
    weights = np.arange(12, dtype=np.float32).reshape(3, 4)
    x = np.array([[1.0, 0.0, -1.0], [0.5, 0.5, 0.5]], np.float32)
    result = onnx_client.infer("external", [_input("X", x, "FP32")])
    np.testing.assert_allclose(result.as_numpy("Y"), x @ weights, rtol=1e-6)


# -- auto-complete ------------------------------------------------------------------------------


def test_auto_complete_takes_tensors_from_the_graph_and_batches_a_free_first_dimension(onnx_client):
    """No config.pbtxt: inputs, outputs, datatypes and dims from the graph; every first dimension
    is free, so max_batch_size is Triton's default 4 and the dynamic batcher is on."""
    config = onnx_client.get_model_config("add_sub_auto")
    assert (config["backend"], config["platform"], config["default_model_filename"]) == (
        "onnxruntime", "onnxruntime_onnx", "model.onnx")
    assert config["max_batch_size"] == 4
    assert "dynamic_batching" in config
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
        ("INPUT0", "TYPE_FP32", [4]), ("INPUT1", "TYPE_FP32", [4])]
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["output"]] == [
        ("OUTPUT0", "TYPE_FP32", [4]), ("OUTPUT1", "TYPE_FP32", [4])]
    with pytest.raises(InferenceServerException) as e:
        _add_sub(onnx_client, "add_sub_auto", *_rows(5, 2))
    assert "batch-size must be <= 4" in e.value.message()


def test_auto_complete_of_a_graph_with_a_fixed_first_dimension_does_not_batch(onnx_client):
    config = onnx_client.get_model_config("add_sub_fixed")
    assert config["max_batch_size"] == 0 and "dynamic_batching" not in config
    assert [t["dims"] for t in config["input"]] == [[2, 4], [2, 4]]
    a, b = _rows(2, 3)
    total, _ = _add_sub(onnx_client, "add_sub_fixed", a, b)
    np.testing.assert_allclose(total, a + b, rtol=1e-6)


def test_a_dynamic_batcher_without_max_batch_size_gets_the_completed_one(onnx_client):
    """``dynamic_batching`` with no max_batch_size is not refused before the backend completes the
    config: the graph batches, so the completed config has max_batch_size 4 and keeps the
    batcher's settings."""
    config = onnx_client.get_model_config("batcher_only")
    assert config["max_batch_size"] == 4
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 100


def test_default_max_batch_size_is_what_auto_complete_gives_a_model_that_batches(module_factory, tmp_path):
    """--backend-config onnxruntime,default-max-batch-size=N, as Triton's: the max_batch_size an
    ONNX model that can batch gets when its config sets none (it was always 4, with a warning that
    the setting had no effect); 0 leaves such a model unbatched, its dims whole."""
    repo = tmp_path / "repo"
    om.write(repo, "auto", om.add_sub(), None)
    wide = module_factory.create([repo], ["--backend-config", "onnxruntime,default-max-batch-size=16"]).start()
    plain = module_factory.create([repo], ["--backend-config", "default-max-batch-size=0"]).start()
    wide.wait_ready(), plain.wait_ready()
    c, p = wide.client(), plain.client()
    try:
        config = c.get_model_config("auto")
        assert config["max_batch_size"] == 16 and "dynamic_batching" in config
        assert "default-max-batch-size" not in wide.log()
        config = p.get_model_config("auto")
        assert config.get("max_batch_size", 0) == 0 and "dynamic_batching" not in config
        assert [i["dims"] for i in config["input"]] == [[-1, 4], [-1, 4]]
        a, b = _rows(3, 5)
        np.testing.assert_allclose(_add_sub(p, "auto", a, b)[0], a + b, rtol=1e-6)
    finally:
        c.close()
        p.close()


def test_disable_auto_complete_config_leaves_the_config_as_written(module_factory, tmp_path):
    """With --disable-auto-complete-config a config without inputs is not completed, so the
    graph's inputs are fed by nothing and the model does not load; a full config serves."""
    repo = tmp_path / "repo"
    om.write(repo, "bare", om.add_sub(), 'name: "bare"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 4\n')
    om.write(repo, "full", om.add_sub(), add_sub_config("full"))
    server = module_factory.create([repo], ["--disable-auto-complete-config", "--exit-on-error=false"]).start()
    server.wait_until(lambda: _states(server) == {"bare": "UNAVAILABLE", "full": "READY"}, "bare refused")
    reason = _index(server)["bare"]["reason"]
    assert reason.endswith(": unable to load model 'bare', configuration expects 0 inputs, model provides 2"), reason
    c = server.client()
    try:
        assert c.get_model_config("full")["max_batch_size"] == 8
        a, b = _rows(2, 4)
        np.testing.assert_allclose(_add_sub(c, "full", a, b)[1], a - b, rtol=1e-6)
    finally:
        c.close()


# -- configs the graph cannot serve -------------------------------------------------------------


@pytest.mark.parametrize("model", sorted(LOAD_ERRORS))
def test_a_config_the_graph_cannot_serve_is_a_load_error_naming_why(onnx_server, model):
    entry = _index(onnx_server)[model]
    assert entry["state"] == "UNAVAILABLE"
    assert model in entry["reason"]
    for words in LOAD_ERRORS[model]:
        assert words in entry["reason"], entry["reason"]
    assert onnx_server.worker_pids(model) == []


def test_honoured_optimization_fields_are_applied_and_not_warned_about(onnx_server):
    """``optimization.graph`` and the accelerators are the ONNX backend's own: no "not supported"
    warning for them, and the session log line shows the options the parameters set. A GPU
    accelerator on a KIND_CPU instance is not used, as in Triton."""
    log = onnx_server.log()
    assert "model 'tuned': config field 'optimization" not in log
    line = next(line for line in log.splitlines() if "onnxruntime" in line and "tuned/1/model.onnx" in line)
    for words in ("['CPUExecutionProvider']", "graph optimization ORT_ENABLE_EXTENDED", "execution mode ORT_PARALLEL",
                  "intra-op threads 1", "inter-op threads 2"):
        assert words in line, line


# -- sequences, datatypes, ensembles, BLS, warm-up ----------------------------------------------


def test_implicit_state_carries_a_running_sum_per_sequence(onnx_server):
    """STATE_IN/STATE_OUT are graph tensors the server feeds back: two interleaved sequences keep
    their own sums, and a new START begins from the initial state (zeros)."""
    c = onnx_server.client()

    def step(seq: int, value: float, start: bool = False, end: bool = False) -> float:
        x = _input("VALUE", np.array([[value]], np.float32), "FP32")
        r = c.infer("accumulate", [x], sequence_id=seq, sequence_start=start, sequence_end=end)
        return float(r.as_numpy("SUM")[0, 0])

    try:
        assert step(11, 1.0, start=True) == 1.0
        assert step(12, 100.0, start=True) == 100.0
        assert step(11, 2.0) == 3.0
        assert step(12, 5.0) == 105.0
        assert step(11, 4.0, end=True) == 7.0
        assert step(11, 10.0, start=True) == 10.0
        assert step(12, 1.0, end=True) == 106.0
        assert step(11, 1.0, end=True) == 11.0
    finally:
        c.close()


def test_sequences_of_different_lengths_are_never_batched_together(onnx_server):
    """Four sequences whose requests differ in length, all in flight at once on one instance: the
    sequence batcher batches only requests of one shape (the backend concatenates them), so every
    step gets its own row's sum and none fails."""
    import concurrent.futures

    def run(seq: int) -> list[float]:
        c = onnx_server.client()
        try:
            sums = []
            for i in range(6):
                x = _input("VALUE", np.full((1, seq), float(i), np.float32), "FP32")
                r = c.infer("row_sums", [x], sequence_id=seq, sequence_start=i == 0, sequence_end=i == 5)
                sums.append(float(r.as_numpy("SUM")[0, 0]))
            return sums
        finally:
            c.close()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = dict(zip((2, 3, 4, 5), pool.map(run, (2, 3, 4, 5))))
    assert got == {seq: [float(seq * i) for i in range(6)] for seq in (2, 3, 4, 5)}


TYPED_VALUES = {
    "BOOL": np.array([[True, False, True]]),
    "UINT8": np.array([[0, 7, 255]], np.uint8), "UINT16": np.array([[0, 7, 65535]], np.uint16),
    "UINT32": np.array([[0, 7, 2 ** 32 - 1]], np.uint32), "UINT64": np.array([[0, 7, 2 ** 64 - 1]], np.uint64),
    "INT8": np.array([[-128, 0, 127]], np.int8), "INT16": np.array([[-32768, 0, 32767]], np.int16),
    "INT32": np.array([[-(2 ** 31), 0, 2 ** 31 - 1]], np.int32),
    "INT64": np.array([[-(2 ** 63), 0, 2 ** 63 - 1]], np.int64),
    "FP16": np.array([[-0.0, 65504.0, 0.333251953125]], np.float16),
    "FP32": np.array([[-0.0, 1e-45, 3.4028235e38]], np.float32),
    "FP64": np.array([[-0.0, 5e-324, 0.1]], np.float64),
    "BYTES": np.array([["h\u00e9llo".encode(), b"", "\u65e5\u672c".encode()]], dtype=object),
}


def test_every_datatype_crosses_an_onnx_graph_unchanged(onnx_client):
    """All numeric types, BOOL and BYTES (ONNX string tensors) in one request through Identity
    nodes, bit for bit."""
    result = onnx_client.infer("types", [_input(f"IN_{dt}", v, dt) for dt, v in TYPED_VALUES.items()])
    for dt, want in TYPED_VALUES.items():
        out = result.get_output(f"OUT_{dt}")
        assert out["datatype"] == dt and out["shape"] == [1, 3]
        got = result.as_numpy(f"OUT_{dt}")
        if dt == "BYTES":
            assert list(got.reshape(-1)) == list(want.reshape(-1))
        else:
            assert got.dtype == want.dtype
            assert got.tobytes() == want.tobytes()


def test_bf16_crosses_an_onnx_graph_unchanged(onnx_client):
    want = np.array([[1.0, -2.0, 3.140625, 65280.0]], ml_dtypes.bfloat16)
    result = onnx_client.infer("bf16", [_input("IN_BF16", want, "BF16"),
                                   _input("IN_FP32", np.zeros((1, 2), np.float32), "FP32")])
    assert result.get_output("OUT_BF16")["datatype"] == "BF16"
    assert result.as_numpy("OUT_BF16").tobytes() == want.tobytes()


def test_bytes_that_are_not_utf8_fail_only_their_own_request(onnx_client):
    """onnxruntime's Python API takes strings as text: invalid UTF-8 is that request's 400."""
    values = dict(TYPED_VALUES, BYTES=np.array([[b"\xff\xfe", b"a", b"b"]], dtype=object))
    with pytest.raises(InferenceServerException) as e:
        onnx_client.infer("types", [_input(f"IN_{dt}", v, dt) for dt, v in values.items()])
    assert e.value.status() == "400"
    assert "input 'IN_BYTES': an element is not valid UTF-8" in e.value.message()


def test_an_ensemble_runs_a_python_step_then_an_onnx_step(onnx_client):
    x, y = _rows(2, 5)
    result = onnx_client.infer("scaled_add_sub", [_input("X", x, "FP32"), _input("Y", y, "FP32")])
    np.testing.assert_allclose(result.as_numpy("SUM"), x * 10 + y, rtol=1e-5)
    np.testing.assert_allclose(result.as_numpy("DIFF"), x * 10 - y, rtol=1e-5)


def test_a_python_model_calls_an_onnx_model_through_bls(onnx_client):
    a, b = _rows(2, 6)
    result = onnx_client.infer("product", [_input("INPUT0", a, "FP32"), _input("INPUT1", b, "FP32")])
    np.testing.assert_allclose(result.as_numpy("PRODUCT"), (a + b) * (a - b), rtol=1e-5)


def test_warm_up_runs_before_the_model_is_ready(onnx_server, onnx_client):
    assert onnx_client.is_model_ready("warm")
    assert "warm-up done: 3 execution(s)" in onnx_server.log()


# -- the bundled example ------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.load
def test_digits_onnx_answers_as_its_torchscript_twin(server):
    """model_repository's digits_onnx (ONNX Runtime) and digits (TorchScript) give the same
    logits, within float tolerance, and the same predictions on every sklearn digit, served
    side by side; both agree with the TorchScript module run in this process."""
    from sklearn.datasets import load_digits

    ds = load_digits()
    x = (ds.images / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    c = server.client()
    try:
        onnx_logits, ts_logits = [], []
        for start in range(0, len(x), 64):
            batch = _input("INPUT__0", x[start:start + 64], "FP32")
            onnx_logits.append(c.infer("digits_onnx", [batch]).as_numpy("OUTPUT__0"))
            ts_logits.append(c.infer("digits", [batch]).as_numpy("OUTPUT__0"))
    finally:
        c.close()
    got, twin = np.concatenate(onnx_logits), np.concatenate(ts_logits)
    np.testing.assert_allclose(got, twin, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got.argmax(1), twin.argmax(1))
    assert float((got.argmax(1) == ds.target).mean()) >= 0.97
    module = torch.jit.load(str(PRODUCT_MODELS / "digits" / "1" / "model.pt"), map_location="cpu").eval()
    with torch.inference_mode():
        np.testing.assert_allclose(got[:64], module(torch.from_numpy(x[:64])).numpy(), rtol=1e-4, atol=1e-4)


def test_a_run_onnxruntime_fails_is_answered_in_tritons_words(onnx_client):
    """As Triton's onnxruntime backend words it (``RETURN_IF_ORT_ERROR``): "onnx runtime error
    <code>: <message>", a 500; the next run is served."""
    with pytest.raises(InferenceServerException) as e:
        onnx_client.infer("zeros", [_input("SHAPE", np.array([-1], np.int64), "INT64")])
    assert e.value.status() == "500" and e.value.message().startswith("onnx runtime error 1: "), e.value.message()
    assert "ConstantOfShape" in e.value.message()
    out = onnx_client.infer("zeros", [_input("SHAPE", np.array([3], np.int64), "INT64")]).as_numpy("OUT")
    assert out.tolist() == [0.0, 0.0, 0.0]


def test_an_onnx_model_reads_its_inputs_in_a_region_and_writes_its_outputs_there(onnx_server, onnx_client):
    """Inputs in a registered system region are read in place by ONNX Runtime (a read-only view of
    the region's guarded mapping: shm/region_io.py) and outputs written into another region: the
    answers follow what the client writes there from one request to the next, and a region the
    client truncated is a 400 naming it, with nothing else changed."""
    import tritonclient.utils.shared_memory as shm

    key = f"/shmserve_onnx_region_{onnx_server.id}"
    a, b = _rows(2, 7)
    ins = shm.create_shared_memory_region("onnx_in", key + "_in", 2 * a.nbytes)
    outs = shm.create_shared_memory_region("onnx_out", key + "_out", 2 * a.nbytes)
    onnx_client.register_system_shared_memory("onnx_in", key + "_in", 2 * a.nbytes)
    onnx_client.register_system_shared_memory("onnx_out", key + "_out", 2 * a.nbytes)
    try:
        def run() -> tuple[np.ndarray, np.ndarray]:
            inputs = [httpclient.InferInput("INPUT0", [2, 4], "FP32"), httpclient.InferInput("INPUT1", [2, 4], "FP32")]
            inputs[0].set_shared_memory("onnx_in", a.nbytes)
            inputs[1].set_shared_memory("onnx_in", a.nbytes, offset=a.nbytes)
            outputs = [httpclient.InferRequestedOutput("OUTPUT0"), httpclient.InferRequestedOutput("OUTPUT1")]
            outputs[0].set_shared_memory("onnx_out", a.nbytes)
            outputs[1].set_shared_memory("onnx_out", a.nbytes, offset=a.nbytes)
            onnx_client.infer("add_sub_onnx", inputs, outputs=outputs)
            return (shm.get_contents_as_numpy(outs, np.float32, [2, 4]),
                    shm.get_contents_as_numpy(outs, np.float32, [2, 4], offset=a.nbytes))

        for scale in (1, 3):  # (the second request reads what the client wrote since)
            shm.set_shared_memory_region(ins, [a * scale, b * scale])
            total, diff = run()
            np.testing.assert_allclose(total, (a + b) * scale, rtol=1e-6)
            np.testing.assert_allclose(diff, (a - b) * scale, rtol=1e-6)
        os.truncate("/dev/shm" + key + "_in", 16)
        with pytest.raises(InferenceServerException) as e:
            run()
        assert e.value.status() == "400" and "'onnx_in' was truncated since it was registered" in e.value.message()
        np.testing.assert_allclose(_add_sub(onnx_client, "add_sub_onnx", a, b)[0], a + b, rtol=1e-6)
    finally:
        onnx_client.unregister_system_shared_memory("onnx_in")
        onnx_client.unregister_system_shared_memory("onnx_out")
        shm.destroy_shared_memory_region(ins)
        shm.destroy_shared_memory_region(outs)
