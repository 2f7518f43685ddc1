import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            name = pb_utils.get_input_tensor_by_name(request, "NAME").as_numpy()[0].decode()
            value = os.environ.get(name, "")
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("VALUE", np.array([value.encode()], dtype=object))]))
        return out
