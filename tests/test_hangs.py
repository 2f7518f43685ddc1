"""Faults that are not deaths: a model that never returns, a stopped process, a stalled stream."""
from __future__ import annotations

import signal
import time

import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import pid_alive
from test_processes import STUCK_CONFIG, STUCK_MODEL


def _stuck_repo(tmp_path):
    (tmp_path / "repo" / "stuck" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "stuck" / "config.pbtxt").write_text(STUCK_CONFIG)
    (tmp_path / "repo" / "stuck" / "1" / "model.py").write_text(STUCK_MODEL)
    return tmp_path / "repo"


def test_a_server_with_a_stuck_model_exits_within_its_exit_timeout(server_factory, tmp_path):
    """SIGTERM while a model is stuck in execute(): as Triton, the whole stop takes about
    --exit-timeout-secs (the stuck worker killed at its end), not that plus a grace of its own
    (it was 5 s more), so a supervisor's kill timer set just past the flag is not reached."""
    s = server_factory.start([_stuck_repo(tmp_path)], ["--exit-timeout-secs", "2"])
    worker = s.worker_pids("stuck")[0]
    x = httpclient.InferInput("X", [1], "INT32")
    x.set_data_from_numpy(np.array([1], dtype=np.int32))
    client = httpclient.InferenceServerClient(s.url, network_timeout=120)
    mark = tmp_path / "executing"
    sent = client.async_infer("stuck", [x], parameters={"mark": str(mark)})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not mark.exists():
        time.sleep(0.02)
    assert mark.exists(), "the request did not reach execute()"
    start = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait_exit(60) == 0, s.log_tail()
    took = time.monotonic() - start
    assert took < 2 + 3.5, f"the server took {took:.1f} s to stop with --exit-timeout-secs 2\n{s.log_tail()}"
    assert not pid_alive(worker), "the stuck worker outlived its server"
    with pytest.raises(Exception):  # its connection ended, or a 503 naming the server that went away
        sent.get_result()
    client.close()
