import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Answers X2 and never its declared output Y (an output a model may leave out)."""

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("X2", 2 * pb_utils.get_input_tensor_by_name(
            r, "X").as_numpy())]) for r in requests]
