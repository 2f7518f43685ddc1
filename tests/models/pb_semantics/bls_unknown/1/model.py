import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """exec(decoupled=True) to a model nobody has: the responses it gets, as (has_error, message);
    then exec() without decoupled=True to a decoupled model: its error's message."""

    def execute(self, requests):
        out = []
        for r in requests:
            got = [(response.has_error(), response.error().message() if response.has_error() else "")
                   for response in pb_utils.InferenceRequest(
                       model_name="nosuch", inputs=[pb_utils.get_input_tensor_by_name(r, "X")],
                       requested_output_names=["Y"]).exec(decoupled=True)]
            plain = pb_utils.InferenceRequest(model_name="dec_returns_list", inputs=[pb_utils.get_input_tensor_by_name(
                r, "X")], requested_output_names=["Y"]).exec()
            got.append((plain.has_error(), plain.error().message() if plain.has_error() else ""))
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("INFO", np.array([json.dumps(got).encode()],
                                                                                    dtype=object))]))
        return out
