import json
import os
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils

GATE_LIMIT_S = 120.0  # a test that never opens its gate: go on, rather than hold the resource for good


class TritonPythonModel:
    """Shows when executions ran: each marks its start in the folder of the request parameter
    ``gate`` and waits until the test opens it (tests/gates.py), sleeps ``sleep_s``, and leaves
    ``run-<model>-<start ns>-<end ns>`` (CLOCK_MONOTONIC, shared by all processes) in the folder
    ``log``; the end is taken before the answers go, so an execution the rate limiter starts
    after this one's resources are back starts later. Y = X."""

    def initialize(self, args):
        self.name = args["model_name"]

    def execute(self, requests):
        params = [json.loads(r.parameters() or "{}") for r in requests]
        start = time.monotonic_ns()
        for gate in {p["gate"] for p in params if "gate" in p}:
            Path(gate, f"started-{os.getpid()}-{start}").touch()
            deadline = time.monotonic() + GATE_LIMIT_S
            while not Path(gate, "open").exists() and time.monotonic() < deadline:
                time.sleep(0.005)
        sleep = max(float(p.get("sleep_s", 0)) for p in params)
        if sleep:
            time.sleep(sleep)
        out = [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
               for r in requests]
        end = time.monotonic_ns()
        for log in {p["log"] for p in params if "log" in p}:
            Path(log, f"run-{self.name}-{start}-{end}").touch()
        return out
