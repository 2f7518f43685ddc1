"""Never runs: the tests only send it requests the frontend refuses."""
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(error=pb_utils.TritonError("not for running")) for _ in requests]
