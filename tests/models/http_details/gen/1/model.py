"""TEXT: the prompt repeated MAX_TOKENS times; PARAMS: the request's parameters as JSON."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            prompt = pb_utils.get_input_tensor_by_name(request, "PROMPT").as_numpy().reshape(-1)[0]
            count = int(pb_utils.get_input_tensor_by_name(request, "MAX_TOKENS").as_numpy().reshape(-1)[0])
            params = request.parameters().encode()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("TEXT", np.array([prompt * count], dtype=np.object_)),
                pb_utils.Tensor("PARAMS", np.array([params], dtype=np.object_))]))
        return responses
