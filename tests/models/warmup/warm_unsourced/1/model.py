import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Adds X and Y; its warm-up sample gives only X, which must be refused as a request lacking Y
    would be, before execute sees it."""

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Z", pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
                                                            + pb_utils.get_input_tensor_by_name(r, "Y").as_numpy())])
                for r in requests]
