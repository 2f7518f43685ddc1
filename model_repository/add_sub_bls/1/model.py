import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Business-logic scripting: calls add_sub from inside execute() and combines its outputs.

    OUTPUT0 = (a + b) * (a - b), computed by asking add_sub for the sum and the difference.
    """

    def execute(self, requests):
        responses = []
        for request in requests:
            call = pb_utils.InferenceRequest(
                model_name="add_sub",
                requested_output_names=["OUTPUT0", "OUTPUT1"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "INPUT0"),
                        pb_utils.get_input_tensor_by_name(request, "INPUT1")])
            answer = call.exec()
            if answer.has_error():
                raise pb_utils.TritonModelException(answer.error().message())
            total = pb_utils.get_output_tensor_by_name(answer, "OUTPUT0").as_numpy()
            diff = pb_utils.get_output_tensor_by_name(answer, "OUTPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", (total * diff).astype(np.int32))]))
        return responses
