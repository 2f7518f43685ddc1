import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Fails every request with a TritonError of the code it is given."""

    def execute(self, requests):
        out = []
        for request in requests:
            code = int(pb_utils.get_input_tensor_by_name(request, "CODE").as_numpy()[0])
            out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"failed with code {code}", code)))
        return out
