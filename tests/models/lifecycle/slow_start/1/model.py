import json
import os
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils

GATE_LIMIT_S = 120.0  # a test that never opens its gate: go on, rather than load for good


class TritonPythonModel:
    def initialize(self, args):
        """Mark the start of this instance's load in the gate folder, then wait until it opens."""
        parameters = json.loads(args["model_config"]).get("parameters", {})
        gate = parameters.get("gate", {}).get("string_value")
        if not gate:
            return
        Path(gate, f"started-{os.getpid()}-{time.monotonic_ns()}").touch()
        deadline = time.monotonic() + GATE_LIMIT_S
        while not os.path.exists(os.path.join(gate, "open")) and time.monotonic() < deadline:
            time.sleep(0.005)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
                for r in requests]
