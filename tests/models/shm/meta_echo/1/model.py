import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("Y", (x + 1).astype(np.int32)),
                pb_utils.Tensor("REQUEST_ID", np.array([request.request_id().encode()], dtype=np.object_)),
                pb_utils.Tensor("PARAMETERS", np.array([request.parameters().encode()], dtype=np.object_)),
                pb_utils.Tensor("PID", np.array([os.getpid()], dtype=np.int64)),
            ]))
        return responses
