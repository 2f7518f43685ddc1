import json
import os
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

GATE_LIMIT_S = 120.0  # a test that never opens its gate: go on, rather than block the instance for good


def hold(gate: str) -> None:
    """Mark this execution's start in the folder ``gate``, then wait until the test opens it
    (tests/gates.py): the test sees which steps ran at the same time."""
    Path(gate, f"started-{os.getpid()}-{time.monotonic_ns()}").touch()
    deadline = time.monotonic() + GATE_LIMIT_S
    while not os.path.exists(os.path.join(gate, "open")) and time.monotonic() < deadline:
        time.sleep(0.005)


class TritonPythonModel:
    """OUT = A + B, after 0.3 s (and after the gate named by the request parameter ``gate`` opens);
    SPAN = when the execution started and ended (CLOCK_MONOTONIC, the same clock in every process)."""

    def execute(self, requests):
        started = time.monotonic()
        for r in requests:
            gate = json.loads(r.parameters() or "{}").get("gate")
            if isinstance(gate, str) and os.path.isdir(gate):
                hold(gate)
        time.sleep(0.3)
        span = np.array([started, time.monotonic()], np.float64)
        return [pb_utils.InferenceResponse([
            pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "A").as_numpy()
                            + pb_utils.get_input_tensor_by_name(r, "B").as_numpy()),
            pb_utils.Tensor("SPAN", span)]) for r in requests]
