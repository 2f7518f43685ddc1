"""Echoes X as PROB (FP32, labelled) and 10*X as IDX (INT32): outputs to classify."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("PROB", x.astype(np.float32)),
                                                         pb_utils.Tensor("IDX", (x * 10).astype(np.int32))]))
        return responses
