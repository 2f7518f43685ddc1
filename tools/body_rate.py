"""How fast HTTP frontends take in large binary inference bodies, beside the floor.

    python -m shmserve.tools.body_rate [--frontends 1 2 4] [--clients 4] [--seconds 2] [--rounds 3]
                                       [--kb 600] [--model body_sink|add_sub] [--url HOST:PORT] [--json PATH]

Each request is a POST .../infer in Triton's binary tensor extension: a JSON header
(``Inference-Header-Content-Length``) and FP32[``kb``*250] behind it, 600 KB by default (a
ResNet-50 image batch's size); the model, ``body_sink``, answers one FP32 (the input's first
element), so the answer costs next to nothing and the figure is the body's way in. The request is
encoded once; ``--clients`` processes each send it over one keep-alive connection in a closed loop
(plain sockets: ``sendall``, read the answer), so the clients cost little beside the server.

Targets, measured in turns (A B C ..., then the reverse, ``--rounds`` times; an idle target costs
the others next to nothing), each for ``--seconds`` after a short warm-up:

- ``shmserve-N``: a shmserve of its own with ``--http-workers N`` for each N of ``--frontends``,
  on a temporary repository holding ``body_sink`` and ``add_sub``;
- ``floor-asgi``: a do-nothing ASGI app under uvicorn (uvloop, httptools, one process, as a
  frontend runs) that reads every body message and answers a constant;
- ``floor-starlette``: the same through a Starlette route that awaits ``request.body()``;
- ``--url``: servers already running (Triton, another build), in place of the shmservers;
  they must serve ``--model`` (``--repository DIR`` writes the repository this tool uses).

Per target and window: GB/s of bodies taken in, requests/s, and the CPU per request of the
server's process tree (``proc_cpu.py``: launcher, broker, workers and frontends) and of the
clients. ``memcpy`` is one core copying the same body between two buffers, the bound of any copy.
``--model add_sub`` sends add_sub's small binary request instead (two INT32[16]): the check that a
change for large bodies costs small requests nothing. Ranges are over the rounds.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shmserve.tools import proc_cpu
from shmserve.tools.harness import ROOT, ServerProcess, free_port

SINK_CONFIG = """name: "body_sink"
backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
SINK_PY = '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Answers the first element of its input: the body's cost, not the model's or the answer's."""

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()[:1])]) for r in requests]
'''
WARMUP_S = 0.5


def request_bytes(model: str, kb: int, host: str) -> bytes:
    """The whole HTTP request, encoded once: head, JSON header, tensor bytes."""
    if model == "add_sub":
        tensors = [("INPUT0", "INT32", np.arange(16, dtype=np.int32)), ("INPUT1", "INT32", np.ones(16, np.int32))]
        outputs = ["OUTPUT0", "OUTPUT1"]
    else:
        tensors = [("INPUT0", "FP32", np.random.default_rng(0).random(kb * 250, dtype=np.float32))]
        outputs = ["OUTPUT0"]
    doc = {"inputs": [{"name": n, "shape": list(a.shape), "datatype": d, "parameters": {"binary_data_size": a.nbytes}}
                      for n, d, a in tensors],
           "outputs": [{"name": n, "parameters": {"binary_data": True}} for n in outputs]}
    header = json.dumps(doc, separators=(",", ":")).encode()
    body = header + b"".join(a.tobytes() for _, _, a in tensors)
    head = (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: {len(header)}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    return head + body


def _read_answer(sock: socket.socket, buf: bytearray) -> bytes:
    """One answer's status line, its body read and dropped; ``buf`` keeps what came after it."""
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            break
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        buf += data
    lines = bytes(buf[:end]).split(b"\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in lines[1:] if line.lower().startswith(b"content-length:")),
                  0)
    total = end + 4 + length
    while len(buf) < total:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        buf += data
    status = lines[0]
    if b" 200 " not in status:
        raise RuntimeError(f"{status.decode()}: {bytes(buf[end + 4:total])[:300].decode(errors='replace')}")
    del buf[:total]
    return status


def _client(address: tuple[str, int], request: bytes, counter: Any, go: Any, stop: Any, errors: Any) -> None:
    """A closed loop on one keep-alive connection: send, read the answer, count it."""
    sock = socket.create_connection(address)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray()
    try:
        while not stop.is_set():
            go.wait()
            if stop.is_set():
                break
            sock.sendall(request)
            _read_answer(sock, buf)
            counter.value += 1
    except Exception as e:  # noqa: BLE001 - reported by the parent
        errors.put(str(e))
    finally:
        sock.close()


@dataclass
class Window:
    target: str
    seconds: float
    requests: int
    body_bytes: int
    server_cpu_us: float
    client_cpu_us: float

    def row(self) -> dict[str, Any]:
        n = max(self.requests, 1)
        return {"target": self.target, "requests": self.requests, "seconds": round(self.seconds, 3), "gb_s": round(self.requests * self.body_bytes / self.seconds / 1e9, 3),
                "rps": round(self.requests / self.seconds, 1), "server_cpu_us": round(self.server_cpu_us / n, 1),
                "client_cpu_us": round(self.client_cpu_us / n, 1)}


@dataclass
class Target:
    name: str
    address: tuple[str, int]
    stop: Any = None  # what ends it (ours only)
    windows: list[Window] = field(default_factory=list)


def measure(target: Target, request: bytes, body_bytes: int, clients: int, seconds: float) -> Window:
    """One window on ``target``: ``clients`` processes, ``WARMUP_S`` unmeasured, then ``seconds``."""
    ctx = mp.get_context("fork")
    go, stop, errors = ctx.Event(), ctx.Event(), ctx.Queue()
    counters = [ctx.Value("q", 0, lock=False) for _ in range(clients)]
    procs = [ctx.Process(target=_client, args=(target.address, request, c, go, stop, errors), daemon=True)
             for c in counters]
    for p in procs:
        p.start()
    tree = proc_cpu.server_tree(target.address[1])
    try:
        go.set()
        time.sleep(WARMUP_S)
        n0, s0, c0, t0 = (sum(c.value for c in counters), proc_cpu.usage(tree),
                          proc_cpu.usage([p.pid for p in procs]), time.monotonic())
        time.sleep(seconds)
        n1, s1, c1, t1 = (sum(c.value for c in counters), proc_cpu.usage(tree),
                          proc_cpu.usage([p.pid for p in procs]), time.monotonic())
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    if not errors.empty():
        raise RuntimeError(f"{target.name}: a client failed: {errors.get()}")
    return Window(target.name, t1 - t0, n1 - n0, body_bytes, (s1 - s0).cpu_us, (c1 - c0).cpu_us)


def memcpy_gb_s(nbytes: int, seconds: float = 0.5) -> float:
    """One core copying ``nbytes`` between two buffers, as often as it can for ``seconds``."""
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    n, end = 0, time.monotonic() + seconds
    start = time.monotonic()
    while time.monotonic() < end:
        for _ in range(20):
            np.copyto(dst, src)
        n += 20
    return n * nbytes / (time.monotonic() - start) / 1e9


# -- the floors: uvicorn as a frontend runs it, doing nothing with the body --------------------------
ANSWER = b'{"model_name":"body_sink","outputs":[]}'


async def _asgi_floor(scope: dict, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(ANSWER))]})
    await send({"type": "http.response.body", "body": ANSWER})


def _starlette_floor() -> Any:
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    async def infer(request: Any) -> Response:
        await request.body()
        return Response(ANSWER, media_type="application/json")

    return Starlette(routes=[Route("/v2/models/{model}/infer", infer, methods=["POST"])])


def serve_floor(kind: str, port: int) -> None:
    import uvicorn

    from shmserve.shm import heap

    heap.keep_large_buffers()  # as a frontend does: without it each body's pages are faulted in anew
    app = _asgi_floor if kind == "asgi" else _starlette_floor()
    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", access_log=False,
                log_level="warning", lifespan="off")


def _start_floor(kind: str) -> Target:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "shmserve.tools.body_rate", "--serve-floor", kind,
                             "--port", str(port)], cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        raise RuntimeError(f"the {kind} floor did not start")

    def stop() -> None:
        proc.terminate()
        proc.wait(10)

    return Target(f"floor-{kind}", ("127.0.0.1", port), stop)


def _repository(folder: Path) -> None:
    sink = folder / "body_sink"
    (sink / "1").mkdir(parents=True)
    (sink / "config.pbtxt").write_text(SINK_CONFIG)
    (sink / "1" / "model.py").write_text(SINK_PY)
    shutil.copytree(ROOT / "model_repository" / "add_sub", folder / "add_sub",
                    ignore=shutil.ignore_patterns("__pycache__"))


def _start_shmserve(folder: Path, frontends: int) -> Target:
    srv = ServerProcess([folder], f"--http-workers={frontends}", "--allow-grpc=false",
                        server_id=f"bodyrate{os.getpid()}_{frontends}")
    return Target(f"shmserve-{frontends}", ("127.0.0.1", srv.port), srv.stop)


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"


def summary(targets: list[Target]) -> list[dict[str, Any]]:
    """Ranges over the rounds, and each target's ratios to the first one's window of the same
    round (measured next to it: the host's drift weighs on both): median and range."""
    out = []
    for t in targets:
        rows = [w.row() for w in t.windows]
        rps = [a.requests / a.seconds / max(b.requests / b.seconds, 1e-9) for a, b in zip(t.windows, targets[0].windows)]
        cpu = [a.row()["server_cpu_us"] / max(b.row()["server_cpu_us"], 1e-9)
               for a, b in zip(t.windows, targets[0].windows)]
        out.append({"target": t.name, **{k: _span([r[k] for r in rows])
                                         for k in ("gb_s", "rps", "server_cpu_us", "client_cpu_us")},
                    "rps_ratio": _ratio(rps), "server_cpu_ratio": _ratio(cpu), "windows": rows})
    return out


def _ratio(values: list[float]) -> str:
    values = sorted(values)
    return f"{statistics.median(values):.2f} ({values[0]:.2f}-{values[-1]:.2f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frontends", type=int, nargs="*", default=[1], help="shmserve --http-workers values (default 1)")
    p.add_argument("--clients", type=int, default=4, help="client processes, one connection each (default 4)")
    p.add_argument("--seconds", type=float, default=2.0, help="measured seconds per window (default 2)")
    p.add_argument("--rounds", type=int, default=3, help="windows per target, in alternating order (default 3)")
    p.add_argument("--kb", type=int, default=600, help="tensor kilobytes per body (default 600)")
    p.add_argument("--model", choices=("body_sink", "add_sub"), default="body_sink")
    p.add_argument("--floors", nargs="*", choices=("asgi", "starlette"), default=["asgi", "starlette"],
                   help="do-nothing uvicorn apps measured beside (default both)")
    p.add_argument("--url", action="append", default=[],
                   help="a running server (HOST:PORT, repeatable) measured instead of starting shmservers")
    p.add_argument("--repository", type=Path, help="write body_sink and add_sub into this folder and exit")
    p.add_argument("--json", type=Path, help="write the figures here as JSON")
    p.add_argument("--serve-floor", choices=("asgi", "starlette"), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_floor:
        serve_floor(args.serve_floor, args.port)
        return 0
    if args.repository:
        _repository(args.repository)
        return 0
    folder = Path(tempfile.mkdtemp(prefix="body_rate_"))
    targets: list[Target] = []
    try:
        _repository(folder)
        for url in args.url:
            host, port = url.rsplit(":", 1)
            targets.append(Target(url, (host, int(port))))
        if not args.url:
            targets += [_start_shmserve(folder, n) for n in args.frontends]
        targets += [_start_floor(kind) for kind in args.floors]
        request = request_bytes(args.model, args.kb, "127.0.0.1")
        body_bytes = len(request) - request.index(b"\r\n\r\n") - 4
        for r in range(args.rounds):
            for t in (targets if r % 2 == 0 else targets[::-1]):
                w = measure(t, request, body_bytes, args.clients, args.seconds)
                t.windows.append(w)
                print(json.dumps(w.row()), flush=True)
        result = {"model": args.model, "body_bytes": body_bytes, "clients": args.clients, "seconds": args.seconds,
                  "cores": len(os.sched_getaffinity(0)), "memcpy_gb_s": round(memcpy_gb_s(body_bytes), 2),
                  "targets": summary(targets)}
    finally:
        for t in targets:
            if t.stop is not None:
                t.stop()
        shutil.rmtree(folder, ignore_errors=True)
    print(f"{args.model}: {body_bytes} bytes a body, {args.clients} clients, memcpy {result['memcpy_gb_s']} GB/s")
    print(f"{'target':<18} {'GB/s':>12} {'requests/s':>14} {'server CPU µs/req':>18} {'client CPU µs/req':>18} "
          f"{'rate vs first':>18} {'server CPU vs first':>20}")
    for s in result["targets"]:
        print(f"{s['target']:<18} {s['gb_s']:>12} {s['rps']:>14} {s['server_cpu_us']:>18} {s['client_cpu_us']:>18} "
              f"{s['rps_ratio']:>18} {s['server_cpu_ratio']:>20}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
