import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", (pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2).astype(np.int32))]) for r in requests]
