import json
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils

SLEEP_S = 0.5


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            tensor = pb_utils.get_input_tensor_by_name(request, "X")
            # Sleep first, read after: the bytes of X are touched only at the end of the request.
            time.sleep(float(json.loads(request.parameters() or "{}").get("sleep_s", SLEEP_S)))
            x = tensor.as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SUM", np.array([int(x.astype(np.int64).sum())], dtype=np.int64)),
                pb_utils.Tensor("COPY", x.copy()),
                pb_utils.Tensor("PID", np.array([os.getpid()], dtype=np.int64)),
            ]))
        return responses
