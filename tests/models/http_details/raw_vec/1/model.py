"""DOUBLED: the input times two; SHAPE: the input's shape as the model received it."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            shape = np.array([x.shape], dtype=np.int64)
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("DOUBLED", x * 2), pb_utils.Tensor("SHAPE", shape)]))
        return responses
