import json
import os
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils

GATE_LIMIT_S = 120.0


class TritonPythonModel:
    """Waits at the gate (request parameter ``gate``, tests/gates.py), then calls rl_child with
    its own input and parameters through BLS and answers with rl_child's Y; leaves
    ``run-rl_parent-<start ns>-<end ns>`` in the folder ``log`` as rl_child (rl_a's model) does."""

    def execute(self, requests):
        out = []
        for request in requests:
            params = json.loads(request.parameters() or "{}")
            start = time.monotonic_ns()
            if "gate" in params:
                Path(params["gate"], f"started-{os.getpid()}-{start}").touch()
                deadline = time.monotonic() + GATE_LIMIT_S
                while not Path(params["gate"], "open").exists() and time.monotonic() < deadline:
                    time.sleep(0.005)
            x = pb_utils.get_input_tensor_by_name(request, "X")
            child = pb_utils.InferenceRequest(model_name="rl_child", inputs=[x], requested_output_names=["Y"],
                                              parameters={k: v for k, v in params.items() if k == "log"}).exec()
            if child.has_error():
                out.append(pb_utils.InferenceResponse(error=child.error()))
            else:
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_output_tensor_by_name(
                    child, "Y").as_numpy())]))
            end = time.monotonic_ns()
            if "log" in params:
                Path(params["log"], f"run-rl_parent-{start}-{end}").touch()
        return out
