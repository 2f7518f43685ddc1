import json
import os
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

LIMIT_S = 120.0  # a sender never cancelled stops here


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            params = json.loads(request.parameters())
            gate = Path(params["gate"]) if "gate" in params else None
            count = int(params.get("count", 1 << 30))
            sender = request.get_response_sender()
            deadline = time.monotonic() + LIMIT_S
            sent = 0
            while not sender.is_cancelled() and sent < count and time.monotonic() < deadline:
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("T", np.array([sent], np.int32))]))
                sent += 1
                time.sleep(0.005)
            if sender.is_cancelled() and gate is not None:
                (gate / f"stopped-{os.getpid()}-{time.monotonic_ns()}").touch()
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
