import json
import os
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

SLEEP_S = 0.3
GATE_LIMIT_S = 120.0  # a test that never opens its gate: go on, rather than block the instance for good


def hold(gate: str) -> None:
    """Mark this execution's start in the folder ``gate``, then wait until the test opens it
    (tests/gates.py): the test sees which executions ran at the same time."""
    Path(gate, f"started-{os.getpid()}-{time.monotonic_ns()}").touch()
    deadline = time.monotonic() + GATE_LIMIT_S
    while not os.path.exists(os.path.join(gate, "open")) and time.monotonic() < deadline:
        time.sleep(0.005)


class TritonPythonModel:
    def initialize(self, args):
        self.instance_name = args["model_instance_name"]

    def execute(self, requests):
        responses = []
        for request in requests:
            gate = json.loads(request.parameters() or "{}").get("gate")
            if isinstance(gate, str) and os.path.isdir(gate):
                hold(gate)
            time.sleep(SLEEP_S)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("INSTANCE", np.array([self.instance_name.encode()], dtype=np.object_)),
                pb_utils.Tensor("PID", np.array([os.getpid()], dtype=np.int64)),
            ]))
        return responses
