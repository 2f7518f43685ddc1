"""A 64 MiB identity through CUDA shared memory: the input and the output both in client device
memory, over HTTP with ``tritonclient.utils.cuda_shared_memory``, on shmserve and on Triton (the
Python-backend models; Triton's tree as tools/bench_gpu_triton.py takes it). Needs a CUDA GPU;
``--device cpu`` rehearses it without one: KIND_CPU instances, the tensor in the request body, one
call per model.

Three models, each one GPU instance:
- ``host_path``: a Python model that gets its input on the host (Triton's default,
  ``FORCE_CPU_ONLY_INPUT_TENSORS`` "yes"), moves it to the GPU and hands back a host array. That is
  the path every GPU model took before device tensors: device to host, host to device, device to
  host, host to device.
- ``device_path``: the same model.py with ``FORCE_CPU_ONLY_INPUT_TENSORS`` "no": the input is a GPU
  tensor over the client's region and the output is copied device to device into the output region.
- ``torchscript``: a TorchScript identity on the PyTorch backend (device inputs always).

Prints one JSON document: per server and model, the median and mean milliseconds per call.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from shmserve.tools.harness import ServerProcess
from shmserve.tools.triton_process import TritonProcess

MODEL_PY = '''
import torch
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        gpu = args["model_instance_kind"] == "GPU"
        self.device = torch.device(f"cuda:{args['model_instance_device_id']}" if gpu else "cpu")

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            on_gpu = torch.from_dlpack(x.to_dlpack()).to(self.device)  # no copy when it is there already
            out = pb_utils.Tensor.from_dlpack("OUTPUT0", on_gpu) if not x.is_cpu() \\
                else pb_utils.Tensor("OUTPUT0", on_gpu.cpu().numpy())
            responses.append(pb_utils.InferenceResponse([out]))
        return responses
'''

IO = ('input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
      'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
      'instance_group [ { count: 1 kind: KIND_GPU } ]\n')
PYTHON_MODELS = ("host_path", "device_path")


def write_repository(root: Path, kind: str = "KIND_GPU", torchscript: bool = True) -> None:
    """The Python models (both servers), and the TorchScript one (shmserve's) when asked."""
    import torch

    io = IO.replace("KIND_GPU", kind)
    for name, force in (("host_path", "yes"), ("device_path", "no")):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(MODEL_PY)
        (root / name / "config.pbtxt").write_text(
            f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
            f'parameters {{ key: "FORCE_CPU_ONLY_INPUT_TENSORS" value: {{ string_value: "{force}" }} }}\n{io}')
    if not torchscript:
        return

    class Identity(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    (root / "torchscript" / "1").mkdir(parents=True)
    torch.jit.save(torch.jit.script(Identity()), str(root / "torchscript" / "1" / "model.pt"))
    (root / "torchscript" / "config.pbtxt").write_text(
        'name: "torchscript"\nplatform: "pytorch_libtorch"\nmax_batch_size: 0\n'
        + io.replace("INPUT0", "INPUT__0").replace("OUTPUT0", "OUTPUT__0"))


def measure(url: str, model: str, mib: int, calls: int) -> dict[str, Any]:
    import tritonclient.http as httpclient
    import tritonclient.utils.cuda_shared_memory as cudashm

    x = np.random.default_rng(0).standard_normal(mib * (1 << 20) // 4, dtype=np.float32)
    names = ("INPUT__0", "OUTPUT__0") if model == "torchscript" else ("INPUT0", "OUTPUT0")
    client = httpclient.InferenceServerClient(url, network_timeout=300)
    regions = [cudashm.create_shared_memory_region(f"{model}_{i}", x.nbytes, 0) for i in ("in", "out")]
    try:
        cudashm.set_shared_memory_region(regions[0], [x])
        for region, tag in zip(regions, ("in", "out")):
            client.register_cuda_shared_memory(f"{model}_{tag}", cudashm.get_raw_handle(region), 0, x.nbytes)
        inp = httpclient.InferInput(names[0], [x.size], "FP32")
        inp.set_shared_memory(f"{model}_in", x.nbytes)
        out = httpclient.InferRequestedOutput(names[1], binary_data=True)
        out.set_shared_memory(f"{model}_out", x.nbytes)
        times = []
        for i in range(calls + 3):  # three warm-up calls
            start = time.perf_counter()
            client.infer(model, [inp], outputs=[out])
            if i >= 3:
                times.append(time.perf_counter() - start)
        same = bool(np.array_equal(cudashm.get_contents_as_numpy(regions[1], np.float32, [x.size]), x))
    finally:
        client.unregister_cuda_shared_memory()
        for region in regions:
            cudashm.destroy_shared_memory_region(region)
        client.close()
    return {"model": model, "mib": mib, "calls": calls, "median_ms": round(statistics.median(times) * 1e3, 2),
            "mean_ms": round(statistics.mean(times) * 1e3, 2), "output_equals_input": same}


def measure_in_body(url: str, model: str, mib: int) -> dict[str, Any]:
    """The CPU rehearsal: one call with the tensor in the request body, output compared."""
    import tritonclient.http as httpclient

    x = np.random.default_rng(0).standard_normal(mib * (1 << 20) // 4, dtype=np.float32)
    names = ("INPUT__0", "OUTPUT__0") if model == "torchscript" else ("INPUT0", "OUTPUT0")
    with httpclient.InferenceServerClient(url, network_timeout=300) as client:
        inp = httpclient.InferInput(names[0], [x.size], "FP32")
        inp.set_data_from_numpy(x)
        start = time.perf_counter()
        got = client.infer(model, [inp], outputs=[httpclient.InferRequestedOutput(names[1], binary_data=True)])
        elapsed = time.perf_counter() - start
        same = bool(np.array_equal(got.as_numpy(names[1]), x))
    return {"model": model, "mib": mib, "calls": 1, "median_ms": round(elapsed * 1e3, 2),
            "mean_ms": round(elapsed * 1e3, 2), "output_equals_input": same, "in": "request body (--device cpu)"}


def run_server(server_name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Rows for one server's models; one error row when the server does not start."""
    cpu = args.device == "cpu"
    models = PYTHON_MODELS if server_name == "triton" else (*PYTHON_MODELS, "torchscript")
    with tempfile.TemporaryDirectory(prefix="bench_cudashm") as tmp:
        write_repository(Path(tmp), "KIND_CPU" if cpu else "KIND_GPU", torchscript=server_name == "shmserve")
        try:
            server = (TritonProcess(args.triton_root, [tmp], python=args.triton_python, log=args.server_log)
                      if server_name == "triton" else ServerProcess([tmp], log=args.server_log))
        except Exception as exc:  # noqa: BLE001 - the other server still runs
            return [{"server": server_name, "error": f"server: {exc}"}]
        rows = []
        try:
            for model in models:
                try:
                    row = measure_in_body(server.url, model, args.mib) if cpu else \
                        measure(server.url, model, args.mib, args.calls)
                except Exception as exc:  # noqa: BLE001 - the next model still runs
                    row = {"model": model, "error": repr(exc)}
                rows.append({"server": server_name, **row})
                print(f"# {rows[-1]}", file=sys.stderr, flush=True)
        finally:
            server.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="tensor size in MiB (default 64)")
    parser.add_argument("--calls", type=int, default=20, help="timed calls per model (default 20)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a rehearsal without CUDA regions (KIND_CPU, tensors in the body)")
    parser.add_argument("--servers", nargs="+", choices=["shmserve", "triton"], default=["shmserve", "triton"])
    parser.add_argument("--triton-root", type=Path, default=Path("/tmp/triton"),
                        help="folder holding pytriton/tritonserver and nvidia_pytriton.libs")
    parser.add_argument("--triton-python", default=sys.executable,
                        help="the Python whose libpython and site-packages Triton's stub uses")
    parser.add_argument("--server-log", type=Path, default=None, help="append the servers' logs here")
    args = parser.parse_args(argv)
    rows = [row for name in args.servers for row in run_server(name, args)]
    print(json.dumps({"identity_through_cuda_shm": rows}, indent=1))
    return 0 if all(r.get("output_equals_input") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
