import json
import os
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

GATE_LIMIT_S = 120.0  # a test that never opens its gate: answer anyway, rather than hold the worker for good


class TritonPythonModel:
    def initialize(self, args):
        block = os.environ.get("SHMSERVE_TEST_RELAPSE_BLOCK", "")
        if block and os.path.exists(block):
            raise RuntimeError(f"blocked by {block}")

    def execute(self, requests):
        out = []
        for request in requests:
            gate = json.loads(request.parameters() or "{}").get("gate")
            if isinstance(gate, str) and os.path.isdir(gate):
                Path(gate, f"started-{os.getpid()}-{time.monotonic_ns()}").touch()
                deadline = time.monotonic() + GATE_LIMIT_S
                while not os.path.exists(os.path.join(gate, "open")) and time.monotonic() < deadline:
                    time.sleep(0.005)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("PID", np.array([os.getpid()], dtype=np.int64))]))
        return out
