"""LENGTH: the byte length of the one element; DIGEST: its SHA-256 in hex."""
import hashlib

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy().reshape(-1)[0]
            digest = hashlib.sha256(data).hexdigest().encode()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("LENGTH", np.array([len(data)], dtype=np.int64)),
                pb_utils.Tensor("DIGEST", np.array([digest], dtype=np.object_))]))
        return responses
