"""Latency and throughput of the local client library (shm, no HTTP), like tools.bench_http.

    python -m shmserve.tools.bench_local --id shmserve --model add_sub --clients 1,4 --duration 10

Inputs come from the model's metadata (random data of the right type; -1 dims take
``--shape-override NAME=d,d`` or 1); ``--region`` puts the inputs in a client-owned shm region
so they travel by reference. Each client count runs that many client processes in closed loops.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import numpy as np

from shmserve.shm.tensors import DTYPES


def make_inputs(client: Any, model: str, overrides: dict[str, list[int]], region: bool) -> dict[str, np.ndarray]:
    meta = client.model_metadata(model)
    rng = np.random.default_rng(0)
    arrays: dict[str, np.ndarray] = {}
    for t in meta["inputs"]:
        shape = overrides.get(t["name"]) or [d if d > 0 else 1 for d in t["shape"]]
        dtype = DTYPES[t["datatype"]]
        arr = (rng.random(shape) * 100).astype(dtype) if dtype.kind == "f" else rng.integers(0, 100, shape).astype(dtype)
        arrays[t["name"]] = arr
    return in_region(client, arrays, f"bench{mp.current_process().pid}") if region else arrays


def in_region(client: Any, arrays: dict[str, np.ndarray], name: str) -> dict[str, np.ndarray]:
    """The same arrays copied into one region the client creates (64-byte aligned each), so
    requests carry them by reference instead of copying them into the client's arena."""
    reg = client.create_region(name, sum((a.nbytes + 63) & ~63 for a in arrays.values()))
    placed, off = {}, 0
    for key, arr in arrays.items():
        view = reg.array(arr.dtype, arr.shape, off)
        view[...] = arr
        placed[key] = view
        off += (arr.nbytes + 63) & ~63
    return placed


def run_client(args: argparse.Namespace, barrier: Any, queue: Any) -> None:
    from shmserve.shm.client import Client

    with Client(args.id) as client:
        overrides = {k: [int(x) for x in v.split(",")] for k, v in (o.split("=") for o in args.shape_override)}
        inputs = make_inputs(client, args.model, overrides, args.region)
        end = time.monotonic() + args.warmup
        while time.monotonic() < end:
            client.infer(args.model, inputs).release()
        barrier.wait()
        lat: list[float] = []
        started = time.perf_counter()
        end = started + args.duration
        while time.perf_counter() < end and len(lat) < args.max_requests:
            t0 = time.perf_counter()
            client.infer(args.model, inputs).release()
            lat.append(time.perf_counter() - t0)
        queue.put((len(lat) / (time.perf_counter() - started), lat))


def measure(args: argparse.Namespace, n: int) -> dict:
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=run_client, args=(args, barrier, queue)) for _ in range(n)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=args.warmup + args.duration + 120) for _ in procs]
    for p in procs:
        p.join()
    lat = sorted(x for _, ls in results for x in ls)
    return {"clients": n, "requests": len(lat), "rps": sum(r for r, _ in results),
            "p50_us": lat[len(lat) // 2] * 1e6, "p99_us": lat[int(len(lat) * 0.99)] * 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shmserve.tools.bench_local", description=__doc__.split("\n")[0])
    p.add_argument("--id", default="shmserve", help="the server's --id")
    p.add_argument("--model", required=True)
    p.add_argument("--clients", default="1,4")
    p.add_argument("--duration", type=float, default=10)
    p.add_argument("--warmup", type=float, default=2)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--max-requests", type=int, default=2_000_000)
    p.add_argument("--shape-override", action="append", default=[], metavar="NAME=d,d")
    p.add_argument("--region", action="store_true", help="inputs in a client-owned shm region")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    rows = []
    print(f"{'clients':>7} {'run':>4} {'requests':>9} {'req/s':>9} {'p50 us':>9} {'p99 us':>9}")
    for n in (int(c) for c in args.clients.split(",")):
        runs = []
        for rep in range(args.repeat):
            r = measure(args, n)
            runs.append(r)
            print(f"{n:>7} {rep + 1:>4} {r['requests']:>9} {r['rps']:>9.1f} {r['p50_us']:>9.0f} {r['p99_us']:>9.0f}")
        if args.repeat > 1:
            med = {k: statistics.median(r[k] for r in runs) for k in ("requests", "rps", "p50_us", "p99_us")}
            print(f"{n:>7} {'med':>4} {med['requests']:>9.0f} {med['rps']:>9.1f} {med['p50_us']:>9.0f} "
                  f"{med['p99_us']:>9.0f}")
            runs.append({"clients": n, "median": True, **med})
        rows.extend(runs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
