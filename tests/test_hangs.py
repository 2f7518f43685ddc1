"""Faults that are not deaths: a stopped process, a stalled stream (a model that never returns:
test_processes.py)."""
from __future__ import annotations

import os
import queue
import signal
import time

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import TEST_MODELS, pid_alive

OPEN_STREAM_CONFIG = '''name: "open_stream"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]
'''
OPEN_STREAM_MODEL = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.open = []  # senders it keeps and never finishes: a model that stopped mid-stream

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
            self.open.append(sender)
        return None
'''


def test_a_stream_left_open_at_unload_is_not_told_it_never_ran(server_factory, tmp_path):
    """A decoupled model stops mid-stream (a response sent, no final flag) and is unloaded: the
    stream ends with an error that says its model stopped before the final response, not that
    the request never ran with "retry", which would have the client run it, and get its
    responses, twice."""
    model = tmp_path / "repo" / "open_stream"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(OPEN_STREAM_CONFIG)
    (model / "1" / "model.py").write_text(OPEN_STREAM_MODEL)
    s = server_factory.start([tmp_path / "repo"], ["--model-control-mode", "explicit", "--load-model", "open_stream",
                                                   "--exit-timeout-secs", "5"])
    s.wait_grpc_ready()
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(s.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        x = grpcclient.InferInput("X", [1], "INT32")
        x.set_data_from_numpy(np.array([7], np.int32))
        client.async_stream_infer("open_stream", [x])
        result, error = got.get(timeout=60)
        assert error is None and result.as_numpy("Y").tolist() == [7]
        httpclient.InferenceServerClient(s.url, network_timeout=120).unload_model("open_stream")
        result, error = got.get(timeout=60)
        assert error is not None, "a second response came"
        assert "before the request ran" not in str(error) and "retry" not in str(error), str(error)
        assert "stopped before its model sent the request's final response" in str(error), str(error)
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def test_a_stopped_frontend_does_not_hold_the_server_past_its_exit_timeout(server_factory):
    """SIGSTOP of the HTTP frontend (or one stuck in a send), then SIGTERM: the launcher waits
    for its frontends only for what is left of --exit-timeout-secs (at least 2 s), then kills
    them; it waited the flag plus 15 s for each."""
    s = server_factory.start([TEST_MODELS], ["--exit-timeout-secs", "1"])
    frontend = next(p for p, t in s.titles().items() if t.startswith("shmserve frontend "))
    os.kill(frontend, signal.SIGSTOP)
    start = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait_exit(60) == 0, s.log_tail()
    took = time.monotonic() - start
    assert took < 1 + 2 + 4, f"the server took {took:.1f} s to stop with --exit-timeout-secs 1\n{s.log_tail()}"
    assert not pid_alive(frontend), "the stopped frontend outlived its server"
    assert "did not stop within --exit-timeout-secs; killing it" in s.log()
