"""Triton beside shmserve on one GPU: the same ResNet-50 through every path each server has.

    python -m shmserve.tools.bench_gpu_triton --json side-by-side.json            # on the GPU machine
    python -m shmserve.tools.bench_gpu_triton --device cpu --model small --seconds 2 --warmup 1 \\
        --triton-root /tmp/reference-triton/venv/lib/python3.11/site-packages   # a CPU rehearsal

For each instance count (``--instances``, default 1 and 2; ``KIND_GPU``, dynamic batching, max batch
32, the same ``--queue-delay-us`` on both servers), one server at a time:

- Triton (``--triton-root``: a tree unpacked from tools/gpu_triton.py's parts, started by
  tools/triton_process.py) with the Python-backend ``model.py`` below: HTTP and gRPC;
- shmserve with the same ``model.py`` file: HTTP, gRPC and the local client;
- shmserve with the TorchScript backend (tools/bench_gpu.py's repository): HTTP, gRPC and local;

then torch alone (tools/bench_gpu.py's floor) at batch 1 and at the batches the TorchScript rows
formed. Every path is ``--clients`` closed-loop client processes of shmserve-perf (binary data) for
``--warmup`` + ``--seconds``. Per path: inferences/s, p50, p99, the average batch the server formed
and the server's CPU per inference (every process of the server, from /proc), both read around the
warm-up and the window together (the counters cannot tell them apart, and they carry the same load);
GPU memory per instance from nvidia-smi (the shmserve workers, Triton's Python stubs). Each path
fails alone, as an error row, and ``--path-timeout`` bounds it; the JSON is rewritten after each
server, so a run stopped from outside keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from shmserve.tools import batch_size, bench_gpu, proc_cpu
from shmserve.tools.harness import ServerProcess, free_port, gpu_memory_mib
from shmserve.tools.perf.cli import fixed_window
from shmserve.tools.triton_process import TritonProcess

# The Python-backend model, one file for both servers: plain numpy in and out, every request of a
# batch in one forward. NET (config parameter) picks ResNet-50 or the small net of bench_gpu.
MODEL_PY = '''"""ResNet-50 (torchvision, random weights under a fixed seed) or a small conv net, fp32 on the
instance's device: INPUT__0 FP32 [3,224,224] -> OUTPUT__0 FP32 [1000], one forward per batch."""
import json

import numpy as np
import torch
import triton_python_backend_utils as pb_utils


def build(net):
    torch.manual_seed(0)
    if net == "resnet50":
        import torchvision

        return torchvision.models.resnet50(weights=None)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 7, stride=4, padding=3), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 1000))


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        net = config["parameters"]["NET"]["string_value"]
        gpu = args["model_instance_kind"] == "GPU"
        self.device = torch.device(f"cuda:{args['model_instance_device_id']}" if gpu else "cpu")
        self.net = build(net).eval().to(self.device)

    def execute(self, requests):
        inputs = [pb_utils.get_input_tensor_by_name(r, "INPUT__0").as_numpy() for r in requests]
        with torch.inference_mode():
            batch = torch.from_numpy(np.concatenate(inputs)).to(self.device)
            out = self.net(batch).cpu().numpy()
        responses, at = [], 0
        for x in inputs:
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT__0", out[at:at + len(x)])]))
            at += len(x)
        return responses
'''


def python_config(name: str, kind: str, instances: int, queue_delay_us: int, net: str) -> str:
    """bench_gpu's config, on the Python backend, with the net as a parameter."""
    text = bench_gpu.config_text(name, kind, instances, queue_delay_us)
    return text.replace('platform: "pytorch_libtorch"', 'backend: "python"') + \
        f'parameters {{ key: "NET" value: {{ string_value: "{net}" }} }}\n'


def write_python_repository(root: Path, args: argparse.Namespace, instances: int) -> str:
    net = "resnet50" if args.model == "resnet50" and have_torchvision() else "small"
    name = f"{net}_python"
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text(MODEL_PY)
    kind = "KIND_GPU" if args.device == "cuda" else "KIND_CPU"
    (root / name / "config.pbtxt").write_text(python_config(name, kind, instances, args.queue_delay_us, net))
    return name


def have_torchvision() -> bool:
    try:
        import torchvision
    except ImportError:
        return False
    return bool(torchvision)


# ---------------------------------------------------------------- one path, bounded


class PathTimeout(Exception):
    pass


INTERRUPTED: list[int] = []  # SIGINT seen: a path's own cleanup may turn the KeyboardInterrupt into
# another error (shmserve-perf's pool, its clients gone), so the bench checks this after each path


def on_sigint(signum: int, frame: Any) -> None:
    INTERRUPTED.append(signum)
    print(f"# SIGINT at {time.strftime('%H:%M:%S')}", flush=True)
    raise KeyboardInterrupt


def bounded(seconds: float, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run()`` stopped by SIGALRM after ``seconds`` (its finally blocks stop its client processes)."""
    def expire(signum: int, frame: Any) -> None:
        raise PathTimeout(f"over {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(max(1, int(seconds)))
    try:
        return run()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def measure_path(server: ServerProcess, model: str, flags: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """One path's row: shmserve-perf's figures, plus the batch formed and the server's CPU per
    inference over the same interval (warm-up and window)."""
    metrics = f"127.0.0.1:{server.metrics_port}"
    before, cpu_before = batch_size.counts(metrics, model), proc_cpu.usage(server.tree())
    row = bounded(args.path_timeout, lambda: fixed_window(["-m", model, *flags], args.clients, args.seconds,
                                                          args.warmup))
    after, cpu_after = batch_size.counts(metrics, model), proc_cpu.usage(server.tree())
    inferences, executions = after[0] - before[0], after[1] - before[1]
    row["avg_batch"] = round(inferences / executions, 2) if executions else None
    row["server_cpu_us_per_inference"] = round((cpu_after - cpu_before).cpu_us / inferences, 1) if inferences else None
    return row


def gpu_memory(server: ServerProcess, model: str) -> dict[str, Any]:
    """nvidia-smi per process of the server: its instances (workers, stubs) and the rest."""
    instances = server.worker_pids(model)
    mib = gpu_memory_mib(server.tree())
    if mib is None:
        return {"error": "nvidia-smi did not answer", "instance_pids": instances}
    return {"per_instance_mib": [mib.get(p, 0) for p in instances],
            "other_processes_mib": {str(p): m for p, m in mib.items() if p not in instances}}


# ---------------------------------------------------------------- one server


def serve(doc: dict[str, Any], args: argparse.Namespace, label: dict[str, Any], start: Callable[[], ServerProcess],
          model: str, paths: dict[str, Callable[[ServerProcess], list[str]]]) -> None:
    """Starts one server, measures each of ``paths`` (name -> shmserve-perf flags for it), stops it;
    one row per path in ``doc["rows"]``, an error row where a path (or the server) failed."""
    t0 = time.perf_counter()
    try:
        server = start()
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the other servers still run
        print(f"# {label}: the server did not start: {exc}", flush=True)
        doc["rows"].extend({**label, "path": p, "error": f"server: {exc}"} for p in paths)
        return
    memory: dict[str, Any] = {}
    done: list[str] = []
    try:
        bench_gpu.wait_model_ready(server, model)
        wait_metrics(server, model)
        ready_s = round(time.perf_counter() - t0, 1)
        for path, flags in paths.items():
            done.append(path)
            row: dict[str, Any] = {**label, "path": path, "model": model, "server_ready_s": ready_s}
            try:
                row.update(measure_path(server, model, flags(server), args))
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - the next path still runs
                row["error"] = repr(exc)
            if INTERRUPTED:
                row["error"] = "stopped by SIGINT (a time limit)"
                doc["rows"].append(row)
                raise KeyboardInterrupt
            if args.device == "cuda" and not memory:
                memory = gpu_memory(server, model)
            row["gpu_memory"] = memory or None
            doc["rows"].append(row)
            print(f"# {time.strftime('%H:%M:%S')} {row}", flush=True)
    except (Exception, SystemExit) as exc:  # noqa: BLE001
        doc["rows"].extend({**label, "path": p, "error": repr(exc)} for p in paths if p not in done)
    finally:
        server.stop()


def wait_metrics(server: ServerProcess, model: str, timeout_s: float = 30.0) -> None:
    """Triton opens its metrics port after reporting ready."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            batch_size.counts(f"127.0.0.1:{server.metrics_port}", model)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def shmserve_paths() -> dict[str, Callable[[ServerProcess], list[str]]]:
    return {"http": lambda s: ["-u", s.url],
            "grpc": lambda s: ["-i", "grpc", "-u", f"127.0.0.1:{s.grpc_port}"],  # type: ignore[attr-defined]
            "local": lambda s: ["-i", "local", "-u", s.id]}


class ShmserveProcess(ServerProcess):
    """shmserve with its gRPC frontend on a free port too, and the drain at its stop bounded as
    Triton's (tools/triton_process.py): requests of clients stopped midway are not waited for long."""

    def __init__(self, repos: list[Path | str], log: Path | None) -> None:
        self.grpc_port = free_port()
        super().__init__(repos, "--grpc-address=127.0.0.1", f"--grpc-port={self.grpc_port}",
                         "--exit-timeout-secs=10", log=log)


def run_instances(doc: dict[str, Any], args: argparse.Namespace, instances: int, root: Path) -> None:
    py_repo, ts_repo = root / f"python-{instances}", root / f"torchscript-{instances}"
    py_model = write_python_repository(py_repo, args, instances)
    ts_model, model_file = bench_gpu.write_repository(ts_repo, argparse.Namespace(**{**vars(args),
                                                                                    "instances": instances}))
    doc["model_files"][str(instances)] = str(model_file)
    doc.setdefault("configs", {})[f"python-{instances}"] = (py_repo / py_model / "config.pbtxt").read_text()
    doc["configs"][f"torchscript-{instances}"] = (ts_repo / ts_model / "config.pbtxt").read_text()
    groups = []
    if "triton" in args.servers:
        groups.append(({"instances": instances, "server": "triton", "backend": "python"},
                       lambda: TritonProcess(args.triton_root, [py_repo], python=args.triton_python,
                                             log=args.server_log),
                       py_model, {"http": shmserve_paths()["http"], "grpc": shmserve_paths()["grpc"]}))
    if "shmserve-python" in args.servers:
        groups.append(({"instances": instances, "server": "shmserve", "backend": "python"},
                       lambda: ShmserveProcess([py_repo], args.server_log), py_model, shmserve_paths()))
    if "shmserve-torchscript" in args.servers:
        groups.append(({"instances": instances, "server": "shmserve", "backend": "torchscript"},
                       lambda: ShmserveProcess([ts_repo], args.server_log), ts_model, shmserve_paths()))
    for label, start, model, paths in groups:
        serve(doc, args, label, start, model, paths)
        write(doc, args)


# ---------------------------------------------------------------- the floor, the table


def measure_floor(doc: dict[str, Any], args: argparse.Namespace) -> None:
    """torch alone with the TorchScript file, at batch 1 and at the batches its rows formed."""
    formed = {bench_gpu.batch_of(r["avg_batch"]) for r in doc["rows"]
              if r.get("backend") == "torchscript" and r.get("avg_batch")}
    model_file = Path(next(iter(doc["model_files"].values())))
    for b in sorted({1, *formed}):
        doc["floor"].append(bench_gpu.floor_row(model_file, args.device, b, args.floor_seconds))
        print(f"# floor: {doc['floor'][-1]}", flush=True)


def ratios(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """shmserve's HTTP throughput over its local client's, per backend and instance count (the
    issue's target: HTTP within 10% of the local client)."""
    out = []
    rows = {(r["instances"], r["backend"], r["path"]): r for r in doc["rows"] if r["server"] == "shmserve"}
    for (n, backend, path), row in sorted(rows.items()):
        local = rows.get((n, backend, "local"))
        if path == "http" and row.get("throughput_rps") and local and local.get("throughput_rps"):
            out.append({"instances": n, "backend": backend,
                        "http_over_local": round(row["throughput_rps"] / local["throughput_rps"], 3)})
    return out


def table(doc: dict[str, Any]) -> str:
    """The markdown table for docs/performance.md."""
    lines = ["| instances | server | backend | path | inferences/s | p50 | p99 | batch formed | "
             "GPU memory per instance | server CPU per inference |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in doc["rows"]:
        head = f"| {r['instances']} | {r['server']} | {r['backend']} | {r['path']} |"
        if r.get("error") or not r.get("throughput_rps"):
            lines.append(f"{head} error: {str(r.get('error') or r.get('first_error'))[:80]} | | | | | |")
            continue
        mem = (r.get("gpu_memory") or {}).get("per_instance_mib")
        cpu = r.get("server_cpu_us_per_inference")
        lines.append(f"{head} {r['throughput_rps']:,.0f} | {r['p50_us'] / 1e3:.1f} ms | {r['p99_us'] / 1e3:.1f} ms "
                     f"| {r['avg_batch'] or 0:.1f} | {', '.join(f'{m:,} MiB' for m in mem) if mem else '-'} "
                     f"| {f'{cpu:,.0f} µs' if cpu is not None else '-'} |")
    for f in doc["floor"]:
        lines.append(f"| | torch alone | torchscript | batch {f['batch']} | {f['inferences_per_s']:,.0f} | "
                     f"{f['p50_batch_us'] / 1e3:.1f} ms (batch) | | {f['batch']} | | |")
    if doc["http_over_local"]:
        lines.append("")
    for r in doc["http_over_local"]:
        lines.append(f"shmserve {r['backend']}, {r['instances']} instance(s): HTTP / local = {r['http_over_local']}")
    return "\n".join(lines)


def write(doc: dict[str, Any], args: argparse.Namespace) -> None:
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m shmserve.tools.bench_gpu_triton", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="KIND_GPU or KIND_CPU, and the floor's")
    p.add_argument("--model", choices=["resnet50", "small"], default="resnet50")
    p.add_argument("--instances", type=int, nargs="+", default=[1, 2], help="instance_group counts, one run each")
    p.add_argument("--queue-delay-us", type=int, default=1000, help="max_queue_delay_microseconds, both servers")
    p.add_argument("--clients", type=int, default=16, help="closed-loop client processes per path")
    p.add_argument("--seconds", type=float, default=6.0, help="measured seconds per path")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each path")
    p.add_argument("--floor-seconds", type=float, default=2.0, help="measured seconds per floor batch size")
    p.add_argument("--path-timeout", type=float, default=60.0, help="seconds after which a path is an error row")
    p.add_argument("--servers", nargs="+", default=["triton", "shmserve-python", "shmserve-torchscript"],
                   choices=["triton", "shmserve-python", "shmserve-torchscript"])
    p.add_argument("--triton-root", type=Path, default=Path("/tmp/triton"),
                   help="folder holding pytriton/tritonserver and nvidia_pytriton.libs")
    p.add_argument("--triton-python", default=sys.executable,
                   help="the Python whose libpython and site-packages Triton's stub uses")
    p.add_argument("--server-log", type=Path, help="append the servers' output here")
    p.add_argument("--json", type=Path, help="write the JSON document here (after each server, too)")
    p.add_argument("--table-from", type=Path, metavar="JSON",
                   help="only print the table of a JSON document an earlier run wrote (one stopped midway too)")
    args = p.parse_args(argv)
    if min(args.instances) < 1 or args.clients < 1 or args.seconds <= 0:
        p.error("--instances and --clients must be >= 1, --seconds > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table_from:
        doc = json.loads(args.table_from.read_text())
        doc.setdefault("http_over_local", ratios(doc))
        print(table(doc))
        return 0
    started = time.perf_counter()
    doc: dict[str, Any] = {"environment": bench_gpu.environment(args.device), "rows": [], "floor": [],
                           "model_files": {}, "model_py": MODEL_PY, "errors": [],
                           "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    root = Path(tempfile.mkdtemp(prefix="shmserve-bench-gpu-triton-"))
    signal.signal(signal.SIGINT, on_sigint)
    try:
        for n in args.instances:
            run_instances(doc, args, n, root)
        try:
            measure_floor(doc, args)
        except (Exception, SystemExit) as exc:  # noqa: BLE001
            doc["errors"].append(f"floor: {exc!r}")
    except KeyboardInterrupt:  # `timeout -s INT`: the rows measured so far still make the table
        doc["errors"].append("stopped by SIGINT (a time limit) before the end")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        doc["http_over_local"] = ratios(doc)
        doc["total_s"] = round(time.perf_counter() - started, 1)
        write(doc, args)
    print(table(doc))
    failed = [r for r in doc["rows"] if r.get("error") or r.get("errors")]
    for r in failed:
        print(f"error: {r['server']} {r['backend']} {r['path']} ({r['instances']}): "
              f"{r.get('error') or r.get('first_error')}", file=sys.stderr)
    for err in doc["errors"]:
        print(f"error: {err}", file=sys.stderr)
    return 1 if failed or doc["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
