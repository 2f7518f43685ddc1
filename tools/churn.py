"""Churn: many reloads, local clients that connect and leave, and killed workers, with the
memory of every lasting server process (launcher, broker, frontends) before and after.

    python -m shmserve.tools.churn [--reloads 1000] [--clients 1000] [--kills 200]

Starts its own server (explicit mode) with one small Python model. Each reload loads the model
with a changed config (a new version in new workers; the old one drains and stops) and sends it a
few requests over HTTP; the local clients each connect, infer once and close; every
``reloads / kills``-th reload first SIGKILLs the serving worker. Prints each lasting process's
RSS after a warm-up and at the end, and exits 1 if one grew by more than ``--limit-mb`` (10).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
from pathlib import Path

from shmserve.tools.harness import ServerProcess, lasting, report_growth, rss_bytes

MODEL_PY = """import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
                for r in requests]
"""
CONFIG = {"name": "m", "backend": "python", "max_batch_size": 0,
          "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [4]}],
          "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [4]}]}


def write_model(repo: Path) -> None:
    """The one small Python model ``m`` that reloads churn through."""
    (repo / "m" / "1").mkdir(parents=True)
    (repo / "m" / "1" / "model.py").write_text(MODEL_PY)
    (repo / "m" / "config.pbtxt").write_text('name: "m"\nbackend: "python"\n')


def reload_config(generation: int) -> str:
    """``m``'s config, changed by ``generation``: each load of it is a new version in new workers."""
    return json.dumps({**CONFIG, "parameters": {"generation": {"string_value": str(generation)}}})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reloads", type=int, default=1000)
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--kills", type=int, default=200)
    p.add_argument("--limit-mb", type=float, default=10.0)
    args = p.parse_args()

    import numpy as np
    import tritonclient.http as h

    from shmserve import Client

    repo = Path(tempfile.mkdtemp(prefix="shmserve-churn-"))
    write_model(repo)
    server = ServerProcess([repo], "--model-control-mode=explicit", server_id=f"churn{os.getpid()}",
                           log=repo / "server.log")
    client = h.InferenceServerClient(server.url, network_timeout=120)
    x = h.InferInput("X", [4], "FP32")
    x.set_data_from_numpy(np.ones(4, np.float32))
    ones = np.ones(4, np.float32)

    def reload(i: int) -> None:
        client.load_model("m", config=reload_config(i))
        for _ in range(3):
            assert client.infer("m", [x]).as_numpy("Y").tolist() == ones.tolist()

    def one_client() -> None:
        with Client(server.id) as local:
            assert local.infer("m", {"X": ones})["Y"].tolist() == ones.tolist()

    def kill_worker() -> None:
        deadline = time.monotonic() + 60
        while len(server.worker_pids("m")) != 1 and time.monotonic() < deadline:
            time.sleep(0.05)  # the last reload's old worker is still draining
        for pid in server.worker_pids("m"):
            os.kill(pid, signal.SIGKILL)

    try:
        for i in range(5):  # warm-up: every lasting process has built what it keeps
            reload(i)
        for _ in range(10):
            one_client()
        titles = lasting(server.proc.pid)  # captured now: after the stop the processes are gone
        before = {pid: rss_bytes([pid]) for pid in titles}
        started = time.monotonic()
        every = max(1, args.reloads // args.kills) if args.kills else 0
        kills = 0
        for i in range(args.reloads):
            if every and i % every == 0 and kills < args.kills:
                kill_worker()
                kills += 1
            reload(5 + i)
            for _ in range(args.clients // args.reloads + (i < args.clients % args.reloads)):
                one_client()
        took = time.monotonic() - started
        after = {pid: rss_bytes([pid]) for pid in before}
    finally:
        client.close()
        code = server.stop()
    print(f"churn: {args.reloads} reloads, {args.clients} local clients, {kills} worker kills in {took:.0f} s; "
          f"server exit code {code}, {len(server.shm_objects())} shared-memory objects left")
    grown = report_growth(titles, before, after, args.limit_mb)
    return 1 if grown or code != 0 else 0


if __name__ == "__main__":
    raise SystemExit(main())
