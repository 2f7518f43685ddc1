"""Backends: TorchScript (digits), Python models that fail, run in parallel, and use pb_utils widely."""
from __future__ import annotations

import concurrent.futures
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import PRODUCT_MODELS, TESTS, pid_alive, raw_request, wait_pending, wait_until
from gates import Gate



def _input(name, data, datatype, binary=True):
    t = httpclient.InferInput(name, list(data.shape), datatype)
    t.set_data_from_numpy(data, binary_data=binary)
    return t


# -- TorchScript: digits --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_data():
    from sklearn.datasets import load_digits

    ds = load_digits()
    x = (ds.images / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    return x, ds.target


def test_digits_classifies_sklearn_digits(client, digits_data):
    x, y = digits_data
    predictions = []
    for start in range(0, len(x), 64):  # max_batch_size is 64
        batch = x[start:start + 64]
        result = client.infer("digits", [_input("INPUT__0", batch, "FP32")])
        logits = result.as_numpy("OUTPUT__0")
        assert logits.shape == (len(batch), 10)
        assert logits.dtype == np.float32
        predictions.append(logits.argmax(axis=1))
    accuracy = float((np.concatenate(predictions) == y).mean())
    # 98% on the held-out fifth, so well above 97% over the whole set.
    assert accuracy >= 0.97, accuracy


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.load, as the product itself uses
def test_digits_matches_the_torchscript_module_run_locally(client, digits_data):
    x, _ = digits_data
    batch = x[:37]
    module = torch.jit.load(str(PRODUCT_MODELS / "digits" / "1" / "model.pt"), map_location="cpu").eval()
    with torch.inference_mode():
        want = module(torch.from_numpy(batch)).numpy()
    got = client.infer("digits", [_input("INPUT__0", batch, "FP32")]).as_numpy("OUTPUT__0")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_digits_json_mode_single_image(client, digits_data):
    x, y = digits_data
    result = client.infer("digits", [_input("INPUT__0", x[5:6], "FP32", binary=False)],
                          outputs=[httpclient.InferRequestedOutput("OUTPUT__0", binary_data=False)])
    out = result.get_output("OUTPUT__0")
    assert out["shape"] == [1, 10]
    assert int(np.argmax(out["data"])) == int(y[5])


def test_digits_concurrent_requests_get_their_own_answers(server, client, digits_data):
    """Requests that may be batched together must each get back the rows of their own images."""
    x, _ = digits_data
    slices = [slice(i * 7, i * 7 + 1 + i % 4) for i in range(12)]
    alone = [client.infer("digits", [_input("INPUT__0", x[sl], "FP32")]).as_numpy("OUTPUT__0") for sl in slices]
    errors: list[BaseException] = []
    results: dict[int, np.ndarray] = {}
    barrier = threading.Barrier(len(slices))

    def run(i: int) -> None:
        try:
            c = server.client()
            barrier.wait()
            results[i] = c.infer("digits", [_input("INPUT__0", x[slices[i]], "FP32")]).as_numpy("OUTPUT__0")
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(slices))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for i in range(len(slices)):
        np.testing.assert_allclose(results[i], alone[i], rtol=1e-4, atol=1e-4)


# -- a Python model that raises ----------------------------------------------------------------------


def test_python_model_exception_is_an_error_response_and_worker_survives(server, client):
    good = client.infer("raiser", [_input("X", np.array([1, 2, 3], dtype=np.int32), "INT32")])
    np.testing.assert_array_equal(good.as_numpy("Y"), [2, 4, 6])
    pid_before = int(good.as_numpy("PID")[0])
    assert server.worker_pids("raiser") == [pid_before]

    with pytest.raises(InferenceServerException) as e:
        client.infer("raiser", [_input("X", np.array([1, -5, 3], dtype=np.int32), "INT32")])
    assert e.value.status() is not None and e.value.status().startswith("5"), e.value
    # Triton's Python backend words (checked on Triton 2.51 with a model raising in a function
    # its execute calls): the instance, the exception, then the model's frames, innermost first.
    model_py = TESTS / "models" / "main" / "raiser" / "1" / "model.py"
    line = next(i for i, text in enumerate(model_py.read_text().splitlines(), 1) if "raise ValueError" in text)
    assert e.value.message() == ("Failed to process the request(s) for model 'raiser_0_0', message: ValueError: "
                                 f"raiser cannot take negative numbers, got -5\n\nAt:\n  {model_py}({line}): execute\n")

    after = client.infer("raiser", [_input("X", np.array([10], dtype=np.int32), "INT32")])
    np.testing.assert_array_equal(after.as_numpy("Y"), [20])
    assert int(after.as_numpy("PID")[0]) == pid_before, "the worker process was replaced, not kept"
    assert pid_alive(pid_before)
    assert "raiser cannot take negative numbers" in server.log()


def test_a_model_without_instance_groups_gets_triton_s_default_one(server_factory, tmp_path):
    """No instance_group: one group named after the model, as Triton completes it, so its
    instance is '<model>_0' wherever an instance is named (here: the error of a raising execute)."""
    source = TESTS / "models" / "main" / "raiser"
    model = tmp_path / "repo" / "plain_raiser"
    shutil.copytree(source, model)
    config = (source / "config.pbtxt").read_text().replace('name: "raiser"', 'name: "plain_raiser"')
    (model / "config.pbtxt").write_text("\n".join(l for l in config.splitlines() if "instance_group" not in l))
    client = server_factory.start([tmp_path / "repo"]).client()
    try:
        group = client.get_model_config("plain_raiser")["instance_group"]
        assert [(g["name"], g["count"], g["kind"]) for g in group] == [("plain_raiser", 1, "KIND_CPU")]
        with pytest.raises(InferenceServerException) as e:
            client.infer("plain_raiser", [_input("X", np.array([-1], dtype=np.int32), "INT32")])
        assert e.value.message().startswith("Failed to process the request(s) for model 'plain_raiser_0', message: ")
    finally:
        client.close()


def test_python_model_exception_does_not_affect_other_models(server, client):
    with pytest.raises(InferenceServerException):
        client.infer("raiser", [_input("X", np.array([-1], dtype=np.int32), "INT32")])
    a = np.arange(16, dtype=np.int32)
    r = client.infer("add_sub", [_input("INPUT0", a, "INT32"), _input("INPUT1", a, "INT32")])
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), 2 * a)


# -- two instances run in parallel ------------------------------------------------------------------


def _sleeper_call(server, gate: Gate) -> tuple[float, bytes, int]:
    """(seconds, instance, worker pid) of one sleeper request held by ``gate``."""
    c = server.client()
    try:
        t0 = time.monotonic()
        r = c.infer("sleeper", [_input("X", np.array([1.0], dtype=np.float32), "FP32")],
                    parameters={"gate": gate.param})
        return time.monotonic() - t0, r.as_numpy("INSTANCE")[0], int(r.as_numpy("PID")[0])
    finally:
        c.close()


def test_two_instances_serve_two_requests_in_parallel(server, client, tmp_path):
    """Two requests held in the model at the same time, by two worker processes: they ran in
    parallel (each instance runs one execution at a time, so one instance could not)."""
    pids = server.worker_pids("sleeper")
    assert len(pids) == 2, server.titles()
    gate = Gate(tmp_path / "gate")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        try:
            calls = [pool.submit(_sleeper_call, server, gate) for _ in range(2)]
            assert sorted(gate.wait_started(2)) == sorted(pids)  # both executing at once
        finally:
            gate.open()
        out = [c.result() for c in calls]
    assert all(d >= 0.29 for d, _, _ in out), out  # each really slept
    assert {inst for _, inst, _ in out} == {b"sleeper_0_0", b"sleeper_0_1"}, out
    assert {pid for _, _, pid in out} == set(pids), out


def test_requests_beyond_instances_queue_and_complete(server, tmp_path):
    """Four requests on two instances: two run at once and two wait for them, then all complete."""
    pids = server.worker_pids("sleeper")
    gate = Gate(tmp_path / "gate")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        try:
            calls = [pool.submit(_sleeper_call, server, gate) for _ in range(4)]
            assert sorted(gate.wait_started(2)) == sorted(pids)
            wait_pending(server, "sleeper", 4)  # the other two have arrived...
            assert len(gate.started()) == 2  # ... and wait: no third execution at once
        finally:
            gate.open()
        out = [c.result() for c in calls]
    assert all(d >= 0.29 for d, _, _ in out), out
    assert {inst for _, inst, _ in out} == {b"sleeper_0_0", b"sleeper_0_1"}, out
    assert len(gate.started()) == 4 and set(gate.started()) == set(pids)


# -- pb_utils API ---------------------------------------------------------------------------------


TEXT = np.array([b"hello", b"shared", b"memory"], dtype=np.object_)


def _pb_infer(client, outputs=("UPPER", "LENGTHS", "INFO"), scale=None, **kw):
    inputs = [_input("TEXT", TEXT, "BYTES")]
    if scale is not None:
        inputs.append(_input("SCALE", np.array([scale], dtype=np.float32), "FP32"))
    outs = [httpclient.InferRequestedOutput(n) for n in outputs] if outputs is not None else None
    return client.infer("pbutils_full", inputs, outputs=outs, **kw)


def test_auto_complete_config_declares_inputs_and_outputs(client):
    cfg = client.get_model_config("pbutils_full")
    assert cfg["max_batch_size"] == 0
    inputs = {t["name"]: t for t in cfg["input"]}
    outputs = {t["name"]: t for t in cfg["output"]}
    assert set(inputs) == {"TEXT", "SCALE"}
    assert inputs["TEXT"]["data_type"] == "TYPE_STRING" and inputs["TEXT"]["dims"] == [-1]
    assert inputs["SCALE"]["optional"] is True
    assert set(outputs) == {"UPPER", "LENGTHS", "INFO"}
    assert outputs["LENGTHS"]["data_type"] == "TYPE_FP32"
    meta = client.get_model_metadata("pbutils_full")
    assert {t["name"]: (t["datatype"], t["shape"]) for t in meta["inputs"]} == {
        "TEXT": ("BYTES", [-1]), "SCALE": ("FP32", [1])}
    assert {t["name"]: (t["datatype"], t["shape"]) for t in meta["outputs"]} == {
        "UPPER": ("BYTES", [-1]), "LENGTHS": ("FP32", [-1]), "INFO": ("BYTES", [1])}


def test_auto_completed_inputs_are_enforced(client):
    with pytest.raises(InferenceServerException) as e:
        client.infer("pbutils_full", [_input("TEXT", np.array([1, 2], dtype=np.int32), "INT32")])
    assert e.value.status() == "400"
    assert "TEXT" in e.value.message() and "BYTES" in e.value.message()


def test_pb_utils_inputs_outputs_request_id_and_parameters(client):
    result = _pb_infer(client, scale=2.0, request_id="pb-7", parameters={"mode": "fast", "level": 3, "flag": True})
    assert [b for b in result.as_numpy("UPPER")] == [b"HELLO", b"SHARED", b"MEMORY"]
    lengths = result.as_numpy("LENGTHS")
    assert lengths.dtype == np.float32  # the dtype came from get_output_config_by_name
    np.testing.assert_array_equal(lengths, [10.0, 12.0, 12.0])
    info = json.loads(result.as_numpy("INFO")[0])
    assert info["request_id"] == "pb-7"
    assert info["parameters"] == {"mode": "fast", "level": 3, "flag": True}
    assert info["requested"] == ["INFO", "LENGTHS", "UPPER"]
    assert info["scale_given"] is True
    assert info["input_names"] == ["SCALE", "TEXT"]
    assert info["model_name"] == "pbutils_full"
    assert info["model_version"] == "1"
    assert info["model_instance_kind"] == "CPU"
    assert info["model_instance_name"] == "pbutils_full_0_0"
    assert result.get_response()["id"] == "pb-7"


def test_pb_utils_optional_input_absent(client):
    result = _pb_infer(client, outputs=("LENGTHS", "INFO"))
    np.testing.assert_array_equal(result.as_numpy("LENGTHS"), [5.0, 6.0, 6.0])
    info = json.loads(result.as_numpy("INFO")[0])
    assert info["scale_given"] is False and info["input_names"] == ["TEXT"]


def test_pb_utils_requested_output_subset_is_seen_by_the_model(client):
    result = _pb_infer(client, outputs=("INFO",))
    names = [o["name"] for o in result.get_response()["outputs"]]
    assert names == ["INFO"]
    assert json.loads(result.as_numpy("INFO")[0])["requested"] == ["INFO"]


def test_pb_utils_no_outputs_requested_means_all_outputs(client):
    result = _pb_infer(client, outputs=None)
    names = sorted(o["name"] for o in result.get_response()["outputs"])
    assert names == ["INFO", "LENGTHS", "UPPER"]
    assert json.loads(result.as_numpy("INFO")[0])["requested"] == ["INFO", "LENGTHS", "UPPER"]


def test_pb_utils_triton_error_response(server, client):
    with pytest.raises(InferenceServerException) as e:
        _pb_infer(client, request_id="bad-1", parameters={"fail": "disk on fire"})
    assert e.value.status() == "500"  # TritonError's default code is INTERNAL
    assert "pbutils_full refused request 'bad-1': disk on fire" in e.value.message()
    # The model answered with an error, it did not crash: it keeps serving.
    ok = _pb_infer(client, outputs=("UPPER",))
    assert list(ok.as_numpy("UPPER")) == [b"HELLO", b"SHARED", b"MEMORY"]


def test_pb_utils_triton_error_code_maps_to_http_status(client):
    with pytest.raises(InferenceServerException) as e:
        _pb_infer(client, request_id="bad-2", parameters={"fail": "invalid_arg"})
    assert "pbutils_full refused request 'bad-2': invalid_arg" in e.value.message()
    assert e.value.status() == "400"


def test_pb_utils_response_parameters_reach_the_client(client):
    result = _pb_infer(client, outputs=("UPPER",))
    assert result.get_response().get("parameters") == {"served_by": "pbutils_full_0_0", "element_count": 3}


def test_response_parameters_through_the_local_client_are_each_results_own(server):
    """The local client shares the parsed answer document of repeated answers: a caller that
    changes one result's parameters must not change the next result's."""
    from shmserve.shm.client import Client

    with Client(server.id) as local:
        first = local.infer("pbutils_full", {"TEXT": TEXT}, ["UPPER"])
        assert first.parameters == {"served_by": "pbutils_full_0_0", "element_count": 3}
        first.parameters["served_by"] = "changed"
        second = local.infer("pbutils_full", {"TEXT": TEXT}, ["UPPER"])
        assert second.parameters == {"served_by": "pbutils_full_0_0", "element_count": 3}
        assert second["UPPER"].tolist() == [b"HELLO", b"SHARED", b"MEMORY"]


def test_pb_utils_logger_reaches_the_server_log(server, client):
    _pb_infer(client, request_id="log-me-31337", outputs=("UPPER",))
    with pytest.raises(InferenceServerException):
        _pb_infer(client, request_id="log-me-too-31338", parameters={"fail": "x"})
    wait_until(lambda: "served request 'log-me-31337'" in server.log()
               and "refusing request 'log-me-too-31338'" in server.log(), "the model's log lines in the server log")
    log = server.log()
    assert "pbutils_full initialized as pbutils_full_0_0" in log
    assert "pbutils_full served request 'log-me-31337'" in log
    assert "pbutils_full refusing request 'log-me-too-31338'" in log


def test_pb_utils_model_over_json_wire(server):
    body = json.dumps({"id": "wire-1", "parameters": {"k": "v"},
                       "inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [2], "data": ["ab", "c\u00e9"]}],
                       "outputs": [{"name": "UPPER"}, {"name": "INFO"}]}).encode()
    raw = raw_request(server.port, "POST", "/v2/models/pbutils_full/infer", body)
    assert raw.status == 200, raw
    doc = raw.json()
    assert doc["id"] == "wire-1"
    outs = {o["name"]: o for o in doc["outputs"]}
    assert outs["UPPER"]["data"] == ["AB", "C\u00e9"]  # bytes.upper() leaves non-ASCII alone
    info = json.loads(outs["INFO"]["data"][0])
    assert info["parameters"] == {"k": "v"} and info["request_id"] == "wire-1"


def _torchscript_model(repo: Path, name: str, module: torch.nn.Module, config: str) -> None:
    """``module``, scripted, as version 1 of TorchScript model ``name`` in ``repo``; ``config``:
    what its config.pbtxt says past its name and platform."""
    version = repo / name / "1"
    version.mkdir(parents=True)
    torch.jit.save(torch.jit.script(module), str(version / "model.pt"))
    (version.parent / "config.pbtxt").write_text(f'name: "{name}"\nplatform: "pytorch_libtorch"\n' + config)


class _Complex(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.complex(x, x)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.script/save
def test_an_output_of_a_type_the_protocol_lacks_is_an_error_and_the_worker_survives(server_factory, tmp_path):
    """A TorchScript model whose output is complex (no KServe datatype): a 500 naming the dtype,
    every time, and the same worker answers on."""
    _torchscript_model(tmp_path / "repo", "complex", _Complex(), (
        'max_batch_size: 0\n'
        'input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'))
    server = server_factory.start([tmp_path / "repo"])
    client = server.client()
    try:
        x = httpclient.InferInput("INPUT__0", [2], "FP32")
        x.set_data_from_numpy(np.array([1.0, 2.0], dtype=np.float32))
        pids = set()
        for _ in range(3):  # (the second and later answers may take a kept way)
            with pytest.raises(InferenceServerException) as e:
                client.infer("complex", [x])
            assert "unsupported numpy dtype complex64" in e.value.message()
            pids |= {pid for pid, title in server.titles().items() if title.startswith("shmserve worker complex ")}
        assert len(pids) == 1
    finally:
        client.close()


class _Offset(torch.nn.Module):
    def forward(self, x: torch.Tensor, offset: Optional[torch.Tensor] = None) -> torch.Tensor:
        return x if offset is None else x + offset


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.script/save
def test_an_absent_optional_input_reaches_a_torchscript_model_as_absent(server_factory, tmp_path):
    """An input the config marks optional, left out of a request, is left out of forward()'s
    arguments (its default applies; one followed by a present input is passed as None), rather than
    a KeyError and a 500."""
    _torchscript_model(tmp_path / "repo", "offset", _Offset(), (
        'max_batch_size: 4\n'
        'input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] },\n'
        '        { name: "INPUT__1" data_type: TYPE_FP32 dims: [ 2 ] optional: true } ]\n'
        'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'))
    client = server_factory.start([tmp_path / "repo"]).client()
    try:
        x = np.array([[1.0, 2.0]], dtype=np.float32)
        alone = client.infer("offset", [_input("INPUT__0", x, "FP32")])
        np.testing.assert_array_equal(alone.as_numpy("OUTPUT__0"), x)
        both = client.infer("offset", [_input("INPUT__0", x, "FP32"), _input("INPUT__1", x * 10, "FP32")])
        np.testing.assert_array_equal(both.as_numpy("OUTPUT__0"), x * 11)
    finally:
        client.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.script/save
def test_a_gpu_instance_without_cuda_is_a_load_error_naming_the_model(server_factory, tmp_path, monkeypatch):
    """KIND_GPU where CUDA is not available (no GPU visible to the server, or a CPU build of torch)
    is the model's load error, UNAVAILABLE with the reason, not a GPU instance quietly running on
    the CPU."""
    _torchscript_model(tmp_path / "repo", "gpu_only", _Offset(), (
        'max_batch_size: 0\n'
        'input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'instance_group [ { count: 1 kind: KIND_GPU } ]\n'))
    # An empty mask hides any GPU this host has, so the test means the same on a GPU host.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    server = server_factory.start([tmp_path / "repo"], ["--exit-on-error=false"], wait=False)

    def entry() -> dict:
        """The model's repository index entry ({} while the server is still starting)."""
        try:
            raw = raw_request(server.port, "POST", "/v2/repository/index", b"{}")
        except OSError:
            return {}
        return {e["name"]: e for e in raw.json()}.get("gpu_only", {}) if raw.status == 200 else {}

    server.wait_until(lambda: entry().get("state") == "UNAVAILABLE", "gpu_only refused")
    reason = entry()["reason"]
    assert "gpu_only" in reason and "CUDA is not available" in reason, reason
    assert server.worker_pids("gpu_only") == []


def test_pb_utils_requests_the_worker_builds_read_as_constructed_ones():
    """The worker builds incoming requests without ``__init__`` (``_incoming``), with the fields
    alike for all of them read from the class: each reads as a request constructed with the same
    values, and each has its own trace handle and cancellation state."""
    from shmserve.workers.backend import Request
    from shmserve.workers.python_backend import pb_utils

    x = pb_utils.Tensor("INPUT0", np.zeros(4, dtype=np.float32))
    inputs = {"INPUT0": x.as_numpy()}
    built = pb_utils.InferenceRequest._incoming("m", [x], Request(inputs, ["OUTPUT0"], "id-1", 7))
    other = pb_utils.InferenceRequest._incoming("m", [x], Request(inputs, ["OUTPUT0"], "id-2", 8, 0, {"a": 1}))
    made = pb_utils.InferenceRequest(request_id="id-1", correlation_id=7, inputs=[x],
                                     requested_output_names=["OUTPUT0"], model_name="m")
    for name in ("request_id", "correlation_id", "flags", "timeout", "parameters", "requested_output_names",
                 "is_cancelled"):
        assert getattr(built, name)() == getattr(made, name)(), name
    assert built.trace().get_context() is None and built.trace() is built.trace()
    assert built.trace() is not other.trace()
    assert json.loads(other.parameters()) == {"a": 1}
    built._set_cancelled()
    assert built.is_cancelled() and not other.is_cancelled()
    assert pb_utils.get_input_tensor_by_name(built, "INPUT0") is x


def test_pb_utils_star_import_gives_tritons_names_and_ours():
    """The package a model imports as ``triton_python_backend_utils`` re-exports Triton's names
    each listed in ``__all__``, so ``import *`` gives them all; the custom-metric kinds only as
    Triton's stub gives them, on ``MetricFamily`` (no ``pb_utils.COUNTER``, no ``MetricKind``)."""
    from shmserve.workers.python_backend import pb_utils

    triton = {"Tensor", "InferenceRequest", "InferenceResponse", "TritonError", "TritonModelException", "Logger",
              "PreferredMemory", "ModelConfig", "MetricFamily", "InferenceTrace",
              "get_input_tensor_by_name", "get_output_tensor_by_name", "get_input_config_by_name",
              "get_output_config_by_name", "using_decoupled_model_transaction_policy", "triton_to_numpy_type",
              "numpy_to_triton_type", "triton_string_to_numpy", "serialize_byte_tensor",
              "deserialize_bytes_tensor", "get_model_dir", "load_model", "unload_model", "is_model_ready",
              "TRITON_STRING_TO_NUMPY", "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START",
              "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END", "TRITONSERVER_RESPONSE_COMPLETE_FINAL",
              "TRITONSERVER_REQUEST_RELEASE_ALL", "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE",
              "TRITONSERVER_MEMORY_GPU", "TRITONSERVER_MEMORY_CPU"}
    ours = {"MemoryType", "Metric"}
    names: dict = {}
    exec("from shmserve.workers.python_backend.pb_utils import *", names)
    assert set(pb_utils.__all__) == triton | ours
    assert set(names) - {"__builtins__"} == triton | ours
    assert pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL == 1
    assert (pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.HISTOGRAM) == (0, 1, 2)
    assert not any(hasattr(pb_utils, name) for name in ("COUNTER", "GAUGE", "HISTOGRAM", "MetricKind"))
    # Triton's memory types are a pybind11 enum: its values are ints, and print with their names
    assert (pb_utils.TRITONSERVER_MEMORY_GPU, pb_utils.TRITONSERVER_MEMORY_CPU) == (0, 1)
    assert str(pb_utils.TRITONSERVER_MEMORY_CPU) == "MemoryType.TRITONSERVER_MEMORY_CPU"


class _ShapeProbe(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return x.reshape(2, 2), torch.tensor(x.shape, dtype=torch.int64)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.script/save
def test_a_torchscript_model_gets_its_reshape_and_the_client_the_config_dims(server_factory, tmp_path):
    """A config ``reshape`` holds for PyTorch as for Python models (the worker applies it): the
    module gets INPUT__0 as [4] and the client gets OUTPUT__0 back as dims [4], as in Triton."""
    _torchscript_model(tmp_path / "repo", "shape_probe", _ShapeProbe(), (
        'max_batch_size: 0\n'
        'input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2, 2 ] reshape { shape: [ 4 ] } } ]\n'
        'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] reshape { shape: [ 2, 2 ] } },\n'
        '         { name: "OUTPUT__1" data_type: TYPE_INT64 dims: [ -1 ] } ]\n'))
    client = server_factory.start([tmp_path / "repo"]).client()
    try:
        x = np.arange(4, dtype=np.float32).reshape(2, 2)
        result = client.infer("shape_probe", [_input("INPUT__0", x, "FP32")])
        assert result.as_numpy("OUTPUT__1").tolist() == [4]
        assert result.as_numpy("OUTPUT__0").tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        client.close()


class _GradProbe(torch.nn.Module):
    """Says how it runs: whether its result is an inference tensor, whether autograd records."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        return torch.tensor([int(y.is_inference()), int(torch.is_grad_enabled())], dtype=torch.int64)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.script/save
def test_the_pytorch_parameters_triton_reads_are_applied_and_checked(server_factory, tmp_path):
    """Triton's PyTorch backend parameters: INFERENCE_MODE (on by default, as in Triton 2.51;
    "false" runs under no_grad), the threads and JIT settings, each said in the log; a value that
    is not of its kind fails the load, naming the parameter, in one line."""
    io = ('max_batch_size: 0\n'
          'input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
          'output [ { name: "OUTPUT__0" data_type: TYPE_INT64 dims: [ 2 ] } ]\n')

    def params(**kv: str) -> str:
        return "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in kv.items())

    repo = tmp_path / "repo"
    _torchscript_model(repo, "default_mode", _GradProbe(), io)
    _torchscript_model(repo, "no_grad_mode", _GradProbe(), io + params(
        INFERENCE_MODE="false", INTRA_OP_THREAD_COUNT="1", DISABLE_OPTIMIZED_EXECUTION="true",
        ENABLE_JIT_EXECUTOR="false", ENABLE_DETERMINISTIC_ALGORITHMS="true", ENABLE_WEIGHT_SHARING="true"))
    _torchscript_model(repo, "bad_value", _GradProbe(), io + params(INFERENCE_MODE="maybe"))
    server = server_factory.start([repo], ["--exit-on-error=false", "--strict-readiness=false"])
    client = server.client()
    try:
        x = httpclient.InferInput("INPUT__0", [2], "FP32")
        x.set_data_from_numpy(np.ones(2, dtype=np.float32))
        assert client.infer("default_mode", [x]).as_numpy("OUTPUT__0").tolist() == [1, 0]  # inference mode
        assert client.infer("no_grad_mode", [x]).as_numpy("OUTPUT__0").tolist() == [0, 0]  # no_grad
        assert ("instance 'no_grad_mode_0': intra-op threads 1, deterministic algorithms enabled, JIT executor "
                "disabled, optimized execution disabled, inference mode disabled (no_grad)") in server.log()
        index = {m["name"]: m for m in client.get_model_repository_index()}
        assert index["bad_value"]["state"] == "UNAVAILABLE"
        assert index["bad_value"]["reason"].endswith(
            "parameter 'INFERENCE_MODE': failed to convert 'maybe' to a boolean"), index["bad_value"]
        assert "ParameterError" not in index["bad_value"]["reason"]
    finally:
        client.close()


# -- TorchScript: how inputs and outputs bind, as Triton's PyTorch backend binds them -------------

class _Three(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return x + 1, x + 2, x + 3


class _Masked(torch.nn.Module):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return input_ids * 10 + attention_mask


class _MaskedWithTypes(torch.nn.Module):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        return input_ids * 10 + attention_mask


class _Long(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2).long()


class _DictIn(torch.nn.Module):
    def forward(self, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        return inputs["a"] * 10 + inputs["b"]


class _Started(torch.nn.Module):
    def forward(self, x: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        return x + start * 100


class _Words(torch.nn.Module):
    def forward(self, words: List[str]) -> List[str]:
        return [w.upper() for w in words]


_MASK_INPUTS = ('input [ { name: "attention_mask" data_type: TYPE_INT64 dims: [ 3 ] },\n'
                '        { name: "input_ids" data_type: TYPE_INT64 dims: [ 3 ] } ]\n'
                'output [ { name: "OUTPUT__0" data_type: TYPE_INT64 dims: [ 3 ] } ]\n')


@pytest.fixture(scope="module")
def binding_server(module_factory, tmp_path_factory):
    repo = tmp_path_factory.mktemp("binding") / "repo"
    _torchscript_model(repo, "subset_out", _Three(), (
        'max_batch_size: 4\ninput [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'output [ { name: "scores__1" data_type: TYPE_FP32 dims: [ 2 ] },\n'
        '         { name: "labels__2" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'))
    _torchscript_model(repo, "named_order", _Masked(), 'max_batch_size: 4\n' + _MASK_INPUTS)
    _torchscript_model(repo, "extra_arg", _MaskedWithTypes(), 'max_batch_size: 4\n' + _MASK_INPUTS)
    _torchscript_model(repo, "wrong_dtype", _Long(), (
        'max_batch_size: 0\ninput [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'))
    _torchscript_model(repo, "dict_in", _DictIn(), (
        'max_batch_size: 4\ninput [ { name: "b" data_type: TYPE_INT64 dims: [ 2 ] },\n'
        '        { name: "a" data_type: TYPE_INT64 dims: [ 2 ] } ]\n'
        'output [ { name: "OUTPUT__0" data_type: TYPE_INT64 dims: [ 2 ] } ]\n'))
    _torchscript_model(repo, "words", _Words(), (
        'max_batch_size: 0\ninput [ { name: "INPUT__0" data_type: TYPE_STRING dims: [ -1 ] } ]\n'
        'output [ { name: "OUTPUT__0" data_type: TYPE_STRING dims: [ -1 ] } ]\n'))
    _torchscript_model(repo, "batched_words", _Words(), (
        'max_batch_size: 4\ninput [ { name: "INPUT__0" data_type: TYPE_STRING dims: [ -1 ] } ]\n'
        'output [ { name: "OUTPUT__0" data_type: TYPE_STRING dims: [ -1 ] } ]\n'))
    _torchscript_model(repo, "backend_only", _Long(), (
        'max_batch_size: 0\ninput [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'output [ { name: "OUTPUT__0" data_type: TYPE_INT64 dims: [ 2 ] } ]\n'))
    config = (repo / "backend_only" / "config.pbtxt").read_text()
    (repo / "backend_only" / "config.pbtxt").write_text(config.replace('platform: "pytorch_libtorch"', 'backend: "pytorch"'))
    _torchscript_model(repo, "started", _Started(), (
        'max_batch_size: 2\ninput [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'sequence_batching { control_input [ { name: "START__1"\n'
        '  control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] } ] }\n'))
    _torchscript_model(repo, "bf16_in", _Long(), (
        'max_batch_size: 0\ninput [ { name: "INPUT__0" data_type: TYPE_BF16 dims: [ 2 ] } ]\n'
        'output [ { name: "OUTPUT__0" data_type: TYPE_INT64 dims: [ 2 ] } ]\n'))
    _torchscript_model(repo, "uint32_out", _Long(), (
        'max_batch_size: 0\ninput [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'output [ { name: "OUTPUT__0" data_type: TYPE_UINT32 dims: [ 2 ] } ]\n'))
    (repo / "no_inputs" / "1").mkdir(parents=True)
    torch.jit.save(torch.jit.script(_Long()), str(repo / "no_inputs" / "1" / "model.pt"))
    (repo / "no_inputs" / "config.pbtxt").write_text('platform: "pytorch_libtorch"\nmax_batch_size: 0\n'
                                                     'output [ { name: "OUTPUT__0" data_type: TYPE_INT64 dims: [ 2 ] } ]\n')
    return module_factory.start([repo], ["--exit-on-error=false", "--strict-readiness=false"])


def _load_error(server, model: str) -> str:
    index = {e["name"]: e for e in server.client().get_model_repository_index()}
    assert index[model]["state"] == "UNAVAILABLE", index[model]
    return index[model]["reason"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_outputs_named_with_an_index_take_that_element_of_what_forward_returns(binding_server):
    """A config that lists only some of the returned tuple (``scores__1``, ``labels__2`` of three)
    gets elements 1 and 2, as Triton gives them, not the first two."""
    out = binding_server.client().infer("subset_out", [_input("INPUT__0", np.zeros((1, 2), np.float32), "FP32")])
    assert out.as_numpy("scores__1").tolist() == [[2, 2]] and out.as_numpy("labels__2").tolist() == [[3, 3]]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_inputs_named_as_forward_arguments_bind_by_name_and_a_count_that_differs_is_refused(binding_server):
    """Inputs named as forward()'s arguments bind by name whatever the config's order; a forward()
    with another number of arguments (a third, optional one) is refused at load in Triton's words,
    where it used to get its inputs swapped."""
    client = binding_server.client()
    ids, mask = np.array([[1, 2, 3]], np.int64), np.array([[1, 1, 0]], np.int64)
    out = client.infer("named_order", [_input("input_ids", ids, "INT64"), _input("attention_mask", mask, "INT64")])
    assert out.as_numpy("OUTPUT__0").tolist() == [[11, 21, 30]]
    assert _load_error(binding_server, "extra_arg").endswith(
        ": unable to load model 'extra_arg', configuration expects 2 inputs, model provides 3")
    assert _load_error(binding_server, "no_inputs").endswith(  # (Triton counts first)
        ": unable to load model 'no_inputs', configuration expects 0 inputs, model provides 1")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_an_output_of_another_datatype_than_its_config_is_refused_in_tritons_words(binding_server):
    client = binding_server.client()
    with pytest.raises(InferenceServerException) as e:
        client.infer("wrong_dtype", [_input("INPUT__0", np.array([1, 2], np.float32), "FP32")])
    assert e.value.status() == "400"
    assert e.value.message() == "configuration expects datatype TYPE_FP32 for output 'OUTPUT__0', model provides " \
                                "TYPE_INT64"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_datatype_tritons_pytorch_backend_does_not_take_is_refused_at_load(binding_server):
    """TYPE_BF16 and TYPE_UINT16/32/64 have no TorchScript tensor in Triton's PyTorch backend: the
    load fails in its words, where the model loaded and failed every request ("can't convert
    np.ndarray of type ml_dtypes.bfloat16")."""
    assert _load_error(binding_server, "bf16_in").endswith(
        ": unsupported datatype TYPE_BF16 for input 'INPUT__0' for model 'bf16_in'")
    assert _load_error(binding_server, "uint32_out").endswith(
        ": unsupported datatype TYPE_UINT32 for output 'OUTPUT__0' for model 'uint32_out'")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_dict_input_and_string_lists_reach_forward_as_triton_passes_them(binding_server):
    """forward() taking one Dict[str, Tensor] gets every input by name; a model that does not
    batch takes a TYPE_STRING input as List[str] and returns one as BYTES; one that batches cannot
    (Triton's load error)."""
    client = binding_server.client()
    a, b = np.array([[1, 2]], np.int64), np.array([[3, 4]], np.int64)
    out = client.infer("dict_in", [_input("a", a, "INT64"), _input("b", b, "INT64")])
    assert out.as_numpy("OUTPUT__0").tolist() == [[13, 24]]
    words = np.array([b"ab", b"cD"], dtype=object)
    assert client.infer("words", [_input("INPUT__0", words, "BYTES")]).as_numpy("OUTPUT__0").tolist() == [b"AB", b"CD"]
    assert _load_error(binding_server, "batched_words").endswith(
        ": Triton only supports 1 dimensional List of String as input for 'INPUT__0' for model 'batched_words'")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_sequence_control_input_reaches_forward_at_its_index(binding_server):
    client = binding_server.client()
    x = np.array([[1.0]], np.float32)
    first = client.infer("started", [_input("INPUT__0", x, "FP32")], sequence_id=7, sequence_start=True)
    later = client.infer("started", [_input("INPUT__0", x, "FP32")], sequence_id=7, sequence_end=True)
    assert first.as_numpy("OUTPUT__0").tolist() == [[101.0]] and later.as_numpy("OUTPUT__0").tolist() == [[1.0]]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_pytorch_models_config_gets_the_backend_fields_triton_fills(binding_server):
    """As Triton's AutoCompleteBackendFields: platform pytorch_libtorch and model.pt, where the
    config named only the backend, and in the metadata too."""
    client = binding_server.client()
    config = client.get_model_config("backend_only")
    assert (config["platform"], config["backend"], config["default_model_filename"]) == \
        ("pytorch_libtorch", "pytorch", "model.pt")
    assert client.get_model_metadata("backend_only")["platform"] == "pytorch_libtorch"


# -- PyTorch 2 runtime: runtime "model.py" ---------------------------------------------------------

_AFFINE_PY = '''
import torch


class Affine(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)

    def forward(self, x, shift):
        y = self.linear(x) + shift
        return y, y.sum(dim=1, keepdim=True)
'''


def _pt2_model(repo: Path, name: str, parameters: str, weights: torch.nn.Module | None) -> None:
    version = repo / name / "1"
    version.mkdir(parents=True)
    (version / "model.py").write_text(_AFFINE_PY)
    if weights is not None:
        torch.save(weights.state_dict(), str(version / "model.pt"))
    (version.parent / "config.pbtxt").write_text(
        'backend: "pytorch"\nruntime: "model.py"\nmax_batch_size: 4\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 3 ] }, { name: "SHIFT" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] },\n'
        '         { name: "TOTAL" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'dynamic_batching { max_queue_delay_microseconds: 200000 }\n' + parameters)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.script/save
def test_the_pytorch_2_runtime_builds_model_py_with_its_state_dict(server_factory, tmp_path):
    """``runtime: "model.py"`` (Triton's PyTorch 2 runtime): the file's nn.Module is built, given the
    state_dict in model.pt beside it, compiled with TORCH_COMPILE_OPTIONAL_PARAMETERS, fed the
    config's inputs in order, and its tuple is the config's outputs in order; batched requests run as
    one forward. Parameters that have no effect are warned about by name: the TorchScript runtime's
    on a model.py model, the model.py runtime's on a TorchScript one, and ENABLE_NVFUSER anywhere."""
    torch.manual_seed(0)
    weights = torch.nn.Module()
    weights.linear = torch.nn.Linear(3, 2)
    with torch.no_grad():
        weights.linear.weight.copy_(torch.tensor([[1.0, 2.0, 3.0], [0.0, -1.0, 0.5]]))
        weights.linear.bias.copy_(torch.tensor([10.0, 20.0]))
    repo = tmp_path / "repo"

    def param(key: str, value: str) -> str:
        return f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'

    _pt2_model(repo, "affine", param("TORCH_COMPILE_OPTIONAL_PARAMETERS", '{\\"backend\\": \\"eager\\"}')
               + param("INFERENCE_MODE", "false") + param("ENABLE_NVFUSER", "true"), weights)
    _pt2_model(repo, "untrained", param("TORCH_COMPILE_OPTIONAL_PARAMETERS", '{\\"disable\\": true}'), None)
    _pt2_model(repo, "bad_compile", param("TORCH_COMPILE_OPTIONAL_PARAMETERS", '{\\"model\\": 1}'), weights)
    _torchscript_model(repo, "scripted", _Long(), (
        'max_batch_size: 0\ninput [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'output [ { name: "OUTPUT__0" data_type: TYPE_INT64 dims: [ 2 ] } ]\n' + param("NUM_THREADS", "2")))
    server = server_factory.start([repo], ["--exit-on-error=false", "--strict-readiness=false"])
    client = server.client()
    try:
        x = np.array([[1, 1, 1], [2, 0, 0]], np.float32)
        shift = np.array([[0, 0], [100, 100]], np.float32)
        clients = [server.client(), server.client()]  # (one client per thread)

        def infer(i: int, rows: int) -> httpclient.InferResult:
            return clients[i].infer("affine", [_input("X", x[:rows], "FP32"), _input("SHIFT", shift[:rows], "FP32")])

        try:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two requests, one batch of three rows
                first, second = pool.submit(infer, 0, 2), pool.submit(infer, 1, 1)
                out, alone = first.result(timeout=120), second.result(timeout=120)
        finally:
            for c in clients:
                c.close()
        assert out.as_numpy("Y").tolist() == [[16.0, 19.5], [112.0, 120.0]]
        assert out.as_numpy("TOTAL").tolist() == [[35.5], [232.0]]
        assert alone.as_numpy("Y").tolist() == [[16.0, 19.5]]
        untrained = client.infer("untrained", [_input("X", x, "FP32"), _input("SHIFT", shift, "FP32")])
        assert untrained.as_numpy("Y").shape == (2, 2)
        assert _load_error(server, "bad_compile").endswith(": 'model' is not an optional parameter for 'torch.compile'")
        assert client.get_model_config("affine").get("default_model_filename", "") == ""
        log = server.log()
        assert "instance 'affine_0': PyTorch 2 runtime (model.py), NUM_THREADS = 1; NUM_INTEROP_THREADS = 1" in log
        assert ("instance 'affine_0': parameter(s) INFERENCE_MODE are read by the TorchScript runtime only and have "
                "no effect with runtime 'model.py'") in log
        assert "model 'affine': parameter 'ENABLE_NVFUSER' is not supported" in log
        assert "model 'affine': config field 'runtime'" not in log
        assert "skipping model configuration auto-complete for 'scripted': not supported for pytorch backend" in log
        assert ("instance 'scripted_0': parameter(s) NUM_THREADS are read by the PyTorch 2 runtime (runtime: "
                "\"model.py\") only and have no effect on this TorchScript model") in log
    finally:
        client.close()


_IMPORTS_NAMES_PY = '''
import torch
from torch.nn import Linear, Module


class Scaler(Module):
    def forward(self, x):
        return (x * 2,)
'''


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_pytorch_2_runtime_builds_the_module_model_py_defines_not_one_it_imports(server_factory, tmp_path):
    """``from torch.nn import Linear, Module`` puts ``Linear`` and ``Module`` before ``Scaler`` in
    the file's names: the class built is the one the file defines (``Linear()`` failed the load,
    a bare ``Module`` every request)."""
    version = tmp_path / "repo" / "scaler" / "1"
    version.mkdir(parents=True)
    (version / "model.py").write_text(_IMPORTS_NAMES_PY)
    (version.parent / "config.pbtxt").write_text(
        'backend: "pytorch"\nruntime: "model.py"\nmax_batch_size: 0\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'parameters { key: "TORCH_COMPILE_OPTIONAL_PARAMETERS" value: { string_value: "{\\"disable\\": true}" } }\n')
    server = server_factory.start([tmp_path / "repo"], [])
    client = server.client()
    try:
        out = client.infer("scaler", [_input("X", np.array([1, 2], np.float32), "FP32")])
        assert out.as_numpy("Y").tolist() == [2.0, 4.0]
    finally:
        client.close()


def test_deserialize_bytes_tensor_of_a_truncated_buffer_raises_struct_error():
    """Triton's deserialize_bytes_tensor unpacks with ``struct``, so a truncated buffer raises
    ``struct.error`` there, which a model may catch; ours raises an error that is both that and the
    ValueError it raised before."""
    import struct

    from shmserve.workers.python_backend import pb_utils

    for cut in (b"\x05\x00\x00\x00ab", b"\x02\x00"):
        with pytest.raises(struct.error) as caught:
            pb_utils.deserialize_bytes_tensor(cut)
        assert isinstance(caught.value, ValueError)
    assert pb_utils.deserialize_bytes_tensor(b"\x02\x00\x00\x00ab").tolist() == [b"ab"]
