import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Answers an error response whose code N names: 1 NOT_FOUND, 3 INVALID_ARG, 4 UNSUPPORTED."""

    def execute(self, requests):
        codes = {1: pb_utils.TritonError.NOT_FOUND, 3: pb_utils.TritonError.INVALID_ARG,
                 4: pb_utils.TritonError.UNSUPPORTED}
        out = []
        for r in requests:
            n = int(pb_utils.get_input_tensor_by_name(r, "N").as_numpy()[0])
            out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"coded {n}", codes[n])))
        return out
