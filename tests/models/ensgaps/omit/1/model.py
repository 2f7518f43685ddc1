import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """O1 = IN; O2 is declared but never returned."""

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("O1", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
                for r in requests]
