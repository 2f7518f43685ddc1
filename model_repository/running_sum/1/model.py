import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """A stateful sequence model: the running sum of every value sent in a sequence.

    The sum is implicit state: the server feeds the previous request's SUM_STATE_OUT back as
    SUM_STATE_IN (zeros on START), so the model itself keeps nothing between requests.
    """

    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "VALUE").as_numpy()
            state = pb_utils.get_input_tensor_by_name(request, "SUM_STATE_IN").as_numpy()
            start = pb_utils.get_input_tensor_by_name(request, "START").as_numpy()
            total = (np.zeros_like(state) if start.any() else state) + value
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SUM", total.astype(np.float32)),
                pb_utils.Tensor("SUM_STATE_OUT", total.astype(np.float32)),
            ]))
        return responses
