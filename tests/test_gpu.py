"""GPU paths on a real GPU: where instances land and the device id they are told, PyTorch models
(TorchScript and ``torch.export``) and ONNX models (onnxruntime's CUDA provider) on the GPU under
dynamic batching, and CUDA shared memory end to end with tritonclient over HTTP and gRPC, including
inputs and outputs that stay on the device.

Selected by device detection: on a host without a CUDA device that torch can use, every test here
is reported as skipped with that reason (the one skip the suite allows). ``tools/gpu_run.sh`` runs
them on a lent GPU machine.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import raw_request
from shmserve.workers.devices import cuda_device_count

GPU = cuda_device_count() > 0 and torch.cuda.is_available()
pytestmark = [
    pytest.mark.skipif(not GPU, reason="no CUDA device that torch can use on this host "
                                       "(workers.devices.cuda_device_count, torch.cuda.is_available)"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # torch.jit.trace/save
]

FEATURES, CLASSES = 8, 4


def small_net() -> torch.nn.Module:
    """The model every PyTorch test serves: fixed weights, so the CPU answer is the reference."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Linear(16, CLASSES)).eval()


def write_torchscript(version_dir: Path) -> None:
    version_dir.mkdir(parents=True)
    torch.jit.save(torch.jit.trace(small_net(), torch.randn(2, FEATURES)), str(version_dir / "model.pt"))


def write_exported(version_dir: Path) -> None:
    version_dir.mkdir(parents=True)
    batch = torch.export.Dim("batch", min=1, max=8)
    program = torch.export.export(small_net(), (torch.randn(2, FEATURES),), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(version_dir / "model.pt2"))


def pytorch_config(name: str, instances: str, extra: str = "") -> str:
    return (f'name: "{name}"\nplatform: "pytorch_libtorch"\nmax_batch_size: 8\n{extra}'
            f'input [ {{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ {FEATURES} ] }} ]\n'
            f'output [ {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ {CLASSES} ] }} ]\n'
            f'dynamic_batching {{ max_queue_delay_microseconds: 20000 }}\n{instances}\n')


DOUBLER = '''
import numpy as np
import torch
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            doubled = torch.from_dlpack(x.to_dlpack()) * 2
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor.from_dlpack("OUTPUT0", doubled),
                pb_utils.Tensor("ON_GPU", np.array([not x.is_cpu()], dtype=bool))]))
        return responses
'''

WHERE_AM_I = '''
import json
import os

import numpy as np
import torch
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        device_id = int(args["model_instance_device_id"])
        self.seen = json.dumps({
            "mask": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "device_id": args["model_instance_device_id"],
            "current": torch.cuda.current_device(),
            "uuid": str(torch.cuda.get_device_properties(device_id).uuid)}).encode()

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([self.seen], dtype=object))])
                for _ in requests]
'''


STATEFUL = '''
import numpy as np
import torch
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """SEEN is the state this request got; the state it leaves (one more) is a tensor on the
    instance's device, which the server keeps for the sequence's next request."""

    def initialize(self, args):
        gpu = args["model_instance_kind"] == "GPU"
        self.device = torch.device(f"cuda:{args['model_instance_device_id']}" if gpu else "cpu")

    def execute(self, requests):
        out = []
        for r in requests:
            state = torch.from_numpy(pb_utils.get_input_tensor_by_name(r, "STATE_IN").as_numpy()).to(self.device)
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SEEN", state.cpu().numpy()),
                pb_utils.Tensor.from_dlpack("STATE_OUT", state + 1)]))
        return out
'''


def python_config(name: str, inputs: str, outputs: str, instances: str, extra: str = "") -> str:
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n{extra}input [ {inputs} ]\n'
            f'output [ {outputs} ]\n{instances}\n')


def build_repository(root: Path) -> Path:
    """Every model the shared server serves."""
    write_torchscript(root / "net_ts" / "1")
    (root / "net_ts" / "config.pbtxt").write_text(
        pytorch_config("net_ts", "instance_group [ { count: 2 kind: KIND_GPU } ]"))
    write_exported(root / "net_pt2" / "1")
    (root / "net_pt2" / "config.pbtxt").write_text(
        pytorch_config("net_pt2", "instance_group [ { count: 2 kind: KIND_GPU } ]",
                       'default_model_filename: "model.pt2"\n'))
    write_torchscript(root / "net_auto" / "1")
    (root / "net_auto" / "config.pbtxt").write_text(
        pytorch_config("net_auto", "instance_group [ { count: 1 kind: KIND_AUTO } ]"))
    doubler_io = ('{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }',
                  '{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }, '
                  '{ name: "ON_GPU" data_type: TYPE_BOOL dims: [ 1 ] }')
    for name, extra in (("doubler_device", 'parameters { key: "FORCE_CPU_ONLY_INPUT_TENSORS" '
                                           'value: { string_value: "no" } }\n'),
                        ("doubler_host", "")):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(DOUBLER)
        (root / name / "config.pbtxt").write_text(
            python_config(name, *doubler_io, "instance_group [ { kind: KIND_GPU } ]", extra))
    (root / "gpu_state" / "1").mkdir(parents=True)
    (root / "gpu_state" / "1" / "model.py").write_text(STATEFUL)
    (root / "gpu_state" / "config.pbtxt").write_text(
        'name: "gpu_state"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "VALUE" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "SEEN" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'sequence_batching { max_sequence_idle_microseconds: 60000000\n'
        '  state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [ 2 ]\n'
        '            initial_state { data_type: TYPE_FP32 dims: [ 2 ] zero_data: true name: "zeros" } } ] }\n'
        'instance_group [ { kind: KIND_GPU } ]\n')
    return root


@pytest.fixture(scope="module")
def gpu_server(module_factory, tmp_path_factory):
    return module_factory.start([build_repository(tmp_path_factory.mktemp("gpu_repo"))])


@pytest.fixture
def http(gpu_server):
    c = gpu_server.client(concurrency=16)
    yield c
    c.unregister_cuda_shared_memory()
    c.close()


def _infer_rows(client: httpclient.InferenceServerClient, model: str, rows: np.ndarray) -> np.ndarray:
    inp = httpclient.InferInput("INPUT__0", list(rows.shape), "FP32")
    inp.set_data_from_numpy(rows)
    return client.infer(model, [inp]).as_numpy("OUTPUT__0")


# -- placement ------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["net_ts", "net_pt2"])
def test_pytorch_models_on_the_gpu_batch_and_answer_as_on_the_cpu(gpu_server, http, model):
    """Two instances on GPU 0 (workers titled gpu0); 32 concurrent requests of 1-3 rows are batched
    by the dynamic batcher and each answer equals the module run on the CPU."""
    titles = [t for pid, t in gpu_server.titles().items() if pid in gpu_server.worker_pids(model)]
    assert len(titles) == 2 and all(" gpu0 (server " in t for t in titles), titles
    rng = np.random.default_rng(1)
    batches = [rng.standard_normal((1 + i % 3, FEATURES), dtype=np.float32) for i in range(32)]
    pending = []
    for rows in batches:  # all in flight at once (tritonclient's own concurrency)
        inp = httpclient.InferInput("INPUT__0", list(rows.shape), "FP32")
        inp.set_data_from_numpy(rows)
        pending.append(http.async_infer(model, [inp]))
    answers = [p.get_result(timeout=60).as_numpy("OUTPUT__0") for p in pending]
    reference = small_net()
    for rows, got in zip(batches, answers):
        with torch.no_grad():
            want = reference(torch.from_numpy(rows)).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
    stats = http.get_inference_statistics(model)["model_stats"][0]
    assert stats["inference_count"] == sum(len(b) for b in batches)
    assert stats["execution_count"] < len(batches), stats  # requests were batched together


def test_kind_auto_places_the_instance_on_the_gpu(gpu_server, http):
    config = http.get_model_config("net_auto")
    assert [g["kind"] for g in config["instance_group"]] == ["KIND_GPU"], config["instance_group"]
    titles = [gpu_server.titles()[pid] for pid in gpu_server.worker_pids("net_auto")]
    assert len(titles) == 1 and " gpu0 (server " in titles[0], titles
    rows = np.ones((2, FEATURES), dtype=np.float32)
    with torch.no_grad():
        want = small_net()(torch.from_numpy(rows)).numpy()
    np.testing.assert_allclose(_infer_rows(http, "net_auto", rows), want, rtol=1e-3, atol=1e-4)


def _gpu_uuids() -> list[str]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True,
                         text=True, check=True, timeout=30).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


def test_a_worker_keeps_the_servers_mask_and_is_told_tritons_device_id(server_factory, tmp_path, monkeypatch):
    """The server runs under a CUDA_VISIBLE_DEVICES of GPU UUIDs, last first. The instance on the
    server's GPU 0 keeps that mask, is told device id 0 (as Triton tells it), has it as its current
    device, and that device is the mask's first entry."""
    mask = ",".join(reversed(_gpu_uuids()))
    (tmp_path / "repo" / "where" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "where" / "1" / "model.py").write_text(WHERE_AM_I)
    (tmp_path / "repo" / "where" / "config.pbtxt").write_text(python_config(
        "where", '{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }',
        '{ name: "OUT" data_type: TYPE_STRING dims: [ 1 ] }', "instance_group [ { kind: KIND_GPU gpus: [ 0 ] } ]"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)
    server = server_factory.start([tmp_path / "repo"])
    client = server.client()
    try:
        inp = httpclient.InferInput("IN", [1], "INT32")
        inp.set_data_from_numpy(np.array([1], dtype=np.int32))
        seen = json.loads(client.infer("where", [inp]).as_numpy("OUT")[0])
    finally:
        client.close()
    first = mask.split(",")[0]
    assert seen["mask"] == mask and seen["device_id"] == "0" and seen["current"] == 0, seen
    assert first.endswith(seen["uuid"]), (first, seen)


# -- CUDA shared memory -----------------------------------------------------------------------------

def _region(name: str, array: np.ndarray | None, byte_size: int = 0):
    import tritonclient.utils.cuda_shared_memory as cudashm

    handle = cudashm.create_shared_memory_region(name, byte_size or array.nbytes, 0)
    if array is not None:
        cudashm.set_shared_memory_region(handle, [array])
    return handle


def test_cuda_shared_memory_end_to_end_with_tritonclient(gpu_server, http):
    """Triton's simple_http_cudashm_client.py flow against a GPU model: register input and output
    regions, infer with both in device memory, read the answer from the output region, see the
    status, unregister; the handles opened at registration and closed after."""
    import tritonclient.utils.cuda_shared_memory as cudashm

    rows = np.random.default_rng(2).standard_normal((3, FEATURES), dtype=np.float32)
    out_bytes = 3 * CLASSES * 4
    handles = [_region("in", rows), _region("out", None, out_bytes)]
    try:
        http.register_cuda_shared_memory("in", cudashm.get_raw_handle(handles[0]), 0, rows.nbytes)
        http.register_cuda_shared_memory("out", cudashm.get_raw_handle(handles[1]), 0, out_bytes)
        status = {r["name"]: r for r in http.get_cuda_shared_memory_status()}
        assert status["in"]["device_id"] == 0 and int(status["in"]["byte_size"]) == rows.nbytes, status
        inp = httpclient.InferInput("INPUT__0", list(rows.shape), "FP32")
        inp.set_shared_memory("in", rows.nbytes)
        out = httpclient.InferRequestedOutput("OUTPUT__0", binary_data=True)
        out.set_shared_memory("out", out_bytes)
        for model in ("net_ts", "net_pt2"):
            result = http.infer(model, [inp], outputs=[out])
            meta = result.get_output("OUTPUT__0")
            assert meta["shape"] == [3, CLASSES] and meta["parameters"]["shared_memory_byte_size"] == out_bytes
            got = cudashm.get_contents_as_numpy(handles[1], np.float32, [3, CLASSES])
            with torch.no_grad():
                want = small_net()(torch.from_numpy(rows)).numpy()
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
        http.unregister_cuda_shared_memory("in")
        assert [r["name"] for r in http.get_cuda_shared_memory_status()] == ["out"]
        with pytest.raises(InferenceServerException) as e:
            http.infer("net_ts", [inp], outputs=[out])
        assert "Unable to find shared memory region: 'in'" in e.value.message(), e.value.message()
    finally:
        http.unregister_cuda_shared_memory()
        for h in handles:
            cudashm.destroy_shared_memory_region(h)
    assert http.get_cuda_shared_memory_status() == []


def test_a_bad_cuda_handle_is_refused_at_registration(gpu_server, http):
    """As in Triton, the server opens the handle when it is registered: 64 bytes that are no IPC
    handle answer 400 then, and nothing is registered."""
    import base64

    body = json.dumps({"raw_handle": {"b64": base64.b64encode(os.urandom(64)).decode()},
                       "device_id": 0, "byte_size": 64}).encode()
    raw = raw_request(gpu_server.port, "POST", "/v2/cudasharedmemory/region/bogus/register", body)
    assert raw.status == 400 and "failed to open CUDA IPC handle" in raw.json()["error"], raw
    assert http.get_cuda_shared_memory_status() == []
    assert http.is_server_ready()


def test_cuda_shared_memory_end_to_end_over_grpc(gpu_server):
    """Triton's simple_grpc_cudashm_client.py flow with tritonclient.grpc: the same regions,
    registered, served and unregistered over gRPC as over HTTP."""
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.cuda_shared_memory as cudashm

    rows = np.random.default_rng(3).standard_normal((3, FEATURES), dtype=np.float32)
    out_bytes = 3 * CLASSES * 4
    client = grpcclient.InferenceServerClient(gpu_server.wait_grpc_ready().grpc_url)
    handles = [_region("g_in", rows), _region("g_out", None, out_bytes)]
    try:
        client.register_cuda_shared_memory("g_in", cudashm.get_raw_handle(handles[0]), 0, rows.nbytes)
        client.register_cuda_shared_memory("g_out", cudashm.get_raw_handle(handles[1]), 0, out_bytes)
        regions = client.get_cuda_shared_memory_status(as_json=True)["regions"]
        assert set(regions) == {"g_in", "g_out"} and int(regions["g_in"]["byte_size"]) == rows.nbytes, regions
        inp = grpcclient.InferInput("INPUT__0", list(rows.shape), "FP32")
        inp.set_shared_memory("g_in", rows.nbytes)
        out = grpcclient.InferRequestedOutput("OUTPUT__0")
        out.set_shared_memory("g_out", out_bytes)
        result = client.infer("net_ts", [inp], outputs=[out])
        assert list(result.get_output("OUTPUT__0").shape) == [3, CLASSES]
        assert result.get_response().raw_output_contents == [b""]  # in the region, as Triton answers
        with torch.no_grad():
            want = small_net()(torch.from_numpy(rows)).numpy()
        np.testing.assert_allclose(cudashm.get_contents_as_numpy(handles[1], np.float32, [3, CLASSES]), want,
                                   rtol=1e-3, atol=1e-4)
        client.unregister_cuda_shared_memory("g_in")
        assert set(client.get_cuda_shared_memory_status(as_json=True)["regions"]) == {"g_out"}
    finally:
        client.unregister_cuda_shared_memory()
        for h in handles:
            cudashm.destroy_shared_memory_region(h)
    assert client.get_cuda_shared_memory_status(as_json=True).get("regions", {}) == {}
    client.close()


def test_a_region_on_a_device_the_server_does_not_have_is_refused(gpu_server, http):
    """Registering device memory under a device id past the server's GPUs is a 400 naming the id,
    before any handle is opened; nothing is registered."""
    import tritonclient.utils.cuda_shared_memory as cudashm

    missing = cuda_device_count()
    handle = _region("x", np.zeros(16, dtype=np.float32))
    try:
        with pytest.raises(InferenceServerException) as e:
            http.register_cuda_shared_memory("elsewhere", cudashm.get_raw_handle(handle), missing, 64)
        assert e.value.status() == "400" and f"device {missing} does not exist" in e.value.message(), e.value
        assert http.get_cuda_shared_memory_status() == []
    finally:
        cudashm.destroy_shared_memory_region(handle)


def _doubler_call(http, model: str, x: np.ndarray, out_handle=None) -> tuple[np.ndarray | None, bool]:
    import tritonclient.utils.cuda_shared_memory as cudashm

    inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    inp.set_shared_memory("x", x.nbytes)
    outputs = [httpclient.InferRequestedOutput("ON_GPU", binary_data=True)]
    if out_handle is not None:
        outputs.append(httpclient.InferRequestedOutput("OUTPUT0", binary_data=True))
        outputs[-1].set_shared_memory("y", x.nbytes)
    result = http.infer(model, [inp], outputs=outputs)
    doubled = cudashm.get_contents_as_numpy(out_handle, np.float32, list(x.shape)) if out_handle else None
    return doubled, bool(result.as_numpy("ON_GPU")[0])


def test_device_inputs_reach_a_python_model_as_gpu_tensors_only_when_asked(gpu_server, http):
    """With FORCE_CPU_ONLY_INPUT_TENSORS "no", an input in a CUDA region reaches the model as a GPU
    tensor (``is_cpu()`` false) and its GPU output goes device to device into the output region;
    by default (as in Triton) the model gets a CPU tensor. Both answers are right."""
    import tritonclient.utils.cuda_shared_memory as cudashm

    x = np.arange(1024, dtype=np.float32)
    handles = [_region("x", x), _region("y", None, x.nbytes)]
    try:
        http.register_cuda_shared_memory("x", cudashm.get_raw_handle(handles[0]), 0, x.nbytes)
        http.register_cuda_shared_memory("y", cudashm.get_raw_handle(handles[1]), 0, x.nbytes)
        doubled, on_gpu = _doubler_call(http, "doubler_device", x, handles[1])
        assert on_gpu
        np.testing.assert_array_equal(doubled, 2 * x)
        cudashm.set_shared_memory_region(handles[1], [np.zeros_like(x)])
        doubled, on_gpu = _doubler_call(http, "doubler_host", x, handles[1])
        assert not on_gpu
        np.testing.assert_array_equal(doubled, 2 * x)
    finally:
        http.unregister_cuda_shared_memory()
        for h in handles:
            cudashm.destroy_shared_memory_region(h)


def test_an_output_region_too_small_is_a_400_and_the_instance_serves_on(gpu_server, http):
    import tritonclient.utils.cuda_shared_memory as cudashm

    x = np.arange(256, dtype=np.float32)
    handles = [_region("x", x), _region("y", None, 16)]
    try:
        http.register_cuda_shared_memory("x", cudashm.get_raw_handle(handles[0]), 0, x.nbytes)
        http.register_cuda_shared_memory("y", cudashm.get_raw_handle(handles[1]), 0, 16)
        inp = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_shared_memory("x", x.nbytes)
        out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
        out.set_shared_memory("y", 16)
        with pytest.raises(InferenceServerException) as e:
            http.infer("doubler_device", [inp], outputs=[out])
        assert e.value.status() == "400" and "(16 bytes) should be at least 1024 bytes to hold the results" in e.value.message()
        _, on_gpu = _doubler_call(http, "doubler_device", x)
        assert on_gpu
    finally:
        http.unregister_cuda_shared_memory()
        for h in handles:
            cudashm.destroy_shared_memory_region(h)


def test_a_region_registered_again_over_new_memory_is_read_anew(gpu_server, http):
    """Unregistering closes the workers' mappings; the same name over another allocation serves
    the new bytes."""
    import tritonclient.utils.cuda_shared_memory as cudashm

    for round_ in range(3):
        x = np.full(64, float(round_ + 1), dtype=np.float32)
        handles = [_region("x", x), _region("y", None, x.nbytes)]
        try:
            http.register_cuda_shared_memory("x", cudashm.get_raw_handle(handles[0]), 0, x.nbytes)
            http.register_cuda_shared_memory("y", cudashm.get_raw_handle(handles[1]), 0, x.nbytes)
            doubled, _ = _doubler_call(http, "doubler_device", x, handles[1])
            np.testing.assert_array_equal(doubled, 2 * x)
        finally:
            http.unregister_cuda_shared_memory()
            for h in handles:
                cudashm.destroy_shared_memory_region(h)


def test_a_gpu_models_state_output_on_the_device_carries_to_the_next_request(gpu_server, http):
    """Implicit state that a GPU model leaves as a device tensor is kept for the sequence's next
    request (the worker brings it to the host), step after step, and a new START begins afresh."""
    def step(seq: int, start: bool = False, end: bool = False) -> list[float]:
        x = httpclient.InferInput("VALUE", [1], "FP32")
        x.set_data_from_numpy(np.zeros(1, np.float32))
        result = http.infer("gpu_state", [x], sequence_id=seq, sequence_start=start, sequence_end=end)
        return result.as_numpy("SEEN").tolist()

    assert [step(5, start=True), step(5), step(5, end=True)] == [[0, 0], [1, 1], [2, 2]]
    assert step(5, start=True, end=True) == [0, 0]


# -- ONNX Runtime -----------------------------------------------------------------------------------

def _model_states(server) -> dict[str, dict]:
    """The repository index by model name ({} while the server does not answer)."""
    try:
        raw = raw_request(server.port, "POST", "/v2/repository/index", b"{}")
    except OSError:
        return {}
    return {e["name"]: e for e in raw.json()} if raw.status == 200 else {}


def test_onnx_models_on_a_gpu_instance_run_on_cuda_or_are_refused_naming_the_provider(server_factory, tmp_path):
    """A KIND_GPU ONNX instance runs on CUDAExecutionProvider for its device (TensorrtExecutionProvider
    first where a gpu_execution_accelerator names tensorrt) and answers as on the CPU; where this
    host's onnxruntime lacks the provider (a CPU build of onnxruntime), the load fails naming it,
    rather than running on the CPU (onnxruntime-gpu without TensorRT's libraries, say). Which one
    holds depends on the onnxruntime installed."""
    import onnxruntime

    import onnx_models as om

    io = ('input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, '
          '{ name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
          'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, '
          '{ name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]\n')
    repo = tmp_path / "repo"
    trt = 'optimization { execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt" } ] } }\n'
    providers = {"onnx_cuda": "CUDAExecutionProvider", "onnx_trt": "TensorrtExecutionProvider"}
    for name, extra in (("onnx_cuda", ""), ("onnx_trt", trt)):
        om.write(repo, name, om.add_sub(), f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n{io}'
                                           f'{extra}instance_group [ {{ count: 1 kind: KIND_GPU gpus: [ 0 ] }} ]\n')
    server = server_factory.create([repo], ["--exit-on-error=false"]).start()

    def states() -> dict[str, dict]:
        return _model_states(server)

    server.wait_until(lambda: all(states().get(n, {}).get("state") in ("READY", "UNAVAILABLE") for n in providers),
                      "both ONNX models loaded or refused")
    available = onnxruntime.get_available_providers()
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 4), dtype=np.float32), rng.standard_normal((3, 4), dtype=np.float32)
    client = server.client()
    try:
        for name, provider in providers.items():
            entry = states()[name]
            if entry["state"] == "UNAVAILABLE":  # never served from the CPU instead
                assert provider in entry["reason"], entry
                continue
            assert entry["state"] == "READY" and provider in available and "CUDAExecutionProvider" in available, entry
            inputs = [httpclient.InferInput("INPUT0", [3, 4], "FP32"), httpclient.InferInput("INPUT1", [3, 4], "FP32")]
            inputs[0].set_data_from_numpy(a)
            inputs[1].set_data_from_numpy(b)
            result = client.infer(name, inputs)
            np.testing.assert_allclose(result.as_numpy("OUTPUT0"), a + b, rtol=1e-5)
            np.testing.assert_allclose(result.as_numpy("OUTPUT1"), a - b, rtol=1e-5)
            line = next(line for line in server.log().splitlines() if f"{name}/1/model.onnx': providers" in line)
            assert f"'{provider}'" in line and "on GPU 0" in line, line
    finally:
        client.close()


def test_an_onnx_model_batches_on_the_gpu_and_answers_as_onnxruntime_on_the_cpu(server_factory, tmp_path):
    """Two KIND_GPU instances of an ONNX MLP under dynamic batching (workers titled gpu0): 32
    concurrent requests of 1-3 rows are batched, and each answer equals onnxruntime's on the CPU
    within TF32's tolerance (onnxruntime's CUDA provider allows TF32 by default). Where this host's
    onnxruntime has no CUDA provider (a CPU build), the load is refused naming it instead."""
    import onnxruntime

    import onnx_models as om

    graph = om.mlp(FEATURES, 64, CLASSES)
    om.write(tmp_path / "repo", "onnx_mlp", graph,
             'name: "onnx_mlp"\nplatform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
             f'input [ {{ name: "X" data_type: TYPE_FP32 dims: [ {FEATURES} ] }} ]\n'
             f'output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ {CLASSES} ] }} ]\n'
             'dynamic_batching { max_queue_delay_microseconds: 20000 }\n'
             'instance_group [ { count: 2 kind: KIND_GPU } ]\n')
    server = server_factory.create([tmp_path / "repo"], ["--exit-on-error=false"]).start()
    server.wait_until(lambda: _model_states(server).get("onnx_mlp", {}).get("state") in ("READY", "UNAVAILABLE"),
                      "the ONNX model loaded or refused")
    entry = _model_states(server)["onnx_mlp"]
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        assert entry["state"] == "UNAVAILABLE" and "CUDAExecutionProvider" in entry["reason"], entry
        return
    assert entry["state"] == "READY", entry
    titles = [server.titles()[pid] for pid in server.worker_pids("onnx_mlp")]
    assert len(titles) == 2 and all(" gpu0 (server " in t for t in titles), titles
    sessions = [line for line in server.log().splitlines() if "onnx_mlp/1/model.onnx': providers" in line]
    assert len(sessions) == 2 and all("'CUDAExecutionProvider'" in s and "on GPU 0" in s for s in sessions), sessions

    cpu = onnxruntime.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(4)
    batches = [rng.standard_normal((1 + i % 3, FEATURES), dtype=np.float32) for i in range(32)]
    client = server.client(concurrency=16)
    try:
        pending = []
        for rows in batches:
            inp = httpclient.InferInput("X", list(rows.shape), "FP32")
            inp.set_data_from_numpy(rows)
            pending.append(client.async_infer("onnx_mlp", [inp]))
        answers = [p.get_result(timeout=60).as_numpy("Y") for p in pending]
        for rows, got in zip(batches, answers):
            np.testing.assert_allclose(got, cpu.run(["Y"], {"X": rows})[0], rtol=1e-2, atol=5e-2)
        stats = client.get_inference_statistics("onnx_mlp")["model_stats"][0]
    finally:
        client.close()
    assert stats["inference_count"] == sum(len(b) for b in batches)
    assert stats["execution_count"] < len(batches), stats  # requests were batched together
