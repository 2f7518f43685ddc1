"""Long-run memory, shortened: reloads, local clients that connect and leave, and killed workers
must leave every lasting process of the server (launcher, broker, frontends) where it was. The
full run (1,000 reloads, 1,000 clients, 200 kills) is ``python -m shmserve.tools.churn``
(docs/performance.md)."""
from __future__ import annotations

import os
import signal

import numpy as np
import tritonclient.http as httpclient

from conftest import cmdline, wait_until
from shmserve import Client
from shmserve.tools.churn import reload_config, write_model
from shmserve.tools.harness import lasting, rss_bytes

LIMIT = 10 << 20  # the bound for every process


def mapped_workers(pid: int) -> int:
    """How many workers' segments ``pid`` maps (the one live worker of the model: at most 1)."""
    with open(f"/proc/{pid}/maps") as f:
        return len({line.split()[5] for line in f if "/dev/shm/shmserve." in line and ".worker." in line})


def test_reloads_clients_and_kills_leave_each_process_where_it_was(server_factory, tmp_path):
    write_model(tmp_path)
    s = server_factory.start([tmp_path], ["--model-control-mode=explicit"])
    c = s.client()
    x = httpclient.InferInput("X", [4], "FP32")
    x.set_data_from_numpy(np.ones(4, np.float32))

    def reload(i: int) -> None:
        c.load_model("m", config=reload_config(i))
        for _ in range(3):
            np.testing.assert_array_equal(c.infer("m", [x]).as_numpy("Y"), np.ones(4, np.float32))

    def churn_clients(n: int) -> None:
        for _ in range(n):
            with Client(s.id) as local:
                assert local.infer("m", {"X": np.ones(4, np.float32)})["Y"].tolist() == [1.0] * 4

    for i in range(5):  # warm-up: every lasting process has built what it keeps
        reload(i)
    churn_clients(10)
    roles = lasting(s.pid)
    assert sorted(t.split()[1] for t in roles.values()) == ["broker", "frontend", "grpc", "launcher"], roles
    before = {p: rss_bytes([p]) for p in roles}
    for i in range(5, 45):
        reload(i)
    churn_clients(100)
    for _ in range(3):
        wait_until(lambda: len(s.worker_pids("m")) == 1, "the old version's worker gone", 60)
        [worker] = s.worker_pids("m")
        os.kill(worker, signal.SIGKILL)
        wait_until(lambda: s.worker_pids("m") not in ([], [worker]) and c.is_model_ready("m"), "a new worker", 60)
        reload(99)
    after = {p: rss_bytes([p]) for p in before}
    # No lasting process keeps a gone worker's segment mapped (a frontend kept every one, and at
    # its cache's bound of 256 dropped mappings still in use: the broker's, for control answers).
    wait_until(lambda: all(mapped_workers(p) <= 1 for p in before), "gone workers' segments unmapped", 30)
    grown = {f"{p} {cmdline(p)}": (after[p] - before[p]) >> 10 for p in before if after[p] - before[p] > LIMIT}
    assert grown == {}, f"KiB grown: {grown}"
