import os

import numpy as np
import triton_python_backend_utils as pb_utils

MARK = 4242


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            before = int(x.reshape(-1)[0])
            doubled = x * 2  # computed before the mark, from the client's values
            x.reshape(-1)[0] = MARK  # in place: the client must not see this (x is the model's own copy)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("BEFORE", np.array([before], dtype=np.int32)),
                pb_utils.Tensor("DOUBLED", doubled.astype(np.int32)),
                pb_utils.Tensor("PID", np.array([os.getpid()], dtype=np.int64)),
            ]))
        return responses
