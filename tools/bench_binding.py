"""The README's function-serving example against LitServe serving the same function with the same
batching (max batch 64, 1 ms delay, 2 workers), one after the other in alternating rounds, from
the same client processes: closed-loop JSON requests over keep-alive HTTP connections, one
FP32[16] each. LitServe is not a dependency of shmserve: give the interpreter of an environment
where it is installed (``python -m venv v && v/bin/pip install litserve numpy``)::

    python -m shmserve.tools.bench_binding --litserve-python v/bin/python --clients 8 --seconds 8
"""
from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .harness import free_port

SHMSERVE_APP = '''import numpy as np
import shmserve

@shmserve.model(inputs={{"x": (np.float32, [-1])}}, outputs={{"y": (np.float32, [-1])}},
                max_batch_size=64, max_queue_delay_us=1000, instances=2)
def scale(x):
    return {{"y": x * 2.0}}

if __name__ == "__main__":
    shmserve.serve(http_port={port}, http_address="127.0.0.1", allow_grpc=False, allow_metrics=False,
                   id="benchbind{port}")
'''

LITSERVE_APP = '''import numpy as np
import litserve as ls

class Scale(ls.LitAPI):
    def setup(self, device):
        pass

    def decode_request(self, request):
        return np.asarray(request["x"], dtype=np.float32)

    def batch(self, inputs):
        return np.stack(inputs)

    def predict(self, x):
        return x * 2.0

    def unbatch(self, output):
        return list(output)

    def encode_response(self, output):
        return {{"y": output.tolist()}}

if __name__ == "__main__":
    server = ls.LitServer(Scale(max_batch_size=64, batch_timeout=0.001), accelerator="cpu", workers_per_device=2)
    server.run(port={port}, generate_client_file=False)
'''


def _request(kind: str) -> tuple[str, bytes]:
    values = [float(i) for i in range(16)]
    if kind == "shmserve":
        body = {"inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": values}]}
        return "/v2/models/scale/infer", json.dumps(body).encode()
    return "/predict", json.dumps({"x": values}).encode()


def _client(port: int, kind: str, seconds: float, out: Any) -> None:
    path, body = _request(kind)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Content-Type": "application/json"}
    latencies, errors = [], 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        conn.request("POST", path, body, headers)
        response = conn.getresponse()
        data = response.read()
        if response.status != 200 or b"y" not in data:
            errors += 1
        latencies.append(time.perf_counter() - t)
    conn.close()
    out.put((latencies, errors))


def measure(port: int, kind: str, clients: int, seconds: float) -> dict[str, Any]:
    out: Any = mp.Queue()
    procs = [mp.Process(target=_client, args=(port, kind, seconds, out)) for _ in range(clients)]
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    latencies = sorted(x for r in results for x in r[0])
    return {"server": kind, "requests": len(latencies), "rps": len(latencies) / seconds,
            "p50_us": statistics.median(latencies) * 1e6, "errors": sum(r[1] for r in results)}


def _start(python: str, text: str, folder: Path, port: int, name: str) -> subprocess.Popen:
    script = folder / f"app_{name}.py"  # not the package's own name, which it would shadow
    script.write_text(text.format(port=port))
    proc = subprocess.Popen([python, str(script)], cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    path, body = _request(name)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError(f"{name} did not answer within 180 s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--litserve-python", required=True, help="a Python interpreter with litserve and numpy installed")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (shmserve, LitServe, ...)")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        ports = {"shmserve": free_port(), "litserve": free_port()}
        servers = {"shmserve": _start(sys.executable, SHMSERVE_APP, folder, ports["shmserve"], "shmserve"),
                   "litserve": _start(args.litserve_python, LITSERVE_APP, folder, ports["litserve"], "litserve")}
        try:
            for _ in range(args.rounds):
                for kind in ("shmserve", "litserve"):
                    row = measure(ports[kind], kind, args.clients, args.seconds)
                    rows.append(row)
                    print(f"{kind:9s} {row['rps']:8.0f} req/s  p50 {row['p50_us']:8.0f} us  errors {row['errors']}",
                          flush=True)
        finally:
            for proc in servers.values():
                os.killpg(proc.pid, signal.SIGTERM)
            for proc in servers.values():
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
    for kind in ("shmserve", "litserve"):
        mine = [r for r in rows if r["server"] == kind]
        print(f"{kind}: median {statistics.median(r['rps'] for r in mine):.0f} req/s, "
              f"p50 {statistics.median(r['p50_us'] for r in mine):.0f} us")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
