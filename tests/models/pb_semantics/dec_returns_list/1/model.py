import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """A decoupled model that returns its responses from execute, which Triton refuses."""

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
                for r in requests]
