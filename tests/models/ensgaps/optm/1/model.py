import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """OUT = A + B, or A + 1000 when the request has no B (A read as is: a request without it fails here)."""

    def execute(self, requests):
        out = []
        for r in requests:
            a = pb_utils.get_input_tensor_by_name(r, "A").as_numpy()
            b = pb_utils.get_input_tensor_by_name(r, "B")
            v = a + (b.as_numpy() if b is not None else 1000)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", v.astype(np.int32))]))
        return out
