import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """A plain (non-decoupled) model whose one response is always an error."""

    def execute(self, requests):
        return [pb_utils.InferenceResponse(error=pb_utils.TritonError("plain broke")) for _ in requests]
