import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Fails every request with a TritonError of the code it is given (TRITONSERVER_Error_Code's
    number; Triton's TritonError takes only its enum, which it has only inside execute)."""

    def execute(self, requests):
        E = pb_utils.TritonError
        codes = [E.UNKNOWN, E.INTERNAL, E.NOT_FOUND, E.INVALID_ARG, E.UNAVAILABLE, E.UNSUPPORTED,
                 E.ALREADY_EXISTS, E.CANCELLED]
        out = []
        for request in requests:
            code = int(pb_utils.get_input_tensor_by_name(request, "CODE").as_numpy()[0])
            out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"failed with code {code}", codes[code])))
        return out
