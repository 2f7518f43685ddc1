"""Triton's example model 'simple_string': sum and difference of integers written as decimal strings."""
import numpy as np
import triton_python_backend_utils as pb_utils


def _ints(tensor):
    return np.vectorize(int, otypes=[np.int64])(tensor.as_numpy())


def _strings(values):
    return np.vectorize(lambda v: str(v).encode(), otypes=[np.object_])(values)


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = _ints(pb_utils.get_input_tensor_by_name(request, "INPUT0"))
            b = _ints(pb_utils.get_input_tensor_by_name(request, "INPUT1"))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", _strings(a + b)),
                                                         pb_utils.Tensor("OUTPUT1", _strings(a - b))]))
        return responses
