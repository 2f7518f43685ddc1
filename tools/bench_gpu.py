"""A vision model on one GPU through shmserve, against the same model run by torch alone.

    python -m shmserve.tools.bench_gpu --json bench-gpu.json             # ResNet-50, KIND_GPU
    python -m shmserve.tools.bench_gpu --device cpu --model small --seconds 3   # CPU dry run

A ResNet-50 with random weights (torchvision; ``--model small`` is a small conv net of this file)
is traced to TorchScript into a temporary repository (``pytorch_libtorch``, max_batch_size 32,
INPUT__0 FP32 [3,224,224] -> OUTPUT__0 FP32 [1000], dynamic batching with
``--queue-delay-us``, ``--instances`` instances). A server of its own (tools.harness) then takes
closed loops from ``--clients`` HTTP client processes (shmserve-perf's, binary data) and from as
many local-client processes (shmserve-perf -i local); for each: inferences/s, p50, p99 and the average
batch the server formed (tools.batch_size's counters, read around warm-up and measurement). The
floor is the same TorchScript file run in this process at batch 1 and at those batch sizes, with
the host->device input copy, forward, device->host output copy and a synchronize the worker also
pays; the server's overhead per inference is its time per inference (1/throughput) minus the
floor's at that batch size. GPU memory per instance comes from nvidia-smi, matched to the worker
pids. The floor runs after the server has stopped, so the two never share the GPU.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from shmserve.tools import batch_size
from shmserve.tools.harness import ServerProcess, gpu_memory_mib
from shmserve.tools.perf.cli import fixed_window

MAX_BATCH = 32
SHAPE = (3, 224, 224)
CLASSES = 1000


# ---------------------------------------------------------------- the model and its repository


def build_module(name: str) -> tuple[Any, str]:
    """(module in eval mode on the CPU, the name actually built): ResNet-50 falls back to the
    small net only when torchvision does not import, and says so in the name."""
    import torch

    if name == "resnet50":
        try:
            import torchvision

            return torchvision.models.resnet50(weights=None).eval(), "resnet50"
        except ImportError:
            print("warning: torchvision does not import: the small conv net stands in", file=sys.stderr)
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 7, stride=4, padding=3), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, CLASSES))
    return net.eval(), "small"


def config_text(name: str, kind: str, instances: int, queue_delay_us: int) -> str:
    dims = ", ".join(map(str, SHAPE))
    return f"""name: "{name}"
platform: "pytorch_libtorch"
max_batch_size: {MAX_BATCH}
input [ {{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ {dims} ] }} ]
output [ {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ {CLASSES} ] }} ]
instance_group [ {{ count: {instances} kind: {kind} }} ]
dynamic_batching {{ max_queue_delay_microseconds: {queue_delay_us} }}
"""


def write_repository(root: Path, args: argparse.Namespace) -> tuple[str, Path]:
    """Traces the module (on the CPU: the file is device-free, the worker maps it) into
    ``root/<name>/1/model.pt``; returns (model name, path of model.pt)."""
    import torch

    module, name = build_module(args.model)
    with torch.no_grad():
        traced = torch.jit.trace(module, torch.rand(2, *SHAPE))
    version = root / name / "1"
    version.mkdir(parents=True)
    traced.save(str(version / "model.pt"))
    kind = "KIND_GPU" if args.device == "cuda" else "KIND_CPU"
    (root / name / "config.pbtxt").write_text(config_text(name, kind, args.instances, args.queue_delay_us))
    return name, version / "model.pt"


# ---------------------------------------------------------------- load through the server


def with_batch_size(server: ServerProcess, model: str, run: Any) -> dict[str, Any]:
    """``run()``'s row plus the server's average batch over it (warm-up included: the counters
    cannot tell it apart, and it runs the same load)."""
    metrics = f"127.0.0.1:{server.metrics_port}"
    before = batch_size.counts(metrics, model)
    row = run()
    after = batch_size.counts(metrics, model)
    inferences, executions = after[0] - before[0], after[1] - before[1]
    row["avg_batch"] = round(inferences / executions, 2) if executions else None
    return row


def http_row(server: ServerProcess, model: str, args: argparse.Namespace) -> dict[str, Any]:
    return fixed_window(["-m", model, "-u", server.url], args.clients, args.seconds, args.warmup)


def local_row(server: ServerProcess, model: str, args: argparse.Namespace) -> dict[str, Any]:
    return fixed_window(["-m", model, "-i", "local", "-u", server.id], args.clients, args.seconds, args.warmup)


def gpu_memory(worker_pids: list[int]) -> dict[str, Any]:
    """nvidia-smi's per-process memory, the server's workers picked out by pid."""
    mib = gpu_memory_mib(worker_pids)
    if mib is None:
        return {"error": "nvidia-smi did not answer", "worker_pids": worker_pids}
    return {"worker_pids": worker_pids, "per_instance_mib": {str(p): m for p, m in mib.items()}}


# ---------------------------------------------------------------- the floor


def floor_row(model_file: Path, device: str, batch: int, seconds: float) -> dict[str, Any]:
    """The worker's own path for one batch, without the server: host array -> device, forward
    under inference_mode, output -> host numpy, synchronize; closed loop for ``seconds``."""
    import torch

    dev = torch.device("cuda:0" if device == "cuda" else "cpu")
    module = torch.jit.load(str(model_file), map_location=dev)
    module.eval()
    host = np.random.default_rng(0).random((batch, *SHAPE), dtype=np.float32)

    def once() -> None:
        with torch.inference_mode():
            out = module(torch.from_numpy(host).to(dev))
        out.cpu().numpy()
        if dev.type == "cuda":
            torch.cuda.synchronize()

    warm_end = time.perf_counter() + min(1.0, seconds)
    while time.perf_counter() < warm_end:
        once()
    lat: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        once()
        lat.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - start
    mean_us = 1e6 * sum(lat) / len(lat)
    return {"batch": batch, "batches": len(lat), "inferences_per_s": round(batch * len(lat) / elapsed, 1),
            "p50_batch_us": round(1e6 * float(np.percentile(lat, 50)), 1), "mean_batch_us": round(mean_us, 1),
            "us_per_inference": round(mean_us / batch, 2)}


def overhead(row: dict[str, Any], floors: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """Server time per inference (1/throughput) minus the floor's at the batch the server formed."""
    if not row.get("throughput_rps") or not row.get("avg_batch"):
        return None
    floor = floors.get(batch_of(row["avg_batch"]))
    if floor is None:
        return None
    server_us = 1e6 / row["throughput_rps"]
    return {"batch": floor["batch"], "server_us_per_inference": round(server_us, 2),
            "floor_us_per_inference": floor["us_per_inference"],
            "overhead_us_per_inference": round(server_us - floor["us_per_inference"], 2),
            "p50_minus_floor_batch_us": round(row["p50_us"] - floor["p50_batch_us"], 1)}


def batch_of(avg: float) -> int:
    return min(MAX_BATCH, max(1, round(avg)))


# ---------------------------------------------------------------- the run


def environment(device: str) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__, "device": device}
    if device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    return env


def wait_model_ready(server: ServerProcess, model: str, timeout_s: float = 120.0) -> None:
    """A GPU instance loads after the server answers (CUDA and cuDNN start-up): wait for it."""
    import tritonclient.http as httpclient

    with httpclient.InferenceServerClient(server.url) as client:
        deadline = time.monotonic() + timeout_s
        while not client.is_model_ready(model):
            if time.monotonic() > deadline:
                raise RuntimeError(f"model {model!r} not ready within {timeout_s:.0f} s")
            time.sleep(0.2)


def serve_and_measure(doc: dict[str, Any], args: argparse.Namespace, repo: Path, model: str) -> None:
    """Phases (i), (ii) and (iv) with the server up; each phase's failure is recorded, not fatal."""
    t0 = time.perf_counter()
    server = ServerProcess([repo], server_id=None, log=args.server_log)
    try:
        wait_model_ready(server, model)
        doc["server_ready_s"] = round(time.perf_counter() - t0, 1)
        for key, run in (("http", lambda: http_row(server, model, args)),
                         ("local", lambda: local_row(server, model, args))):
            try:
                doc[key] = with_batch_size(server, model, run)
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - the other phases still report
                doc["errors"].append(f"{key}: {exc!r}")
            print(f"# {key}: {doc.get(key)}", flush=True)
        if args.device == "cuda":
            doc["gpu_memory"] = gpu_memory(server.worker_pids(model))
    finally:
        server.stop()
        doc["shm_left"] = server.shm_objects()


def measure_floor(doc: dict[str, Any], args: argparse.Namespace, model_file: Path) -> None:
    batches = sorted({1, *(batch_of(doc[k]["avg_batch"]) for k in ("http", "local")
                           if doc.get(k, {}).get("avg_batch"))})
    floors: dict[int, dict[str, Any]] = {}
    for b in batches:
        floors[b] = floor_row(model_file, args.device, b, args.floor_seconds)
        print(f"# floor: {floors[b]}", flush=True)
    doc["floor"] = list(floors.values())
    doc["overhead"] = {k: overhead(doc[k], floors) for k in ("http", "local") if k in doc}


def table(doc: dict[str, Any]) -> str:
    lines = [f"{'path':<8} {'inf/s':>9} {'p50 us':>9} {'p99 us':>9} {'batch':>6} {'overhead us/inf':>16}",
             "-" * 62]
    for key in ("http", "local"):
        row = doc.get(key)
        if row:
            over = (doc.get("overhead") or {}).get(key) or {}
            lines.append(f"{key:<8} {row['throughput_rps']:>9.1f} {row['p50_us']:>9.0f} {row['p99_us']:>9.0f} "
                         f"{row['avg_batch'] or 0:>6.2f} {over.get('overhead_us_per_inference', '-'):>16}")
    for f in doc.get("floor", []):
        lines.append(f"{'floor':<8} {f['inferences_per_s']:>9.1f} {f['p50_batch_us']:>9.0f} {'':>9} "
                     f"{f['batch']:>6} {'(per batch)':>16}")
    mem = (doc.get("gpu_memory") or {}).get("per_instance_mib")
    if mem:
        lines.append(f"GPU memory per instance (MiB): {mem}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m shmserve.tools.bench_gpu", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="KIND_GPU or KIND_CPU, and the floor's")
    p.add_argument("--model", choices=["resnet50", "small"], default="resnet50")
    p.add_argument("--instances", type=int, default=1, help="instance_group count")
    p.add_argument("--queue-delay-us", type=int, default=1000, help="dynamic_batching max_queue_delay_microseconds")
    p.add_argument("--clients", type=int, default=16, help="client processes, for HTTP and for the local client")
    p.add_argument("--seconds", type=float, default=15.0, help="measured seconds per client path")
    p.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds before each path")
    p.add_argument("--floor-seconds", type=float, default=3.0, help="measured seconds per floor batch size")
    p.add_argument("--server-log", type=Path, help="append the server's output here")
    p.add_argument("--json", type=Path, help="also write the JSON document here")
    args = p.parse_args(argv)
    if args.instances < 1 or args.clients < 1 or args.seconds <= 0 or args.floor_seconds <= 0:
        p.error("--instances and --clients must be >= 1, --seconds and --floor-seconds > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    doc: dict[str, Any] = {"environment": environment(args.device), "errors": [],
                           "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    root = Path(tempfile.mkdtemp(prefix="shmserve-bench-gpu-"))
    try:
        model, model_file = write_repository(root, args)
        doc["model"] = model
        doc["config_pbtxt"] = (root / model / "config.pbtxt").read_text()
        try:
            serve_and_measure(doc, args, root, model)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the floor still runs
            doc["errors"].append(f"server: {exc!r}")
        try:
            measure_floor(doc, args, model_file)
        except (Exception, SystemExit) as exc:  # noqa: BLE001
            doc["errors"].append(f"floor: {exc!r}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        doc["total_s"] = round(time.perf_counter() - started, 1)
        if args.json:
            args.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(table(doc))
    for err in doc["errors"]:
        print(f"error: {err}", file=sys.stderr)
    failed = doc["errors"] or any((doc.get(k) or {}).get("errors") for k in ("http", "local"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
