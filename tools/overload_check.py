"""Overload: twice the sustainable request rate for a minute; memory must stay flat, the excess
must be refused (503) rather than queued without bound, and service must recover at once.

    python -m shmserve.tools.overload_check [--seconds 60] [--factor 2]

Starts its own server on the bundled add_sub. Phase 1 measures the sustainable rate (closed loop,
32 connections, 10 s) and an idle p50 (1 connection). Phase 2 offers ``factor`` times that rate open
loop (requests sent on a schedule whatever the answers, on up to 2000 connections) and samples the
server's RSS every 5 s. Phase 3 measures the p50 of 1 connection right after. The client is plain
asyncio over raw sockets with one prebuilt binary-extension request, so it costs the server's
two cores as little as possible.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time
from typing import Any

from shmserve.tools.harness import ROOT, ServerProcess, rss_bytes


def request_bytes(port: int) -> bytes:
    import numpy as np

    data = np.arange(16, dtype=np.int32).tobytes()
    header = json.dumps({"inputs": [
        {"name": n, "datatype": "INT32", "shape": [16], "parameters": {"binary_data_size": len(data)}}
        for n in ("INPUT0", "INPUT1")], "outputs": [
        {"name": n, "parameters": {"binary_data": True}} for n in ("OUTPUT0", "OUTPUT1")]}).encode()
    body = header + data + data
    return (f"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/octet-stream\r\nInference-Header-Content-Length: {len(header)}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, req: bytes) -> int:
    writer.write(req)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    await reader.readexactly(length)
    return status


async def closed_loop(port: int, connections: int, seconds: float) -> tuple[int, list[float]]:
    req = request_bytes(port)
    latencies: list[float] = []
    done = 0
    end = time.monotonic() + seconds

    async def one() -> None:
        nonlocal done
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while time.monotonic() < end:
            started = time.perf_counter()
            if await exchange(reader, writer, req) == 200:
                done += 1
                latencies.append(time.perf_counter() - started)
        writer.close()

    await asyncio.gather(*(one() for _ in range(connections)))
    return done, latencies


async def open_loop(port: int, rate: float, seconds: float, max_connections: int) -> dict[str, Any]:
    req = request_bytes(port)
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    counts: dict[str, int] = {"200": 0, "503": 0, "other": 0, "errors": 0, "not_sent": 0}
    open_now = 0
    tasks: set[asyncio.Task] = set()

    async def send() -> None:
        nonlocal open_now
        if idle:
            conn = idle.pop()
        elif open_now < max_connections:
            open_now += 1
            try:
                conn = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                open_now -= 1
                counts["errors"] += 1
                return
        else:
            counts["not_sent"] += 1  # the client's own bound: every connection is waiting
            return
        try:
            status = await asyncio.wait_for(exchange(*conn, req), 30)
            counts["200" if status == 200 else "503" if status == 503 else "other"] += 1
            idle.append(conn)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            counts["errors"] += 1
            open_now -= 1
            conn[1].close()

    start = time.monotonic()
    n = 0
    while (now := time.monotonic()) - start < seconds:
        due = int((now - start) * rate)
        while n < due:
            n += 1
            task = asyncio.ensure_future(send())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.sleep(0.001)
    if tasks:
        await asyncio.wait(tasks, timeout=40)
    for _, writer in idle:
        writer.close()
    return counts


def _run_open_loop(port: int, rate: float, seconds: float, max_connections: int, out: Any) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    out.put(asyncio.run(open_loop(port, rate, seconds, max_connections)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--factor", type=float, default=2.0)
    p.add_argument("--processes", type=int, default=2, help="open-loop client processes")
    args = p.parse_args()
    server = ServerProcess([ROOT / "model_repository"], "--model-control-mode=explicit", "--load-model=add_sub",
                           server_id="overload")
    try:
        _, idle_lat = asyncio.run(closed_loop(server.port, 1, 3))
        done, _ = asyncio.run(closed_loop(server.port, 32, 10))
        sustainable = done / 10
        rss = [rss_bytes(server.tree())]
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        rate = sustainable * args.factor / args.processes
        procs = [ctx.Process(target=_run_open_loop, args=(server.port, rate, args.seconds, 2000 // args.processes,
                                                           out)) for _ in range(args.processes)]
        for proc in procs:
            proc.start()
        started = time.monotonic()
        while any(proc.is_alive() for proc in procs):
            time.sleep(0.5)
            if time.monotonic() - started >= 5 * len(rss):
                rss.append(rss_bytes(server.tree()))
        counts: dict[str, int] = {}
        for _ in procs:
            for k, v in out.get(timeout=60).items():
                counts[k] = counts.get(k, 0) + v
        for proc in procs:
            proc.join()
        rss.append(rss_bytes(server.tree()))
        _, after_lat = asyncio.run(closed_loop(server.port, 1, 3))
    finally:
        code = server.stop()
    offered = sustainable * args.factor * args.seconds
    mib = [r / 2**20 for r in rss]
    print(f"sustainable: {sustainable:.0f} req/s (closed loop, 32 connections); idle p50 "
          f"{statistics.median(idle_lat) * 1e6:.0f} us")
    print(f"offered {args.factor:g}x = {sustainable * args.factor:.0f} req/s for {args.seconds:.0f} s "
          f"({offered:.0f} requests): 200 {counts['200']}, 503 {counts['503']}, other {counts['other']}, "
          f"connection errors {counts['errors']}, not sent (client at 2000 connections) {counts['not_sent']}")
    print(f"served {counts['200'] / args.seconds:.0f} req/s under overload")
    print(f"server RSS (MiB) every 5 s: {' '.join(f'{m:.0f}' for m in mib)} (start {mib[0]:.0f}, "
          f"max {max(mib):.0f}, end {mib[-1]:.0f})")
    print(f"right after: p50 {statistics.median(after_lat) * 1e6:.0f} us "
          f"({statistics.median(after_lat) / statistics.median(idle_lat):.2f}x idle); server exit code {code}")
    return 0 if counts["other"] == 0 and code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
