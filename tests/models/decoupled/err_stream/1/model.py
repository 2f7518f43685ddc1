import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Sends N good responses, then an error response, then the final flag (from execute)."""

    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy().reshape(-1)[0])
            sender = request.get_response_sender()
            for i in range(n):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], np.int32))]))
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("stream broke")))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
