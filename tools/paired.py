"""Two endpoints measured in alternating short slices, so that both see the same host.

The host under these VMs runs fast and slow phases (the same code measures up to 2x apart minutes
later), so a comparison of two runs taken one after the other can say more about the phases than
about the servers. Here the same client processes take turns on both endpoints: A B B A, A B B A,
... with slices of a few seconds, and each pair of neighbouring slices gives one ratio. The median
of those ratios is the figure; their spread shows how far the host moved.

    python -m shmserve.tools.paired --model add_sub --clients 4 \\
        --target triton=127.0.0.1:18000 --target shmserve=127.0.0.1:18600 --target local=local:myid

Each target is ``NAME=HOST:PORT`` (KServe v2 over HTTP with ``tritonclient``, loopback only),
``NAME=grpc:HOST:PORT`` (Triton's GRPCInferenceService with ``tritonclient.grpc``, tensors as raw
binary contents, loopback only) or ``NAME=local:SERVER_ID`` (shmserve's local client library).
The server CPU per request is read for the process tree that listens on an HTTP or gRPC target's
port. Both servers stay up for the whole run; an idle one costs next to nothing. Ratios are
reported against the first target.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from shmserve.tools import bench_http, proc_cpu
from shmserve.tools.bench_local import in_region

SETUP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Target:
    name: str
    kind: str  # "http", "grpc" or "local"
    address: str  # host:port, or the server id


def parse_target(text: str) -> Target:
    name, sep, address = text.partition("=")
    if not sep or not name or not address:
        raise SystemExit(f"bad --target {text!r}; expected NAME=HOST:PORT, NAME=grpc:HOST:PORT "
                         "or NAME=local:SERVER_ID")
    if address.startswith("local:"):
        return Target(name, "local", address[len("local:"):])
    kind, _, rest = address.partition(":")
    if kind == "grpc":
        bench_http.require_loopback(rest)
        return Target(name, "grpc", rest)
    bench_http.require_loopback(address)
    return Target(name, "http", address)


def _http_caller(target: Target, model: str, specs: tuple[bench_http.TensorSpec, ...],
                 outputs: tuple[bench_http.TensorSpec, ...], seed: int, shm: bool
                 ) -> tuple[Callable[[], None], Callable[[], None]]:
    """Binary tensors in the body, or (``shm``) system shared-memory regions registered with the
    target over HTTP, as ``tools.bench_http --shm system`` does."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(target.address, connection_timeout=10.0, network_timeout=120.0)
    rng = np.random.default_rng(seed)
    if not shm:
        inputs = bench_http.build_inputs(specs, rng)
        wanted = [httpclient.InferRequestedOutput(o.name, binary_data=True) for o in outputs]
        return (lambda: client.infer(model, inputs, outputs=wanted)), client.close
    cfg = bench_http.WorkerConfig(url=target.address, model=model, inputs=specs, outputs=outputs, shm="system",
                                  warmup_s=0.0, duration_s=0.0, max_requests=0, timeout_s=120.0,
                                  run_id=f"paired{os.getpid()}{target.name}")
    regions = bench_http.ShmRegions(client, cfg, seed)

    def close() -> None:
        regions.close()
        client.close()

    try:
        inputs, wanted = bench_http.build_shm_request(cfg, regions, rng)
    except Exception:
        close()
        raise
    return (lambda: client.infer(model, inputs, outputs=wanted)), close


def _grpc_caller(target: Target, model: str, specs: tuple[bench_http.TensorSpec, ...],
                 outputs: tuple[bench_http.TensorSpec, ...], seed: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """Tensors as raw binary contents of the request and response messages (what
    ``set_data_from_numpy`` sends over gRPC)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(target.address)
    rng = np.random.default_rng(seed)
    inputs = []
    for spec in specs:
        inp = grpcclient.InferInput(spec.name, list(spec.shape), spec.datatype)
        inp.set_data_from_numpy(bench_http.random_array(spec, rng))
        inputs.append(inp)
    wanted = [grpcclient.InferRequestedOutput(o.name) for o in outputs]
    return (lambda: client.infer(model, inputs, outputs=wanted, client_timeout=120.0)), client.close


def _local_caller(target: Target, model: str, specs: tuple[bench_http.TensorSpec, ...],
                  seed: int, shm: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    """The local client; with ``shm`` the inputs live in a region the client created, so they
    travel by reference (as ``tools.bench_local --region``)."""
    from shmserve.shm.client import Client

    client = Client(target.address)
    rng = np.random.default_rng(seed)
    inputs = {s.name: bench_http.random_array(s, rng) for s in specs}
    if shm:
        inputs = in_region(client, inputs, f"paired{os.getpid()}{target.name}")
    return (lambda: client.infer(model, inputs).release()), client.close


def client_main(targets: list[Target], model: str, specs: tuple[bench_http.TensorSpec, ...],
                outputs: tuple[bench_http.TensorSpec, ...], shm: bool, index: int, commands: Any, barrier: Any,
                results: Any) -> None:
    """One client process: a caller per target, then one closed-loop slice per command."""
    callers: list[tuple[Callable[[], None], Callable[[], None]]] = []
    try:
        for t in targets:
            if t.kind == "http":
                callers.append(_http_caller(t, model, specs, outputs, index, shm))
            elif t.kind == "grpc":
                callers.append(_grpc_caller(t, model, specs, outputs, index))
            else:
                callers.append(_local_caller(t, model, specs, index, shm))
        parent = os.getppid()
        while True:
            try:
                cmd = commands.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:
                    return  # the run was killed: nobody will send a command, or read a result
                continue
            if cmd is None:
                return
            which, warm_s, slice_s = cmd
            call = callers[which][0]
            barrier.wait(timeout=SETUP_TIMEOUT_S)
            end = time.perf_counter() + warm_s
            while time.perf_counter() < end:
                call()
            latencies: list[int] = []
            waited0 = proc_cpu.usage([os.getpid()]).waited_us
            cpu0 = time.process_time()
            start = time.perf_counter()
            end = start + slice_s
            while True:
                t0 = time.perf_counter_ns()
                if t0 / 1e9 >= end:
                    break
                call()
                latencies.append(time.perf_counter_ns() - t0)
            elapsed = time.perf_counter() - start
            cpu_us = (time.process_time() - cpu0) * 1e6 / max(len(latencies), 1)
            waited_us = (proc_cpu.usage([os.getpid()]).waited_us - waited0) / max(len(latencies), 1)
            results.put((index, which, len(latencies) / elapsed, latencies, cpu_us, waited_us, None))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which stops the run
        barrier.abort()
        results.put((index, -1, 0.0, [], 0.0, 0.0, f"{type(exc).__name__}: {exc}"))
    finally:
        for _, close in callers:
            close()


def slice_order(pairs: int) -> list[tuple[int, int]]:
    """The roles (0: baseline, 1: the compared target) of each pair in running order, A B B A: a
    steady drift of the host shifts both members of a pair alike, and alternating which goes
    first cancels what remains."""
    return [(0, 1) if p % 2 == 0 else (1, 0) for p in range(pairs)]


def measure(targets: list[Target], model: str, specs: tuple[bench_http.TensorSpec, ...],
            outputs: tuple[bench_http.TensorSpec, ...], clients: int, pairs: int, warm_s: float,
            slice_s: float, shm: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every further target against the first, ``pairs`` pairs each; the slices' figures and the
    per-pair ratios (throughput and p50 of the second over the first)."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(clients), ctx.Queue()
    queues = [ctx.Queue() for _ in range(clients)]
    procs = [ctx.Process(target=client_main, args=(targets, model, specs, outputs, shm, i, queues[i], barrier, results),
                         daemon=True) for i in range(clients)]
    for p in procs:
        p.start()
    slices: list[dict[str, Any]] = []
    comparisons: dict[str, list[dict[str, float]]] = {t.name: [] for t in targets[1:]}
    trees = [server_processes(t) for t in targets]
    try:
        def run_slice(which: int) -> dict[str, Any]:
            for q in queues:
                q.put((which, warm_s, slice_s))
            time.sleep(warm_s)  # the clients warm up; then the server's usage is read around their slice
            used0, (idle0, all0) = proc_cpu.usage(trees[which]), proc_cpu.machine_ticks()
            try:
                got = [results.get(timeout=SETUP_TIMEOUT_S + warm_s + slice_s * 4) for _ in range(clients)]
            except queue.Empty:
                raise RuntimeError("a client process stopped answering (did it die?)") from None
            used, (idle1, all1) = proc_cpu.usage(trees[which]) - used0, proc_cpu.machine_ticks()
            errors = [e for *_, e in got if e]
            if errors:
                raise RuntimeError(f"a client failed: {errors[0]}")
            lat = np.concatenate([np.asarray(g[3], dtype=np.float64) for g in got]) / 1e3
            row = {"target": targets[which].name, "rps": round(sum(g[2] for g in got), 1),
                   "client_cpu_us": round(statistics.median(g[4] for g in got), 1),
                   "p50_us": round(float(np.percentile(lat, 50)), 1) if lat.size else None,
                   "p99_us": round(float(np.percentile(lat, 99)), 1) if lat.size else None,
                   "idle": round((idle1 - idle0) / max(all1 - all0, 1), 3)}
            if proc_cpu.WAITS_KNOWN:
                row["client_wait_us"] = round(statistics.median(g[5] for g in got), 1)
            if trees[which] and lat.size:
                row["server_cpu_us"] = round(used.cpu_us / lat.size, 1)
                row["server_switches"] = round((used.voluntary + used.involuntary) / lat.size, 2)
                if proc_cpu.WAITS_KNOWN:
                    row["server_wait_us"] = round(used.waited_us / lat.size, 1)
            slices.append(row)
            server = f"  server CPU {row['server_cpu_us']:>5.0f} us/req" if "server_cpu_us" in row else ""
            waits = f"  waits for a core: clients {row['client_wait_us']:>4.0f}" if "client_wait_us" in row else ""
            if waits and "server_wait_us" in row:
                waits += f", server {row['server_wait_us']:>4.0f} us/req"
            log(f"  {row['target']:>12} {row['rps']:>10.1f} req/s  p50 {row['p50_us']:>8.0f} us  "
                f"p99 {row['p99_us']:>8.0f} us  client CPU {row['client_cpu_us']:>5.0f} us/req{server}  "
                f"idle {row['idle']:.0%}{waits}")
            return row

        for other in range(1, len(targets)):
            for order in slice_order(pairs):
                rows = {role: run_slice(other if role else 0) for role in order}  # role 0: the baseline
                base, cand = rows[0], rows[1]
                comparisons[targets[other].name].append({
                    "rps_ratio": cand["rps"] / base["rps"] if base["rps"] else float("nan"),
                    "p50_ratio": cand["p50_us"] / base["p50_us"] if base["p50_us"] else float("nan")})
    finally:
        for q in queues:
            q.put(None)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    summary = {}
    for name, pairs_ in comparisons.items():
        rps = sorted(c["rps_ratio"] for c in pairs_)
        p50 = sorted(c["p50_ratio"] for c in pairs_)
        summary[name] = {"rps_ratio_median": statistics.median(rps), "rps_ratio_min": rps[0], "rps_ratio_max": rps[-1],
                         "p50_ratio_median": statistics.median(p50), "p50_ratio_min": p50[0],
                         "p50_ratio_max": p50[-1], "pairs": len(pairs_)}
    return {"model": model, "clients": clients, "shm": shm, "baseline": targets[0].name, "slice_s": slice_s,
            "slices": slices, "vs_baseline": summary, "costs": costs(targets, slices)}


def server_processes(target: Target) -> list[int]:
    """The process tree of an HTTP or gRPC target's server (by its listening port); none for a
    local one."""
    return proc_cpu.server_tree(int(target.address.rsplit(":", 1)[1])) if target.kind != "local" else []


def costs(targets: list[Target], slices: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per target, medians over its slices of what one request cost: the clients' and the server's
    CPU and waits for a core (None where they could not be read) and the machine's idle share."""
    out: dict[str, dict[str, float | None]] = {}
    for t in targets:
        rows = [r for r in slices if r["target"] == t.name]
        out[t.name] = {key: _median(rows, key) for key in ("client_cpu_us", "server_cpu_us", "idle",
                                                            "client_wait_us", "server_wait_us")}
    return out


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


def resolve_specs(targets: list[Target], model: str, overrides: dict[str, tuple[int, ...]]
                  ) -> tuple[tuple[bench_http.TensorSpec, ...], tuple[bench_http.TensorSpec, ...]]:
    """Input and output specs from the first HTTP target's metadata (else the first gRPC
    target's, else the local client's); outputs with -1 dims take their shape from one request
    (shm regions need their size)."""
    http = next((t for t in targets if t.kind == "http"), None)
    grpc_target = next((t for t in targets if t.kind == "grpc"), None)
    if http is not None:
        meta = bench_http.fetch_metadata(http.address, model, "")
    elif grpc_target is not None:
        meta = grpc_metadata(grpc_target.address, model)
    else:
        from shmserve.shm.client import Client

        with Client(targets[0].address) as client:
            meta = client.model_metadata(model)
    inputs = bench_http.tensor_specs(meta["inputs"], overrides, 1)
    outputs = bench_http.tensor_specs(meta["outputs"], overrides, 1)
    if http is not None and any(-1 in o["shape"] for o in meta["outputs"]):
        outputs = bench_http.probe_outputs(http.address, model, inputs, outputs)
    return inputs, outputs


def grpc_metadata(address: str, model: str) -> dict[str, Any]:
    """Model metadata over gRPC, shaped as the HTTP answer (the JSON form of the message spells
    int64 dims as strings)."""
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(address) as client:
        if not client.is_model_ready(model):
            raise SystemExit(f"model {model!r} is not ready at {address}")
        meta = client.get_model_metadata(model, as_json=True)
    return {key: [{"name": e["name"], "datatype": e["datatype"], "shape": [int(d) for d in e["shape"]]}
                  for e in meta.get(key, [])] for key in ("inputs", "outputs")}


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shmserve.tools.paired", description=__doc__.splitlines()[0])
    p.add_argument("--target", action="append", required=True, metavar="NAME=HOST:PORT|NAME=grpc:HOST:PORT|NAME=local:ID",
                   help="an endpoint (at least two; the first is the baseline)")
    p.add_argument("--model", required=True)
    p.add_argument("--clients", type=int, default=1, help="client processes, each in a closed loop")
    p.add_argument("--pairs", type=int, default=10, help="pairs of slices per compared target")
    p.add_argument("--slice", type=float, default=2.0, help="measured seconds per slice")
    p.add_argument("--warmup", type=float, default=0.3, help="unmeasured seconds before each slice")
    p.add_argument("--shape-override", action="append", default=[], metavar="NAME=d,d")
    p.add_argument("--shm", choices=["none", "system"], default="none",
                   help="system: tensors in shm regions (registered over HTTP; the local client's own region)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    # Stopped with SIGTERM (e.g. by `timeout`): stop the client processes too, as on an error.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    targets = [parse_target(t) for t in args.target]
    if len(targets) < 2 or args.clients < 1 or args.pairs < 1 or args.slice <= 0 or args.warmup < 0:
        p.error("needs two targets or more, --clients >= 1, --pairs >= 1, --slice > 0, --warmup >= 0")
    if args.shm == "system" and any(t.kind == "grpc" for t in targets):
        p.error("--shm system is for HTTP and local targets; gRPC targets send raw binary contents")
    specs, outputs = resolve_specs(targets, args.model, bench_http.parse_overrides(args.shape_override))
    print(f"# {args.model}, {args.clients} client(s), {args.pairs} pairs of {args.slice:g} s slices per target"
          f"{', shm regions' if args.shm == 'system' else ''}")
    try:
        result = measure(targets, args.model, specs, outputs, args.clients, args.pairs, args.warmup, args.slice,
                         shm=args.shm == "system")
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for name, s in result["vs_baseline"].items():
        print(f"{name} / {result['baseline']}: throughput {s['rps_ratio_median']:.2f}x "
              f"(pairs {s['rps_ratio_min']:.2f}-{s['rps_ratio_max']:.2f}), p50 {s['p50_ratio_median']:.2f}x "
              f"(pairs {s['p50_ratio_min']:.2f}-{s['p50_ratio_max']:.2f}), {s['pairs']} pairs")
    for name, c in result["costs"].items():
        server = f"server {c['server_cpu_us']:.0f} us" if c["server_cpu_us"] is not None else \
            "server not measured (no port to find it by, or its processes are not readable)"
        waits = ""
        if c["client_wait_us"] is not None:
            waits = f"; waits for a core: a client {c['client_wait_us']:.0f} us"
            if c["server_wait_us"] is not None:
                waits += f", the server {c['server_wait_us']:.0f} us"
        print(f"{name} per request (medians of its slices): a client {c['client_cpu_us']:.0f} us, {server}, "
              f"machine idle {c['idle']:.0%}{waits}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
