import json
import os
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

SLEEP_S = 0.5
GATE_LIMIT_S = 120.0  # a test that never opens its gate: fail the request, rather than block the instance


def hold(gate: str) -> None:
    """Mark this execution's start in the folder ``gate``, then wait until the test opens it
    (tests/gates.py): the test acts while the request is in the model."""
    Path(gate, f"started-{os.getpid()}-{time.monotonic_ns()}").touch()
    deadline = time.monotonic() + GATE_LIMIT_S
    while not os.path.exists(os.path.join(gate, "open")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gate {gate} was not opened within {GATE_LIMIT_S:g} s")
        time.sleep(0.005)


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, "X")
            parameters = json.loads(request.parameters() or "{}")
            # Wait first, read after: the bytes of X are touched only at the end of the request.
            gate = parameters.get("gate")
            if isinstance(gate, str) and os.path.isdir(gate):
                hold(gate)
            time.sleep(float(parameters.get("sleep_s", SLEEP_S)))
            x = tensor.as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SUM", np.array([int(x.astype(np.int64).sum())], dtype=np.int64)),
                pb_utils.Tensor("COPY", x.copy()),
                pb_utils.Tensor("PID", np.array([os.getpid()], dtype=np.int64)),
            ]))
        return responses
