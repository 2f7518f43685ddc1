import json
import os
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

GATE_LIMIT_S = 120.0  # a test that never opens its gate: go on, rather than block the instance for good


def hold(gate: str) -> None:
    """Mark this execution's start in the folder ``gate``, then wait until the test opens it
    (tests/gates.py): steps of other sequences sent meanwhile queue behind this one."""
    Path(gate, f"started-{os.getpid()}-{time.monotonic_ns()}").touch()
    deadline = time.monotonic() + GATE_LIMIT_S
    while not os.path.exists(os.path.join(gate, "open")) and time.monotonic() < deadline:
        time.sleep(0.005)


class TritonPythonModel:
    """Keeps per-sequence sums itself, keyed by the CORRID control input; reports the control
    values, the batch it ran in and its process, so tests can see what the sequence batcher fed
    it. A request parameter ``gate`` holds the execution until the test opens it."""

    def initialize(self, args):
        self.sums = {}
        self.executions = 0

    def execute(self, requests):
        for r in requests:
            gate = json.loads(r.parameters() or "{}").get("gate")
            if isinstance(gate, str) and os.path.isdir(gate):
                hold(gate)
        self.executions += 1
        out = []
        for r in requests:
            get = lambda n: pb_utils.get_input_tensor_by_name(r, n).as_numpy()  # noqa: E731
            corr = int(get("CORRID").reshape(-1)[0])
            start, end, ready = (int(get(n).reshape(-1)[0]) for n in ("START", "END", "READY"))
            if start:
                self.sums[corr] = 0
            if corr not in self.sums:
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"no sequence {corr}")))
                continue
            self.sums[corr] += int(get("VALUE").reshape(-1)[0])
            total = self.sums[corr]
            info = {"corr": corr, "start": start, "end": end, "ready": ready, "batch": len(requests),
                    "execution": self.executions, "pid": os.getpid()}
            if end:
                del self.sums[corr]
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SUM", np.array([[total]], np.int32)),
                pb_utils.Tensor("INFO", np.array([[json.dumps(info).encode()]], dtype=object)),
            ]))
        return out
