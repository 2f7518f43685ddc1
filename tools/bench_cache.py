"""What the response cache costs: per operation in-process, and per request through a server.

    python -m shmserve.tools.bench_cache micro [--iterations N]
    python -m shmserve.tools.bench_cache server [--requests N] [--log PATH]

``micro`` runs the cache module alone, as a worker uses it (``workers/response_cache.py`` over a
real shared-memory store of 32 MiB, filled first, so that inserts evict as in a server that has
run a while), for add_sub-sized requests (two INT32[16] inputs, two outputs) and 1 MiB ones (one
FP32[262144] input and output): the key (SHA-256 of the inputs), a lookup that misses, the insert
of the outputs, and a lookup that hits (with its outputs decoded). What a miss adds over no cache
is key + lookup + insert; a hit replaces the model's execution by key + lookup. These figures do
not depend on a busy host as much as end-to-end latencies do.

``server`` starts a shmserve of its own (``--cache-config local,size=256 MiB``) on a temporary
repository holding add_sub and a 1 MiB identity, each also as a copy with ``response_cache``, and
sends sequential requests over HTTP and through the local client, the modes taking turns in
rounds: ``none`` (the copy without the cache, new inputs each time), ``miss`` (new inputs each
time), ``hit`` (the same inputs). Prints p50 and p90 in microseconds per (size, client, mode).
Run it on a quiet host: it compares differences of a few microseconds.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from shmserve.shm.names import object_name
from shmserve.shm.response_cache import CacheStore
from shmserve.shm.segment import Segment, SegmentCache
from shmserve.tools.harness import ROOT, ServerProcess
from shmserve.workers.backend import Response
from shmserve.workers.response_cache import ResponseCache

CACHE_BYTES = 256 << 20  # the server's
MICRO_CACHE_BYTES = 32 << 20
# name -> ([(input name, dtype, shape)], [output names]); outputs mirror the inputs' shapes
CASES: dict[str, tuple[list[tuple[str, str, list[int]]], list[str]]] = {
    "add_sub": ([("INPUT0", "INT32", [16]), ("INPUT1", "INT32", [16])], ["OUTPUT0", "OUTPUT1"]),
    "1MiB": ([("INPUT0", "FP32", [262144])], ["OUTPUT0"]),
}


def micro(iterations: int) -> list[dict[str, Any]]:
    server_id = f"benchcache{os.getpid()}"
    store = CacheStore.create(server_id, MICRO_CACHE_BYTES)
    seg = Segment.create_anew(object_name(server_id, "inputs", 0), 8 << 20)
    segments = SegmentCache()
    rows = []
    try:
        for case, (inputs, outputs) in CASES.items():
            cache = ResponseCache(store, case, 1, 1, outputs, segments)
            entry, arrays, off = {"inputs": []}, [], 0
            for name, datatype, shape in inputs:
                arr = np.ndarray(shape, np.int32 if datatype == "INT32" else np.float32, seg.buf, off)
                arr[:] = 7
                arrays.append(arr)
                entry["inputs"].append({"name": name, "datatype": datatype, "shape": shape, "seg": seg.name,
                                        "off": off, "size": arr.nbytes})
                off += (arr.nbytes + 63) & ~63
            resp = Response(outputs={name: arrays[i % len(arrays)].copy() for i, name in enumerate(outputs)})
            times: dict[str, list[int]] = {"key": [], "lookup_miss": [], "insert": [], "lookup_hit": []}
            n = iterations if arrays[0].nbytes < 4096 else max(20, iterations // 50)
            filling = min(store.max_entries, store.capacity // (sum(a.nbytes for a in arrays) + 256)) + 10
            for i in range(-filling, n):
                arrays[0].reshape(-1)[0] = i  # a new request each time
                t0 = time.perf_counter_ns()
                key = cache.key(entry)
                t1 = time.perf_counter_ns()
                assert key is not None and cache.lookup(key) is None
                t2 = time.perf_counter_ns()
                entry["cache_key"] = key
                cache.insert(entry, resp)
                t3 = time.perf_counter_ns()
                hit = cache.lookup(key)
                t4 = time.perf_counter_ns()
                assert hit is not None
                if i >= 0:  # (before: filling the cache)
                    for name, ns in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                        times[name].append(ns)
            us = {name: statistics.median(values) / 1000 for name, values in times.items()}
            rows.append({"case": case, "requests": n, **{f"{k}_us": round(v, 2) for k, v in us.items()},
                         "miss_adds_us": round(us["key"] + us["lookup_miss"] + us["insert"], 2),
                         "hit_costs_us": round(us["key"] + us["lookup_hit"], 2)})
    finally:
        segments.clear()
        seg.close()
        seg.unlink()
        store.close()
        store.unlink()
    return rows


IDENTITY_PY = """import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(
            r, "INPUT0").as_numpy())]) for r in requests]
"""
IDENTITY_CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 262144 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 262144 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""


def _repository(folder: Path) -> None:
    """add_sub and identity, each also as ``<name>_cached`` with response_cache."""
    source = ROOT / "model_repository" / "add_sub"
    for cached in (False, True):
        suffix, extra = ("_cached", "response_cache { enable: true }\n") if cached else ("", "")
        add_sub = folder / f"add_sub{suffix}"
        shutil.copytree(source, add_sub, ignore=shutil.ignore_patterns("__pycache__"))
        config = (source / "config.pbtxt").read_text().replace('name: "add_sub"', f'name: "add_sub{suffix}"')
        (add_sub / "config.pbtxt").write_text(config + extra)
        identity = folder / f"identity{suffix}"
        (identity / "1").mkdir(parents=True)
        (identity / "1" / "model.py").write_text(IDENTITY_PY)
        (identity / "config.pbtxt").write_text(IDENTITY_CONFIG.format(name=f"identity{suffix}") + extra)


def _senders(server: ServerProcess) -> tuple[dict[str, Callable[[str, dict[str, np.ndarray]], Any]], Callable]:
    """(a sender per client kind, what closes them)."""
    import tritonclient.http as httpclient

    from shmserve import Client

    http = httpclient.InferenceServerClient(server.url, network_timeout=120.0)
    local = Client(server.id)

    def close() -> None:
        http.close()
        local.close()

    def over_http(model: str, arrays: dict[str, np.ndarray]) -> Any:
        inputs = []
        for name, arr in arrays.items():
            t = httpclient.InferInput(name, list(arr.shape), "INT32" if arr.dtype == np.int32 else "FP32")
            t.set_data_from_numpy(arr, binary_data=True)
            inputs.append(t)
        return http.infer(model, inputs)

    return {"http": over_http, "local": lambda model, arrays: local.infer(model, arrays)}, close


def server(requests: int, log: Path | None) -> list[dict[str, Any]]:
    folder = Path(tempfile.mkdtemp(prefix="bench_cache_"))
    rows = []
    try:
        _repository(folder)
        srv = ServerProcess([folder], f"--cache-config=local,size={CACHE_BYTES}", "--http-workers=1", log=log)
        senders, close = _senders(srv)
        try:
            for case, model in (("add_sub", "add_sub"), ("1MiB", "identity")):
                for client, send in senders.items():
                    latencies = _rounds(send, model, CASES[case][0], requests if case == "add_sub" else requests // 5)
                    for mode, values in latencies.items():
                        values.sort()
                        rows.append({"case": case, "client": client, "mode": mode, "requests": len(values),
                                     "p50_us": round(values[len(values) // 2] / 1000, 1),
                                     "p90_us": round(values[len(values) * 9 // 10] / 1000, 1)})
        finally:
            close()
            srv.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def _rounds(send: Callable, model: str, inputs: list[tuple[str, str, list[int]]], requests: int
            ) -> dict[str, list[int]]:
    """Requests per mode, the modes taking turns in rounds of 20 (the host drifts between rounds
    alike for all three)."""
    def arrays(seed: int) -> dict[str, np.ndarray]:
        out = {}
        for name, datatype, shape in inputs:
            arr = np.full(shape, 3, np.int32 if datatype == "INT32" else np.float32)
            arr.reshape(-1)[0] = seed
            out[name] = arr
        return out

    fixed = arrays(-1)
    send(f"{model}_cached", fixed)  # stored before the hits are timed
    counter = iter(range(1, 1 << 40))
    modes = {"none": lambda: send(model, arrays(next(counter))),
             "miss": lambda: send(f"{model}_cached", arrays(next(counter))),
             "hit": lambda: send(f"{model}_cached", fixed)}
    latencies: dict[str, list[int]] = {mode: [] for mode in modes}
    for call in modes.values():  # warm-up
        for _ in range(10):
            call()
    while len(latencies["hit"]) < requests:
        for mode, call in modes.items():
            for _ in range(20):
                start = time.perf_counter_ns()
                call()
                latencies[mode].append(time.perf_counter_ns() - start)
    return latencies


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shmserve.tools.bench_cache", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    m = sub.add_parser("micro", help="the cache module alone, per operation")
    m.add_argument("--iterations", type=int, default=5000, help="requests for add_sub (1 MiB: a fiftieth)")
    s = sub.add_parser("server", help="latency through a server of its own: no cache, miss, hit")
    s.add_argument("--requests", type=int, default=1000, help="timed requests per mode and client (1 MiB: a fifth)")
    s.add_argument("--log", type=Path, help="the server's output goes here")
    args = p.parse_args(argv)
    rows = micro(args.iterations) if args.what == "micro" else server(args.requests, args.log)
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
