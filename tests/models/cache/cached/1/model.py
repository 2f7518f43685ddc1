import json
import os
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils

GATE_LIMIT_S = 120.0  # a test that never opens its gate: go on, rather than block the instance for good


def hold(gate: str) -> None:
    """Mark this execution's start in the folder ``gate``, then wait until the test opens it
    (tests/gates.py)."""
    Path(gate, f"started-{os.getpid()}-{time.monotonic_ns()}").touch()
    deadline = time.monotonic() + GATE_LIMIT_S
    while not os.path.exists(os.path.join(gate, "open")) and time.monotonic() < deadline:
        time.sleep(0.005)


class TritonPythonModel:
    """Y = 2 X and Z = X + 1, with the response parameter ``pid`` naming the process that ran it
    (a cached answer keeps it). The request parameter ``gate`` holds the execution until the test
    opens it. Executions are counted by the statistics extension. The request parameter ``fail``
    makes it answer an error response, and ``omit_z`` leaves Z out of the response."""

    def execute(self, requests):
        for r in requests:
            gate = json.loads(r.parameters() or "{}").get("gate")
            if isinstance(gate, str) and os.path.isdir(gate):
                hold(gate)
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            if json.loads(r.parameters() or "{}").get("fail"):  # an error response (never stored)
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("asked to fail")))
                continue
            made = [pb_utils.Tensor("Y", x * 2), pb_utils.Tensor("Z", x + 1)]
            if json.loads(r.parameters() or "{}").get("omit_z"):  # Z left out, though requested
                made = made[:1]
            out.append(pb_utils.InferenceResponse(made, parameters={"pid": os.getpid()}))
        return out
