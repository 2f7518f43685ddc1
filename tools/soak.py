"""Soak: mixed load for a long while, with a reload every 30 s and a worker killed every 60 s.

    python -m shmserve.tools.soak [--seconds 600] [--reload-every 30] [--kill-every 60]

Starts its own server (poll mode) on a temporary copy of add_sub and running_sum and drives it
with HTTP clients (add_sub), a local shared-memory client (add_sub) and a sequence client
(running_sum over HTTP, checking every running sum). Meanwhile a new add_sub version is published
by atomic rename every ``--reload-every`` seconds and an add_sub worker is SIGKILLed every
``--kill-every`` seconds. Prints requests served and failed per kind (failures are expected only
for requests that were on a killed worker), p50/p99, the server's RSS at start and end, and the
shared-memory objects left after it stops (0 expected). Exit code 1 if anything unexpected failed.
"""
from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from shmserve.tools.harness import ROOT, ServerProcess, rss_bytes

KILLED = "killed by SIGKILL"


def _record(out: dict, started: float, error: str | None) -> None:
    if error is None:
        out["ok"] += 1
        out["lat"].append(time.perf_counter() - started)
    else:
        out["failed"][error[:160]] += 1


def http_add_sub(url: str, stop: Any, results: Any) -> None:
    import numpy as np
    import tritonclient.http as h

    out: dict = {"kind": "http add_sub", "ok": 0, "failed": collections.Counter(), "lat": []}
    client = h.InferenceServerClient(url, network_timeout=60)
    a = np.arange(16, dtype=np.int32)
    inputs = [h.InferInput("INPUT0", [16], "INT32"), h.InferInput("INPUT1", [16], "INT32")]
    for i in inputs:
        i.set_data_from_numpy(a)
    while not stop.is_set():
        started = time.perf_counter()
        try:
            r = client.infer("add_sub", inputs)
            _record(out, started, None if (r.as_numpy("OUTPUT0") == 2 * a).all() else "wrong answer")
        except Exception as e:  # noqa: BLE001 - every failure is counted by its message
            _record(out, started, str(e))
    results.put(out)


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
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="shmserve-soak-"))
    repo = work / "repo"
    for model in ("add_sub", "running_sum"):
        shutil.copytree(ROOT / "model_repository" / model, repo / model)
    server = ServerProcess([repo], "--model-control-mode=poll", server_id=f"soak{os.getpid()}", log=work / "server.log")
    ctx = mp.get_context("spawn")
    stop, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=http_add_sub, args=(server.url, stop, results)) for _ in range(args.http_clients)]
    procs += [ctx.Process(target=local_add_sub, args=(server.id, stop, results)),
              ctx.Process(target=sequences, args=(server.url, stop, results))]
    for proc in procs:
        proc.start()
    time.sleep(5)  # warm-up: every client connected, arenas touched
    rss_start = rss_bytes(server.tree())
    started = time.monotonic()
    next_reload, next_kill, version, reloads, kills = args.reload_every, args.kill_every, 1, 0, 0
    try:
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
        rss_end = rss_bytes(server.tree())
    finally:
        stop.set()
        reports = [results.get(timeout=120) for _ in procs]
        for proc in procs:
            proc.join(30)
        code = server.stop()
    left = server.shm_objects()
    unexpected = 0
    print(f"soak: {args.seconds:.0f} s, {reloads} reloads (atomic rename), {kills} worker kills, "
          f"server exit code {code}")
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
        print(f"  {kind:15s} served {k['ok']:7d}  failed on killed workers {on_killed:3d}  other failures "
              f"{sum(other.values())}  p50 {percentile(k['lat'], 0.5) * 1e3:.2f} ms  "
              f"p99 {percentile(k['lat'], 0.99) * 1e3:.2f} ms")
        for msg, n in other.items():
            print(f"      {n} x {msg}")
    print(f"  RSS of the server's processes: {rss_start / 2**20:.0f} MiB after warm-up, "
          f"{rss_end / 2**20:.0f} MiB at the end")
    print(f"  /dev/shm objects left after stop: {len(left)}")
    ok = unexpected == 0 and not left and code == 0
    if ok:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"  server log kept in {work / 'server.log'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
