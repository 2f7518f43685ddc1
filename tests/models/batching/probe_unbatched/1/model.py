import json
import os
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

GATE_LIMIT_S = 120.0  # a test that never opens its gate: go on, rather than block the instance for good


def hold(gate: str) -> None:
    """Mark this execution's start in the folder ``gate``, then wait until the test opens it
    (tests/gates.py): requests sent meanwhile queue behind this one, whatever the host's speed."""
    Path(gate, f"started-{os.getpid()}-{time.monotonic_ns()}").touch()
    deadline = time.monotonic() + GATE_LIMIT_S
    while not os.path.exists(os.path.join(gate, "open")) and time.monotonic() < deadline:
        time.sleep(0.005)


class TritonPythonModel:
    """Reports how each execute() call was batched: requests in it, their total batch size, and a
    running execution counter (to observe the order batches ran in). A request parameter
    ``sleep_s`` makes the execution last that long, ``gate`` holds it until the test opens it."""

    def initialize(self, args):
        self.executions = 0

    def execute(self, requests):
        self.executions += 1
        parameters = [json.loads(r.parameters() or "{}") for r in requests]
        for gate in {p["gate"] for p in parameters if isinstance(p.get("gate"), str) and os.path.isdir(p["gate"])}:
            hold(gate)
        sleep = max(float(p.get("sleep_s", 0)) for p in parameters)
        if sleep:
            time.sleep(sleep)
        sizes = [pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy().shape[0] for r in requests]
        out = []
        for r, n in zip(requests, sizes):
            shape = (n, 1)
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("REQS", np.full(shape, len(requests), np.int32)),
                pb_utils.Tensor("TOTAL", np.full(shape, sum(sizes), np.int32)),
                pb_utils.Tensor("ORDER", np.full(shape, self.executions, np.int64)),
            ]))
        return out
