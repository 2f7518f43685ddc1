"""The bench mlp as an ONNX model served by the ONNX Runtime backend, against the same graph run by
onnxruntime in this process (the floor).

    python -m shmserve.tools.bench_onnx --json bench-onnx.json
    python -m shmserve.tools.bench_onnx --seconds 3 --warmup 1 --floor-seconds 1   # a quick look

The model is ``../shared/bench-models/mlp``'s network (``Linear(512, 2048)``, ReLU,
``Linear(2048, 512)``, weights from ``torch.manual_seed(0)`` as its model.py makes them), written
as an ONNX graph (Gemm, Relu, Gemm) into a temporary repository: ``onnxruntime_onnx``,
max_batch_size 64, INPUT0 FP32 [512] -> OUTPUT0 FP32 [512], one KIND_CPU instance, dynamic
batching with ``--queue-delay-us`` (the mlp's 2000 by default). ``--clients`` HTTP client
processes (shmserve-perf's, binary data, one row per request) run closed loops against a server
of its own (tools.harness): requests/s, p50, p99 and the average batch the server formed
(tools.batch_size). The floor is an ``InferenceSession`` on the same file with the session
options the backend builds from the same config (workers.onnx_session), run in a closed loop at
batch 1 and at the batch the server formed, after the server has stopped. The server's overhead
per request is its time per request (1/throughput) minus the floor's time per row at that batch.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from shmserve.tools import batch_size
from shmserve.tools.harness import ServerProcess, free_port
from shmserve.tools.perf.cli import fixed_window

MODEL = "mlp_onnx"
MAX_BATCH = 64
WIDTH, HIDDEN = 512, 2048


def mlp_weights() -> list[np.ndarray]:
    """The bench mlp's weights: the same modules made under the same seed as its model.py."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, WIDTH)).eval()
    return [p.detach().numpy() for p in (net[0].weight, net[0].bias, net[2].weight, net[2].bias)]


def onnx_bytes(weights: list[np.ndarray]) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    w1, b1, w2, b2 = (numpy_helper.from_array(np.ascontiguousarray(w), name)
                      for w, name in zip(weights, ("w1", "b1", "w2", "b2")))
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["INPUT0", "w1", "b1"], ["h"], transB=1), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("Gemm", ["r", "w2", "b2"], ["OUTPUT0"], transB=1)], "mlp",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", WIDTH])], initializer=[w1, b1, w2, b2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def config_text(args: argparse.Namespace) -> str:
    threads = f'parameters {{ key: "intra_op_thread_count" value: {{ string_value: "{args.threads}" }} }}\n' \
        if args.threads else ""
    return f"""name: "{MODEL}"
platform: "onnxruntime_onnx"
max_batch_size: {MAX_BATCH}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
dynamic_batching {{ max_queue_delay_microseconds: {args.queue_delay_us} }}
{threads}"""


def write_repository(root: Path, args: argparse.Namespace) -> Path:
    """The model folder; checks onnxruntime's answer against torch's for the same weights first."""
    import onnxruntime
    import torch

    weights = mlp_weights()
    data = onnx_bytes(weights)
    x = np.random.default_rng(0).standard_normal((3, WIDTH), dtype=np.float32)
    got = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"INPUT0": x})[0]
    want = torch.relu(torch.from_numpy(x) @ torch.from_numpy(weights[0]).T + torch.from_numpy(weights[1]))
    want = (want @ torch.from_numpy(weights[2]).T + torch.from_numpy(weights[3])).numpy()
    if not np.allclose(got, want, rtol=1e-4, atol=1e-4):
        raise RuntimeError("the ONNX graph does not compute the mlp")
    (root / MODEL / "1").mkdir(parents=True)
    (root / MODEL / "1" / "model.onnx").write_bytes(data)
    (root / MODEL / "config.pbtxt").write_text(config_text(args))
    return root / MODEL / "1" / "model.onnx"


def http_row(server: ServerProcess, args: argparse.Namespace) -> dict[str, Any]:
    """The clients' closed loops, with the average batch the server formed meanwhile."""
    metrics = f"127.0.0.1:{server.metrics_port}"
    before = batch_size.counts(metrics, MODEL)
    row = fixed_window(["-m", MODEL, "-u", server.url], args.clients, args.seconds, args.warmup)
    after = batch_size.counts(metrics, MODEL)
    executions = after[1] - before[1]
    row["avg_batch"] = round((after[0] - before[0]) / executions, 2) if executions else None
    return row


def floor_row(model_file: Path, config: dict[str, Any], batch: int, seconds: float) -> dict[str, Any]:
    """The same graph and session options in this process: a closed loop of ``session.run``."""
    import onnxruntime

    from shmserve.workers.onnx_session import session_options

    session = onnxruntime.InferenceSession(str(model_file), sess_options=session_options(onnxruntime, config),
                                           providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((batch, WIDTH), dtype=np.float32)
    warm_end = time.perf_counter() + min(1.0, seconds)
    while time.perf_counter() < warm_end:
        session.run(["OUTPUT0"], {"INPUT0": x})
    lat: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        session.run(["OUTPUT0"], {"INPUT0": x})
        lat.append(time.perf_counter() - t0)
    mean_us = 1e6 * sum(lat) / len(lat)
    return {"batch": batch, "runs": len(lat), "p50_batch_us": round(1e6 * float(np.percentile(lat, 50)), 1),
            "mean_batch_us": round(mean_us, 1), "us_per_row": round(mean_us / batch, 2)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m shmserve.tools.bench_onnx", description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=8, help="HTTP client processes (default 8)")
    p.add_argument("--queue-delay-us", type=int, default=2000, help="dynamic_batching max_queue_delay_microseconds")
    p.add_argument("--threads", type=int, default=0,
                   help="intra_op_thread_count for the server and the floor alike (0: onnxruntime's default)")
    p.add_argument("--seconds", type=float, default=15.0, help="measured seconds of client load")
    p.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds before it")
    p.add_argument("--floor-seconds", type=float, default=3.0, help="measured seconds per floor batch size")
    p.add_argument("--server-log", type=Path, help="append the server's output here")
    p.add_argument("--json", type=Path, help="also write the JSON document here")
    args = p.parse_args(argv)
    if args.clients < 1 or args.seconds <= 0 or args.floor_seconds <= 0 or args.threads < 0:
        p.error("--clients must be >= 1, --seconds and --floor-seconds > 0, --threads >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import onnxruntime

    doc: dict[str, Any] = {"environment": {"python": sys.version.split()[0], "onnxruntime": onnxruntime.__version__,
                                           "cpus": os.cpu_count(), "load_avg": os.getloadavg()},
                           "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                           "errors": []}
    root = Path(tempfile.mkdtemp(prefix="shmserve-bench-onnx-"))
    try:
        model_file = write_repository(root, args)
        doc["config_pbtxt"] = config_text(args)
        server = ServerProcess([root], f"--grpc-port={free_port()}", server_id=f"benchonnx{os.getpid()}",
                               log=args.server_log)
        try:
            doc["http"] = http_row(server, args)
        finally:
            server.stop()
            doc["shm_left"] = server.shm_objects()
        print(f"# http: {doc['http']}", flush=True)
        formed = min(MAX_BATCH, max(1, round(doc["http"]["avg_batch"] or 1)))
        config = {"parameters": {"intra_op_thread_count": {"string_value": str(args.threads)}}}
        doc["floor"] = [floor_row(model_file, config, b, args.floor_seconds) for b in sorted({1, formed})]
        floor = next(f for f in doc["floor"] if f["batch"] == formed)
        server_us = 1e6 / doc["http"]["throughput_rps"] if doc["http"]["throughput_rps"] else None
        doc["overhead"] = None if server_us is None else {
            "batch": formed, "server_us_per_request": round(server_us, 2), "floor_us_per_row": floor["us_per_row"],
            "overhead_us_per_request": round(server_us - floor["us_per_row"], 2)}
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - what was measured is still written
        doc["errors"].append(repr(exc))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if args.json:
            args.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: doc.get(k) for k in ("http", "floor", "overhead", "errors")}, indent=2))
    return 1 if doc["errors"] or (doc.get("http") or {}).get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
