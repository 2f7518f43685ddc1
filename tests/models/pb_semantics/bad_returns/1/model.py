import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Breaks execute's contract as X says: 0 a tuple, 1 too few responses, 2 a string in the list."""

    def execute(self, requests):
        x = int(pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()[0])
        responses = [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(
            r, "X").as_numpy())]) for r in requests]
        if x == 0:
            return tuple(responses)
        if x == 1:
            return []
        return ["not a response"] * len(requests)
