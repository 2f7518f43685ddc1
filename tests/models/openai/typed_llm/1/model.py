import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            got = {}
            for t in request.inputs():
                values = t.as_numpy().reshape(-1).tolist()
                got[t.name()] = [v.decode() if isinstance(v, bytes) else v for v in values]
            text = np.array([json.dumps(got, sort_keys=True).encode()], dtype=object)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", text)]))
        return responses
