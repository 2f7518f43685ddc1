import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Answers each request with every row of the execution it ran in (its controls and value)
    and its own row, so tests can see which batch slot each sequence took and what fills the
    slots that had no request."""

    def execute(self, requests):
        rows = []
        for r in requests:
            get = lambda n: int(pb_utils.get_input_tensor_by_name(r, n).as_numpy().reshape(-1)[0])  # noqa: E731
            rows.append({"ready": get("READY"), "start": get("START"), "end": get("END"), "corr": get("CORRID"),
                         "value": get("VALUE")})
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
                    "ROWS", np.array([[json.dumps({"row": i, "rows": rows}).encode()]], dtype=object))])
                for i in range(len(requests))]
