import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """exec(decoupled=True) to a model nobody has: the responses it gets, as (has_error, message)."""

    def execute(self, requests):
        out = []
        for r in requests:
            got = [(response.has_error(), response.error().message() if response.has_error() else "")
                   for response in pb_utils.InferenceRequest(
                       model_name="nosuch", inputs=[pb_utils.get_input_tensor_by_name(r, "X")],
                       requested_output_names=["Y"]).exec(decoupled=True)]
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("INFO", np.array([json.dumps(got).encode()],
                                                                                    dtype=object))]))
        return out
