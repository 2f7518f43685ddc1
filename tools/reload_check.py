"""Lifecycle figures under load: how fast a version dropped into a watched repository serves,
and how many requests fail across version swaps and a failed load (the target: none).

    python -m shmserve.tools.reload_check [--swaps 20] [--clients 4]

Starts its own server (poll mode, then explicit mode) on a temporary copy of add_sub, drives it
with client processes over HTTP, prints the figures and stops everything it started.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ADD_SUB = ROOT / "model_repository" / "add_sub"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client_loop(url: str, stop: "mp.synchronize.Event", counts: "mp.Array") -> None:  # type: ignore[name-defined]
    import numpy as np
    import tritonclient.http as h

    c = h.InferenceServerClient(url)
    a = np.arange(16, dtype=np.int32)
    ins = [h.InferInput("INPUT0", [16], "INT32"), h.InferInput("INPUT1", [16], "INT32")]
    for i in ins:
        i.set_data_from_numpy(a)
    while not stop.is_set():
        try:
            c.infer("add_sub", ins)
            with counts.get_lock():
                counts[0] += 1
        except Exception:  # noqa: BLE001 - counted
            with counts.get_lock():
                counts[1] += 1


class Server:
    def __init__(self, repo: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "shmserve", f"--model-repository={repo}",
                                      f"--http-port={self.port}", f"--metrics-port={free_port()}",
                                      f"--id=reload{os.getpid()}", *flags],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        import tritonclient.http as h

        self.client = h.InferenceServerClient(self.url)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if self.client.is_server_ready():
                    return
            except Exception:  # noqa: BLE001
                pass
            time.sleep(0.05)
        raise RuntimeError("server did not become ready")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def under_load(url: str, clients: int):  # noqa: ANN201
    ctx = mp.get_context("spawn")
    stop, counts = ctx.Event(), ctx.Array("l", 2)
    procs = [ctx.Process(target=client_loop, args=(url, stop, counts)) for _ in range(clients)]
    for p in procs:
        p.start()
    return stop, counts, procs


def finish(stop, counts, procs) -> tuple[int, int]:  # noqa: ANN001
    stop.set()
    for p in procs:
        p.join(30)
    return counts[0], counts[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--swaps", type=int, default=20)
    p.add_argument("--clients", type=int, default=4)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="reload_check-"))
    repo = tmp / "repo"
    shutil.copytree(ADD_SUB, repo / "add_sub")
    try:
        # 1. Poll mode: a new version by atomic rename, under load.
        s = Server(repo, "--model-control-mode=poll")
        load = under_load(s.url, args.clients)
        time.sleep(1.0)
        shutil.copytree(repo / "add_sub" / "1", repo / ".staging")
        started = time.monotonic()
        os.rename(repo / ".staging", repo / "add_sub" / "2")
        while s.client.get_model_metadata("add_sub")["versions"] != ["2"]:
            time.sleep(0.005)
        took = time.monotonic() - started
        time.sleep(0.5)
        ok, failed = finish(*load)
        s.stop()
        print(f"new version by atomic rename serves after {took:.2f} s; requests {ok}, failed {failed}")
        # 2. Explicit mode: swaps and a failed load, under load.
        s = Server(repo, "--model-control-mode=explicit", "--load-model=add_sub")
        cfg = json.loads(json.dumps(s.client.get_model_config("add_sub")))
        load = under_load(s.url, args.clients)
        time.sleep(1.0)
        started = time.monotonic()
        for i in range(args.swaps):
            cfg["instance_group"][0]["count"] = 1 + i % 2
            s.client.load_model("add_sub", config=json.dumps(cfg))
        swaps_s = time.monotonic() - started
        bad = dict(cfg, backend="no_such_backend")
        try:
            s.client.load_model("add_sub", config=json.dumps(bad))
        except Exception:  # noqa: BLE001 - expected: the load fails, the old version serves
            pass
        time.sleep(0.5)
        ok, failed = finish(*load)
        s.stop()
        print(f"{args.swaps} version swaps ({swaps_s:.1f} s) and one failed load under {args.clients} clients: "
              f"requests {ok}, failed {failed}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
