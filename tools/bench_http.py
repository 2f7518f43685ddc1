"""Closed-loop latency/throughput benchmark for any KServe v2 HTTP endpoint.

Drives the server with ``tritonclient.http`` from separate client *processes*, so
shmserve and the real Triton are measured by the same client code in one run:

    python -m shmserve.tools.bench_http --url 127.0.0.1:8000 --model add_sub --clients 1,4 --duration 10

Inputs are built from the model metadata; ``--shm system`` moves tensors through
tritonclient's system shared-memory regions (the KServe shm extension).
Only loopback addresses are accepted: this is a local load generator.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import multiprocessing as mp
import queue
import socket
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.utils import InferenceServerException

# Dtypes the random-data generator understands (KServe name -> numpy dtype).
NUMERIC_DTYPES: dict[str, str] = {
    "BOOL": "bool",
    "INT8": "int8",
    "INT16": "int16",
    "INT32": "int32",
    "INT64": "int64",
    "UINT8": "uint8",
    "UINT16": "uint16",
    "UINT32": "uint32",
    "UINT64": "uint64",
    "FP16": "float16",
    "FP32": "float32",
    "FP64": "float64",
}
SHM_PREFIX = "shmbench"  # /dev/shm names start with this, so leftovers are easy to spot.
MAX_ERRORS_PER_WORKER = 50  # A dead server must not turn into a tight error loop.
SETUP_TIMEOUT_S = 120.0  # Bound on worker start-up (spawned interpreter + imports + warmup).


@dataclass(frozen=True)
class TensorSpec:
    """A concrete input or output: name, KServe datatype and fully resolved shape."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Byte size, needed to size shared-memory regions."""
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(NUMERIC_DTYPES[self.datatype]).itemsize


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a spawned client process needs; picklable by construction."""

    url: str
    model: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    shm: str
    warmup_s: float
    duration_s: float
    max_requests: int
    run_id: str
    timeout_s: float


@dataclass
class WorkerResult:
    """What a client process sends back: latencies in ns and its measured window."""

    index: int
    latencies_ns: list[int] = field(default_factory=list)
    errors: int = 0
    elapsed_s: float = 0.0
    first_error: str | None = None


# ---------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """CLI; kept flat so the README commands are the whole interface."""
    p = argparse.ArgumentParser(prog="python -m shmserve.tools.bench_http", description=__doc__.splitlines()[0])
    p.add_argument("--url", default="127.0.0.1:8000", help="host:port of the HTTP endpoint (loopback only)")
    p.add_argument("--model", required=True)
    p.add_argument("--model-version", default="")
    p.add_argument("--clients", default="1", help="comma-separated client-process counts, e.g. 1,4")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per client count")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each measurement")
    p.add_argument("--repeat", type=int, default=1, help="runs per client count; medians are reported")
    p.add_argument("--shape-override", action="append", default=[], metavar="NAME=d,d",
                   help="concrete shape for a tensor with -1 dims (repeatable)")
    p.add_argument("--default-dim", type=int, default=1, help="value for -1 dims without an override")
    p.add_argument("--shm", choices=["none", "system"], default="none")
    p.add_argument("--max-requests", type=int, default=10_000_000, help="hard cap per client per run")
    p.add_argument("--timeout", type=float, default=60.0, help="per-request network timeout, seconds")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    args.client_counts = parse_clients(args.clients)
    args.overrides = parse_overrides(args.shape_override)
    if args.duration <= 0 or args.warmup < 0 or args.repeat < 1:
        p.error("--duration must be > 0, --warmup >= 0, --repeat >= 1")
    return args


def parse_clients(text: str) -> list[int]:
    """'1,4' -> [1, 4]; rejects zero/negative counts early rather than mid-run."""
    counts = [int(c) for c in text.split(",") if c.strip()]
    if not counts or min(counts) < 1:
        raise SystemExit(f"--clients needs positive integers, got {text!r}")
    return counts


def parse_overrides(items: list[str]) -> dict[str, tuple[int, ...]]:
    """['INPUT0=4194304'] -> {'INPUT0': (4194304,)}."""
    out: dict[str, tuple[int, ...]] = {}
    for item in items:
        name, sep, dims = item.partition("=")
        if not sep or not dims:
            raise SystemExit(f"bad --shape-override {item!r}; expected NAME=dim[,dim...]")
        out[name.strip()] = tuple(int(d) for d in dims.split(","))
    return out


def require_loopback(url: str) -> None:
    """Refuse non-loopback targets: this tool generates load and must stay on this machine."""
    host = url.rsplit(":", 1)[0].strip("[]") if ":" in url else url
    for info in socket.getaddrinfo(host, None):
        addr = ipaddress.ip_address(info[4][0])
        if not addr.is_loopback:
            raise SystemExit(f"refusing non-loopback target {url!r} ({addr})")


# ---------------------------------------------------------------- model metadata


def resolve_shape(name: str, dims: list[int], overrides: dict[str, tuple[int, ...]], default: int) -> tuple[int, ...]:
    """Replace -1 dims: a full override wins, otherwise each -1 becomes the default."""
    if name in overrides:
        shape = overrides[name]
        if len(shape) != len(dims) or any(d not in (-1, s) for d, s in zip(dims, shape)):
            raise SystemExit(f"--shape-override {name}={shape} does not fit model dims {dims}")
        return shape
    return tuple(default if int(d) < 0 else int(d) for d in dims)


def tensor_specs(entries: list[dict[str, Any]], overrides: dict[str, tuple[int, ...]], default: int) -> tuple[TensorSpec, ...]:
    """Metadata inputs/outputs -> concrete specs; non-numeric types are out of scope."""
    specs = []
    for e in entries:
        if e["datatype"] not in NUMERIC_DTYPES:
            raise SystemExit(f"tensor {e['name']}: datatype {e['datatype']} is not supported (numeric only)")
        specs.append(TensorSpec(e["name"], e["datatype"], resolve_shape(e["name"], list(e["shape"]), overrides, default)))
    return tuple(specs)


def fetch_metadata(url: str, model: str, version: str) -> dict[str, Any]:
    """Model metadata from the server; the single source of input names/types/shapes."""
    import tritonclient.http as httpclient

    with httpclient.InferenceServerClient(url, connection_timeout=10.0, network_timeout=30.0) as client:
        if not client.is_model_ready(model, version):
            raise SystemExit(f"model {model!r} is not ready at {url}")
        return client.get_model_metadata(model, version)


def probe_outputs(url: str, model: str, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
    """One plain request to learn real output shapes (for -1 outputs and shm region sizes)."""
    import tritonclient.http as httpclient

    with httpclient.InferenceServerClient(url, connection_timeout=10.0, network_timeout=120.0) as client:
        result = client.infer(model, build_inputs(inputs, np.random.default_rng(0)),
                              outputs=[httpclient.InferRequestedOutput(o.name, binary_data=True) for o in outputs])
        return tuple(TensorSpec(o.name, o.datatype, tuple(result.get_output(o.name)["shape"])) for o in outputs)


# ---------------------------------------------------------------- request building


def random_array(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """Random data of the right dtype; small ints so add/sub never overflow."""
    dtype = np.dtype(NUMERIC_DTYPES[spec.datatype])
    if dtype == np.bool_:
        return rng.integers(0, 2, spec.shape).astype(np.bool_)
    if dtype.kind in "iu":
        return rng.integers(0, 100, spec.shape, dtype=dtype)
    return rng.random(spec.shape, dtype=np.float32).astype(dtype, copy=False)


def build_inputs(specs: tuple[TensorSpec, ...], rng: np.random.Generator) -> list[Any]:
    """InferInputs carrying binary data, built once and reused for every request."""
    import tritonclient.http as httpclient

    inputs = []
    for spec in specs:
        inp = httpclient.InferInput(spec.name, list(spec.shape), spec.datatype)
        inp.set_data_from_numpy(random_array(spec, rng), binary_data=True)
        inputs.append(inp)
    return inputs


class ShmRegions:
    """Per-process system shm regions for every input and output, registered with the server.

    Owned by one client process; `close` unregisters and unlinks so /dev/shm stays clean.
    """

    def __init__(self, client: Any, cfg: WorkerConfig, index: int) -> None:
        self.client = client
        self.handles: list[tuple[str, Any]] = []
        self.prefix = f"{SHM_PREFIX}_{cfg.run_id}_{index}"

    def create(self, spec: TensorSpec, kind: str) -> str:
        """Create + register one region; returns the region name used in requests."""
        import tritonclient.utils.shared_memory as shm

        name = f"{self.prefix}_{kind}_{spec.name}"
        handle = shm.create_shared_memory_region(name, "/" + name, spec.nbytes)
        self.handles.append((name, handle))
        self.client.register_system_shared_memory(name, "/" + name, spec.nbytes)
        return name

    def close(self) -> None:
        """Unregister from the server, then unlink locally; best effort for each region."""
        import tritonclient.utils.shared_memory as shm

        for name, handle in self.handles:
            try:
                self.client.unregister_system_shared_memory(name)
            except Exception as exc:  # noqa: BLE001 - server may already be gone; still unlink.
                print(f"warning: could not unregister {name}: {exc}", file=sys.stderr)
            shm.destroy_shared_memory_region(handle)
        self.handles.clear()


def build_shm_request(cfg: WorkerConfig, regions: ShmRegions, rng: np.random.Generator) -> tuple[list[Any], list[Any]]:
    """Inputs/outputs that point at shm regions; data is written to the regions once."""
    import tritonclient.http as httpclient
    import tritonclient.utils.shared_memory as shm

    inputs, outputs = [], []
    for spec in cfg.inputs:
        name = regions.create(spec, "in")
        shm.set_shared_memory_region(regions.handles[-1][1], [random_array(spec, rng)])
        inp = httpclient.InferInput(spec.name, list(spec.shape), spec.datatype)
        inp.set_shared_memory(name, spec.nbytes)
        inputs.append(inp)
    for spec in cfg.outputs:
        name = regions.create(spec, "out")
        out = httpclient.InferRequestedOutput(spec.name, binary_data=True)
        out.set_shared_memory(name, spec.nbytes)
        outputs.append(out)
    return inputs, outputs


# ---------------------------------------------------------------- client process


def closed_loop(client: Any, cfg: WorkerConfig, inputs: list[Any], outputs: list[Any],
                seconds: float, result: WorkerResult, record: bool) -> None:
    """Send one request at a time until `seconds` pass or the request cap is hit.

    Errors count in warmup too (a broken setup must not look like a clean run);
    latencies are kept only when `record` is set.
    """
    deadline = time.perf_counter() + seconds
    for _ in range(cfg.max_requests):
        t0 = time.perf_counter_ns()
        if t0 / 1e9 >= deadline:
            break
        try:
            client.infer(cfg.model, inputs, outputs=outputs)
        except Exception as exc:  # counted and reported, never retried blindly.
            result.errors += 1
            result.first_error = result.first_error or f"{exc!r}: {exc}"
            if result.errors >= MAX_ERRORS_PER_WORKER:
                raise RuntimeError(f"too many errors, last: {exc!r}") from exc
            continue
        if record:
            result.latencies_ns.append(time.perf_counter_ns() - t0)


def worker_main(cfg: WorkerConfig, index: int, barrier: Any, results: Any) -> None:
    """One client process: set up, warm up, wait for all peers, then measure."""
    import tritonclient.http as httpclient

    result = WorkerResult(index)
    client = httpclient.InferenceServerClient(cfg.url, connection_timeout=10.0, network_timeout=cfg.timeout_s)
    regions = ShmRegions(client, cfg, index)
    try:
        rng = np.random.default_rng(index)
        if cfg.shm == "system":
            inputs, outputs = build_shm_request(cfg, regions, rng)
        else:
            inputs = build_inputs(cfg.inputs, rng)
            outputs = [httpclient.InferRequestedOutput(o.name, binary_data=True) for o in cfg.outputs]
        closed_loop(client, cfg, inputs, outputs, cfg.warmup_s, result, record=False)
        barrier.wait(timeout=SETUP_TIMEOUT_S)
        t0 = time.perf_counter()
        closed_loop(client, cfg, inputs, outputs, cfg.duration_s, result, record=True)
        result.elapsed_s = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - shipped to the parent instead of a lost traceback.
        result.first_error = result.first_error or f"{exc!r}: {exc}"
        barrier.abort()
    finally:
        regions.close()
        client.close()
        results.put(asdict(result))


# ---------------------------------------------------------------- orchestration


def run_clients(cfg: WorkerConfig, n: int) -> list[WorkerResult]:
    """Spawn n client processes, collect their results, and always reap them."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(n)
    results = ctx.Queue()
    procs = [ctx.Process(target=worker_main, args=(cfg, i, barrier, results), daemon=True) for i in range(n)]
    for p in procs:
        p.start()
    collected = collect(results, n, SETUP_TIMEOUT_S + cfg.warmup_s + cfg.duration_s * 2 + cfg.timeout_s)
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    cleanup_shm_leftovers(cfg.run_id)
    return collected


def collect(results: Any, n: int, timeout_s: float) -> list[WorkerResult]:
    """Read n results from the queue within a bounded time."""
    deadline = time.monotonic() + timeout_s
    out: list[WorkerResult] = []
    while len(out) < n:
        try:
            out.append(WorkerResult(**results.get(timeout=max(0.1, deadline - time.monotonic()))))
        except queue.Empty:
            print(f"warning: only {len(out)}/{n} clients reported", file=sys.stderr)
            break
    return out


def cleanup_shm_leftovers(run_id: str) -> None:
    """Unlink regions of this run that a killed worker left behind."""
    shm_dir = Path("/dev/shm")
    if shm_dir.is_dir():
        for path in shm_dir.glob(f"{SHM_PREFIX}_{run_id}_*"):
            path.unlink(missing_ok=True)


def summarize(n: int, results: list[WorkerResult]) -> dict[str, Any]:
    """One table row: throughput is the sum of each client's own rate over its window."""
    lat_us = np.concatenate([np.asarray(r.latencies_ns, dtype=np.float64) for r in results] or [np.zeros(0)]) / 1e3
    rate = sum(len(r.latencies_ns) / r.elapsed_s for r in results if r.elapsed_s > 0)
    errors = [r.first_error for r in results if r.first_error]
    return {
        "clients": n,
        "requests": int(lat_us.size),
        "throughput_rps": round(rate, 1),
        "p50_us": round(float(np.percentile(lat_us, 50)), 1) if lat_us.size else None,
        "p99_us": round(float(np.percentile(lat_us, 99)), 1) if lat_us.size else None,
        "mean_us": round(float(lat_us.mean()), 1) if lat_us.size else None,
        "errors": sum(max(r.errors, 1 if r.first_error else 0) for r in results) + (n - len(results)),
        "first_error": errors[0] if errors else None,
    }


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of repeated runs, so one noisy run on a shared machine does not decide."""
    keys = ("requests", "throughput_rps", "p50_us", "p99_us", "mean_us")
    med = {k: statistics.median([r[k] for r in rows if r[k] is not None] or [0]) for k in keys}
    med["requests"] = int(med["requests"])
    return {"clients": rows[0]["clients"], "run": "median", **med, "errors": sum(r["errors"] for r in rows)}


def format_table(rows: list[dict[str, Any]]) -> str:
    """Fixed-width table of the rows, latencies in microseconds."""
    head = f"{'clients':>7} {'run':>6} {'requests':>9} {'req/s':>10} {'p50 us':>10} {'p99 us':>10} {'errors':>6}"
    lines = [head, "-" * len(head)]
    for r in rows:
        p50 = "-" if r["p50_us"] is None else f"{r['p50_us']:.0f}"
        p99 = "-" if r["p99_us"] is None else f"{r['p99_us']:.0f}"
        lines.append(f"{r['clients']:>7} {r['run']!s:>6} {r['requests']:>9} {r['throughput_rps']:>10.1f} "
                     f"{p50:>10} {p99:>10} {r['errors']:>6}")
    return "\n".join(lines)


def make_config(args: argparse.Namespace) -> WorkerConfig:
    """Resolve the model's tensors once in the parent so every client sends the same thing."""
    meta = fetch_metadata(args.url, args.model, args.model_version)
    inputs = tensor_specs(meta["inputs"], args.overrides, args.default_dim)
    outputs = tensor_specs(meta["outputs"], args.overrides, args.default_dim)
    outputs = probe_outputs(args.url, args.model, inputs, outputs)
    return WorkerConfig(args.url, args.model, inputs, outputs, args.shm, args.warmup, args.duration,
                        args.max_requests, uuid.uuid4().hex[:8], args.timeout)


def main(argv: list[str] | None = None) -> int:
    """Run every client count (times --repeat), print the table, optionally write JSON."""
    args = parse_args(argv)
    require_loopback(args.url)
    try:
        cfg = make_config(args)
    except (OSError, InferenceServerException) as exc:
        raise SystemExit(f"cannot set up {args.model} at {args.url}: {exc}") from exc
    shapes = ", ".join(f"{s.name}{list(s.shape)} {s.datatype}" for s in cfg.inputs)
    print(f"# {args.model} @ {args.url}  shm={args.shm}  inputs: {shapes}  "
          f"warmup={args.warmup}s duration={args.duration}s", flush=True)
    rows: list[dict[str, Any]] = []
    for n in args.client_counts:
        runs = []
        for rep in range(args.repeat):
            row = {"run": rep + 1, **summarize(n, run_clients(cfg, n))}
            runs.append(row)
            if row["first_error"]:
                print(f"# clients={n} run={rep + 1}: first error: {row['first_error']}", file=sys.stderr)
        rows.extend(runs)
        if args.repeat > 1:
            rows.append(median_row(runs))
    print(format_table(rows))
    if args.json:
        write_json(args, cfg, rows)
    return 1 if any(r["errors"] for r in rows) else 0


def write_json(args: argparse.Namespace, cfg: WorkerConfig, rows: list[dict[str, Any]]) -> None:
    """Same numbers as the table, plus what was measured, for side-by-side comparison later."""
    doc = {
        "url": args.url, "model": args.model, "shm": args.shm, "duration_s": args.duration,
        "warmup_s": args.warmup, "repeat": args.repeat,
        "inputs": [asdict(s) for s in cfg.inputs], "outputs": [asdict(s) for s in cfg.outputs],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": rows,
    }
    args.json.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
