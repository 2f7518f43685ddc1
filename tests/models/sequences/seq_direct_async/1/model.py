import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Decoupled, with an ``async def execute`` that raises when any request's VALUE is -1 (null
    rows included among its requests); otherwise each request gets the rows of its execution
    and the final flag."""

    async def execute(self, requests):
        values = [int(pb_utils.get_input_tensor_by_name(r, "VALUE").as_numpy().reshape(-1)[0]) for r in requests]
        if -1 in values:
            raise RuntimeError("told to raise")
        for i, r in enumerate(requests):
            rows = {"row": i, "values": values}
            r.get_response_sender().send(
                pb_utils.InferenceResponse([pb_utils.Tensor("ROWS", np.array([[json.dumps(rows).encode()]], dtype=object))]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
