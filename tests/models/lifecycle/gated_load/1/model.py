"""add_sub whose load waits at a gate (tests/gates.py) named by the config parameter ``gate``:
a test holds a load in progress while it changes the repository."""
import json
import os
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils

GATE_LIMIT_S = 120.0  # a test that never opens its gate: go on, rather than hold the load for good


class TritonPythonModel:
    def initialize(self, args):
        gate = json.loads(args["model_config"])["parameters"]["gate"]["string_value"]
        Path(gate, f"started-{os.getpid()}-{time.monotonic_ns()}").touch()
        deadline = time.monotonic() + GATE_LIMIT_S
        while not os.path.exists(os.path.join(gate, "open")) and time.monotonic() < deadline:
            time.sleep(0.01)

    def execute(self, requests):
        out = []
        for r in requests:
            a = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(r, "INPUT1").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)]))
        return out
