import os
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

GATE_LIMIT_S = 120.0  # a test that never opens its gate: go on, rather than stay unready for good


class TritonPythonModel:
    def initialize(self, args):
        gate = os.environ.get("SHMSERVE_TEST_LONELY_GATE")
        if not gate:
            return
        restarted = any(Path(gate).glob("started-*"))
        Path(gate, f"started-{os.getpid()}-{time.monotonic_ns()}").touch()
        deadline = time.monotonic() + GATE_LIMIT_S
        while restarted and not os.path.exists(os.path.join(gate, "open")) and time.monotonic() < deadline:
            time.sleep(0.005)

    def execute(self, requests):
        out = []
        for request in requests:
            if int(pb_utils.get_input_tensor_by_name(request, "X").as_numpy()[0]) == 1:
                os._exit(1)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("PID", np.array([os.getpid()], dtype=np.int64))]))
        return out
