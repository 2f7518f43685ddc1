import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Calls TARGET (its name as bytes, straight from the BYTES input, as Triton's BLS example
    does) and reports the error code and message its response carries."""

    def execute(self, requests):
        out = []
        for request in requests:
            target = pb_utils.get_input_tensor_by_name(request, "TARGET").as_numpy()[0]
            response = pb_utils.InferenceRequest(model_name=target, requested_output_names=["OUT"],
                                                 inputs=[pb_utils.get_input_tensor_by_name(request, "CODE")]).exec()
            error = response.error()
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("GOT", np.array([int(error.code()) if error else -1], np.int32)),
                pb_utils.Tensor("MESSAGE", np.array([(error.message() if error else "").encode()], dtype=object))]))
        return out
