import json
import os
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

GATE_LIMIT_S = 120.0  # a test that never opens its gate: stop waiting rather than block the instance


def hold(gate: str) -> None:
    """Mark this execution's start in the folder ``gate``, then wait until the test opens it."""
    Path(gate, f"started-{os.getpid()}-{time.monotonic_ns()}").touch()
    deadline = time.monotonic() + GATE_LIMIT_S
    while not os.path.exists(os.path.join(gate, "open")) and time.monotonic() < deadline:
        time.sleep(0.005)


class TritonPythonModel:
    def execute(self, requests):
        linger = 0.0
        for request in requests:
            parameters = json.loads(request.parameters() or "{}")
            gate = parameters.get("gate")
            if isinstance(gate, str) and os.path.isdir(gate):
                hold(gate)
            linger = max(linger, float(parameters.get("linger_s", 0)))
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            total = np.array([int(x.astype(np.int64).sum())], dtype=np.int64)
            request.get_response_sender().send(pb_utils.InferenceResponse([pb_utils.Tensor("SUM", total)]),
                                               flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        time.sleep(linger)
        return None
