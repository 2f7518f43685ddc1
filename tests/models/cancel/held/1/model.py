import json
import os
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils

GATE_LIMIT_S = 120.0  # a test that never opens its gate: go on


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            gate = Path(json.loads(request.parameters())["gate"])
            (gate / f"started-{os.getpid()}-{time.monotonic_ns()}").touch()
            deadline = time.monotonic() + GATE_LIMIT_S
            while not (gate / "open").exists() and not request.is_cancelled() and time.monotonic() < deadline:
                time.sleep(0.005)
            if request.is_cancelled():
                (gate / f"saw-cancel-{request.request_id()}").touch()
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return out
