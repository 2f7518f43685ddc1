"""Memory of N CPU instances of one model, with ``SHARE_WEIGHTS`` "yes" and "no": a TorchScript
model (or with ``--backend onnx`` an ONNX graph) of ``--mb`` megabytes of weights is written to a
temporary repository, shmserve serves it with each instance count, one request checks the answer,
and the workers' memory is read from ``/proc/<pid>/smaps_rollup``:

- PSS (proportional set size): each shared page counted once across the processes that map it,
  so the sum over the workers is what they cost the machine together;
- private: pages only that worker holds (its own heap, its own copy of the weights if any).

    python -m shmserve.tools.weights_memory --mb 128 --instances 1,2,4 [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from .harness import cmdline, descendants, free_port, memory_kb

CONFIG = '''name: "weights"
platform: "{platform}"
max_batch_size: 0
input [ {{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ {dims} ] }} ]
output [ {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ {dims} ] }} ]
instance_group [ {{ count: {count} kind: KIND_CPU }} ]
parameters {{ key: "SHARE_WEIGHTS" value: {{ string_value: "{share}" }} }}
'''


WIDTH = 1024


def write_model(repo: Path, mb: int, count: int, share: bool, backend: str = "pytorch") -> list[int]:
    """A chain of square layers holding about ``mb`` MB of FP32 weights, as TorchScript
    (``pytorch``) or as an ONNX graph of MatMuls (``onnx``); returns the input's shape."""
    layers = max(1, round(mb * 1e6 / (WIDTH * WIDTH * 4)))
    folder = repo / "weights"
    (folder / "1").mkdir(parents=True, exist_ok=True)
    if backend == "onnx":
        _write_onnx(folder / "1" / "model.onnx", layers)
        platform, shape = "onnxruntime_onnx", [1, WIDTH]
    else:
        import torch

        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
        torch.jit.save(torch.jit.script(model.eval()), str(folder / "1" / "model.pt"))
        platform, shape = "pytorch_libtorch", [WIDTH]
    (folder / "config.pbtxt").write_text(CONFIG.format(platform=platform, dims=", ".join(map(str, shape)),
                                                       count=count, share="yes" if share else "no"))
    return shape


def _write_onnx(path: Path, layers: int) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array((rng.standard_normal((WIDTH, WIDTH)) / WIDTH).astype(np.float32), f"W{i}")
               for i in range(layers)]
    names = ["INPUT__0"] + [f"H{i}" for i in range(layers - 1)] + ["OUTPUT__0"]
    nodes = [helper.make_node("MatMul", [names[i], f"W{i}"], [names[i + 1]]) for i in range(layers)]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, WIDTH]) for n in ("INPUT__0", "OUTPUT__0")]
    graph = helper.make_graph(nodes, "weights", [io[0]], [io[1]], weights)
    # Weights in an external data file: onnxruntime maps that file instead of copying it.
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path),
                    save_as_external_data=True, all_tensors_to_one_file=True, location="model.onnx.data",
                    size_threshold=0)


def measure(mb: int, count: int, share: bool, backend: str = "pytorch") -> dict[str, Any]:
    """Serve the model with ``count`` instances; the workers' memory once one request is answered."""
    import tritonclient.http as httpclient

    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        shape = write_model(repo, mb, count, share, backend)
        port, sid = free_port(), f"wm{count}{int(share)}{free_port()}"
        proc = subprocess.Popen([sys.executable, "-m", "shmserve", "--model-repository", str(repo),
                                 "--http-address", "127.0.0.1", "--http-port", str(port), "--allow-metrics", "false",
                                 "--allow-grpc", "false", "--id", sid], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
            deadline = time.monotonic() + 180
            while True:
                try:
                    if client.is_server_ready():
                        break
                except Exception:  # noqa: BLE001 - not listening yet
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the server did not get ready")
                time.sleep(0.2)
            x = httpclient.InferInput("INPUT__0", shape, "FP32")
            x.set_data_from_numpy(np.ones(shape, dtype=np.float32))
            answer = client.infer("weights", [x]).as_numpy("OUTPUT__0")
            assert answer.shape == tuple(shape) and np.isfinite(answer).all()
            workers = [p for p in descendants(proc.pid) if cmdline(p).startswith("shmserve worker weights ")]
            per = [memory_kb(p) for p in workers]
            return {"backend": backend, "instances": count, "shared": share, "weights_mb": mb, "workers": len(workers),
                    "pss_mb": sum(m["pss"] for m in per) / 1024, "private_mb": sum(m["private"] for m in per) / 1024,
                    "rss_mb": sum(m["rss"] for m in per) / 1024}
        finally:
            proc.terminate()
            proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=128, help="megabytes of weights (default 128)")
    p.add_argument("--instances", default="1,2,4", help="instance counts to try (default 1,2,4)")
    p.add_argument("--backend", choices=("pytorch", "onnx"), default="pytorch",
                   help="a TorchScript model, or an ONNX graph (SHARE_WEIGHTS turns onnxruntime's prepacking off)")
    p.add_argument("--json", help="write the rows here too")
    args = p.parse_args()
    rows = []
    print("| instances | weights | workers' PSS, shared | workers' PSS, own copies | private, shared | private, own |")
    print("| --- | --- | --- | --- | --- | --- |")
    for count in [int(n) for n in args.instances.split(",")]:
        shared, own = measure(args.mb, count, True, args.backend), measure(args.mb, count, False, args.backend)
        rows += [shared, own]
        print(f"| {count} | {args.mb} MB | {shared['pss_mb']:.0f} MB | {own['pss_mb']:.0f} MB | "
              f"{shared['private_mb']:.0f} MB | {own['private_mb']:.0f} MB |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
