"""Soak: mixed load for a long while, with a reload every 30 s and a worker killed every 60 s.

    python -m shmserve.tools.soak [--seconds 600] [--reload-every 30] [--kill-every 60] [--limit-mb 20]

Starts its own server (poll mode) on a temporary copy of add_sub, add_sub_bls, running_sum and
word_stream and drives it with every kind of client at once: HTTP (add_sub), gRPC (add_sub),
a gRPC stream (word_stream, checking every word), a local shared-memory client (add_sub), a
client that registers a system shared-memory region, infers through it and unregisters it each
round, a BLS model (add_sub_bls, which calls add_sub) and a sequence client (running_sum over
HTTP, checking every running sum). Meanwhile a new add_sub version is published by atomic rename
every ``--reload-every`` seconds and an add_sub worker is SIGKILLed every ``--kill-every``
seconds. Prints requests served and failed per kind (failures are expected only for requests
that were on a killed worker), p50/p99, each lasting server process's RSS after the warm-up and
at the end, and the shared-memory objects left after it stops. Exit code 1 if anything
unexpected failed, a lasting process grew by more than ``--limit-mb``, or anything was left.
"""
from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import queue
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from shmserve.tools.harness import ROOT, ServerProcess, free_port, lasting, report_growth, rss_bytes

KILLED = "killed by SIGKILL"


def _record(out: dict, started: float, error: str | None) -> None:
    if error is None:
        out["ok"] += 1
        out["lat"].append(time.perf_counter() - started)
    else:
        short = error[:160]
        if KILLED in error and KILLED not in short:  # still counted as a killed worker's
            short = f"{error[:120]} ... {KILLED}"
        out["failed"][short] += 1


def _add_sub_inputs(module: Any) -> tuple[Any, list[Any]]:
    """add_sub's two inputs for a tritonclient module (HTTP or gRPC), both ``arange(16)``."""
    import numpy as np

    a = np.arange(16, dtype=np.int32)
    inputs = [module.InferInput("INPUT0", [16], "INT32"), module.InferInput("INPUT1", [16], "INT32")]
    for i in inputs:
        i.set_data_from_numpy(a)
    return a, inputs


def _http_loop(kind: str, model: str, right: Any, url: str, stop: Any, results: Any) -> None:
    """One HTTP client calling ``model`` with add_sub's inputs until ``stop``; ``right(result, a)``
    says whether an answer is right."""
    import tritonclient.http as h

    out: dict = {"kind": kind, "ok": 0, "failed": collections.Counter(), "lat": []}
    client = h.InferenceServerClient(url, network_timeout=60)
    a, inputs = _add_sub_inputs(h)
    while not stop.is_set():
        started = time.perf_counter()
        try:
            r = client.infer(model, inputs)
            _record(out, started, None if right(r, a) else "wrong answer")
        except Exception as e:  # noqa: BLE001 - every failure is counted by its message
            _record(out, started, str(e))
    results.put(out)


def http_add_sub(url: str, stop: Any, results: Any) -> None:
    _http_loop("http add_sub", "add_sub", lambda r, a: (r.as_numpy("OUTPUT0") == 2 * a).all(), url, stop, results)


def local_add_sub(server_id: str, stop: Any, results: Any) -> None:
    import numpy as np

    from shmserve.shm.client import Client

    out: dict = {"kind": "local add_sub", "ok": 0, "failed": collections.Counter(), "lat": []}
    a = np.arange(16, dtype=np.int32)
    with Client(server_id) as client:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                r = client.infer("add_sub", {"INPUT0": a, "INPUT1": a})
                _record(out, started, None if (r["OUTPUT1"] == 0).all() else "wrong answer")
            except Exception as e:  # noqa: BLE001
                _record(out, started, str(e))
    results.put(out)


def grpc_add_sub(grpc_url: str, stop: Any, results: Any) -> None:
    import tritonclient.grpc as g

    out: dict = {"kind": "grpc add_sub", "ok": 0, "failed": collections.Counter(), "lat": []}
    client = g.InferenceServerClient(grpc_url)
    a, inputs = _add_sub_inputs(g)
    while not stop.is_set():
        started = time.perf_counter()
        try:
            r = client.infer("add_sub", inputs, client_timeout=60)
            _record(out, started, None if (r.as_numpy("OUTPUT0") == 2 * a).all() else "wrong answer")
        except Exception as e:  # noqa: BLE001
            _record(out, started, str(e))
    client.close()
    results.put(out)


def grpc_stream(grpc_url: str, stop: Any, results: Any) -> None:
    """word_stream (decoupled) on one long-lived gRPC stream: every word, in order, then the final."""
    import queue

    import numpy as np
    import tritonclient.grpc as g

    out: dict = {"kind": "grpc stream", "ok": 0, "failed": collections.Counter(), "lat": []}
    words = [f"w{i}" for i in range(8)]
    text = g.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([" ".join(words).encode()], dtype=object))
    client = g.InferenceServerClient(grpc_url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    n = 0
    while not stop.is_set():
        n += 1
        started = time.perf_counter()
        got: list[str] = []
        error = None
        client.async_stream_infer("word_stream", [text], request_id=str(n), enable_empty_final_response=True)
        try:
            while True:
                result, failure = answers.get(timeout=60)
                if failure is not None:
                    error = str(failure)
                    break
                response = result.get_response()
                if response.id != str(n):
                    error = f"an answer of request {response.id!r} on request {n}'s turn"
                    break
                if response.parameters["triton_final_response"].bool_param:
                    break
                got.append(result.as_numpy("text_output").reshape(-1)[0].decode())
        except queue.Empty:
            error = "no final response within 60 s"
        if error is None and got != words:
            error = f"words {got} != {words}"
        _record(out, started, error)
        if error is not None:  # the stream's state is unknown: start a new one
            client.stop_stream()
            answers = queue.Queue()
            client.start_stream(callback=lambda result, error: answers.put((result, error)))
    client.stop_stream()
    client.close()
    results.put(out)


def shm_regions(url: str, stop: Any, results: Any) -> None:
    """Each round: a system shared-memory region made, registered, inferred through (inputs and
    outputs), unregistered and removed, so registrations churn as a client's would."""
    import numpy as np
    import tritonclient.http as h
    import tritonclient.utils.shared_memory as shm

    out: dict = {"kind": "http shm region", "ok": 0, "failed": collections.Counter(), "lat": []}
    client = h.InferenceServerClient(url, network_timeout=60)
    a = np.arange(16, dtype=np.int32)
    size = a.nbytes
    name, key = f"soak_{os.getpid()}", f"/soak_{os.getpid()}"
    while not stop.is_set():
        started = time.perf_counter()
        handle = shm.create_shared_memory_region(name, key, 4 * size)
        try:
            shm.set_shared_memory_region(handle, [a, a])
            client.register_system_shared_memory(name, key, 4 * size)
            inputs = [h.InferInput("INPUT0", [16], "INT32"), h.InferInput("INPUT1", [16], "INT32")]
            inputs[0].set_shared_memory(name, size, 0)
            inputs[1].set_shared_memory(name, size, size)
            outputs = [h.InferRequestedOutput("OUTPUT0", binary_data=True)]
            outputs[0].set_shared_memory(name, size, 2 * size)
            client.infer("add_sub", inputs, outputs=outputs)
            got = shm.get_contents_as_numpy(handle, np.int32, [16], offset=2 * size)
            _record(out, started, None if (got == 2 * a).all() else "wrong answer")
        except Exception as e:  # noqa: BLE001
            _record(out, started, str(e))
        finally:
            try:
                client.unregister_system_shared_memory(name)
            except Exception as e:  # noqa: BLE001
                out["failed"][f"unregister: {e}"[:160]] += 1
            shm.destroy_shared_memory_region(handle)
    results.put(out)


def bls(url: str, stop: Any, results: Any) -> None:
    """add_sub_bls, whose execute() calls add_sub: (a + b) * (a - b) is 0 for equal inputs."""
    _http_loop("http bls", "add_sub_bls", lambda r, a: (r.as_numpy("OUTPUT0") == 0).all(), url, stop, results)


def sequences(url: str, stop: Any, results: Any) -> None:
    import numpy as np
    import tritonclient.http as h

    out: dict = {"kind": "http sequences", "ok": 0, "failed": collections.Counter(), "lat": []}
    client = h.InferenceServerClient(url, network_timeout=60)
    seq = 1000 + os.getpid() * 1000
    while not stop.is_set():
        seq += 1
        total = 0.0
        for step in range(5):
            value = float(step + 1)
            total += value
            x = h.InferInput("VALUE", [1, 1], "FP32")
            x.set_data_from_numpy(np.array([[value]], dtype=np.float32))
            started = time.perf_counter()
            try:
                r = client.infer("running_sum", [x], sequence_id=seq, sequence_start=step == 0,
                                 sequence_end=step == 4)
                got = float(r.as_numpy("SUM").reshape(-1)[0])
                _record(out, started, None if got == total else f"wrong running sum {got} != {total}")
            except Exception as e:  # noqa: BLE001
                _record(out, started, str(e))
                break  # the sequence is broken; start a new one
    results.put(out)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--reload-every", type=float, default=30)
    p.add_argument("--kill-every", type=float, default=60)
    p.add_argument("--http-clients", type=int, default=2)
    p.add_argument("--limit-mb", type=float, default=20.0,
                   help="the most a lasting process's RSS may grow after the warm-up (MiB)")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="shmserve-soak-"))
    repo = work / "repo"
    for model in ("add_sub", "add_sub_bls", "running_sum", "word_stream"):
        shutil.copytree(ROOT / "model_repository" / model, repo / model)
    grpc_url = f"127.0.0.1:{free_port()}"
    server = ServerProcess([repo], "--model-control-mode=poll", f"--grpc-port={grpc_url.rsplit(':', 1)[1]}",
                           server_id=f"soak{os.getpid()}", log=work / "server.log")
    ctx = mp.get_context("spawn")
    stop, results = ctx.Event(), ctx.Queue()
    clients = [(http_add_sub, server.url)] * args.http_clients + [
        (grpc_add_sub, grpc_url), (grpc_stream, grpc_url), (local_add_sub, server.id),
        (shm_regions, server.url), (bls, server.url), (sequences, server.url)]
    procs = [ctx.Process(target=target, args=(where, stop, results)) for target, where in clients]
    reports: list[dict] = []
    reloads = kills = 0
    try:  # whatever happens here, the clients and the server are stopped
        for proc in procs:
            proc.start()
        time.sleep(10)  # warm-up: every client connected, arenas touched
        titles = lasting(server.proc.pid)  # captured now: after the stop the processes are gone
        rss_start = {pid: rss_bytes([pid]) for pid in titles}
        started = time.monotonic()
        next_reload, next_kill, version = args.reload_every, args.kill_every, 1
        while (elapsed := time.monotonic() - started) < args.seconds:
            if elapsed >= next_reload:
                next_reload += args.reload_every
                staging = repo / "add_sub" / ".staging"
                shutil.copytree(repo / "add_sub" / "1", staging)
                version += 1
                os.rename(staging, repo / "add_sub" / str(version))  # atomic publish
                reloads += 1
            if elapsed >= next_kill:
                next_kill += args.kill_every
                victims = server.worker_pids("add_sub")
                if victims:
                    os.kill(max(victims), signal.SIGKILL)
                    kills += 1
            time.sleep(0.1)
        rss_end = {pid: rss_bytes([pid]) for pid in titles}
    finally:
        stop.set()
        try:
            for _ in procs:  # (a client that died sends none: counted as a failure below)
                reports.append(results.get(timeout=120))
        except queue.Empty:
            pass
        finally:
            for proc in procs:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
            code = server.stop()
    left = server.shm_objects()
    unexpected = len(procs) - len(reports)
    print(f"soak: {args.seconds:.0f} s, {reloads} reloads (atomic rename), {kills} worker kills, "
          f"server exit code {code}")
    if unexpected:
        print(f"  {unexpected} client process(es) ended without a report")
    kinds: dict[str, dict] = {}
    for r in reports:
        k = kinds.setdefault(r["kind"], {"ok": 0, "failed": collections.Counter(), "lat": []})
        k["ok"] += r["ok"]
        k["failed"].update(r["failed"])
        k["lat"] += r["lat"]
    for kind, k in kinds.items():
        on_killed = sum(n for msg, n in k["failed"].items() if KILLED in msg)
        other = {msg: n for msg, n in k["failed"].items() if KILLED not in msg}
        unexpected += sum(other.values())
        print(f"  {kind:16s} served {k['ok']:7d}  failed on killed workers {on_killed:3d}  other failures "
              f"{sum(other.values())}  p50 {percentile(k['lat'], 0.5) * 1e3:.2f} ms  "
              f"p99 {percentile(k['lat'], 0.99) * 1e3:.2f} ms")
        for msg, n in other.items():
            print(f"      {n} x {msg}")
    grown = report_growth(titles, rss_start, rss_end, args.limit_mb)
    print(f"  /dev/shm objects left after stop: {len(left)}")
    ok = unexpected == 0 and not grown and not left and code == 0
    if ok:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"  server log kept in {work / 'server.log'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
