"""Triton's example model 'simple_int8' as a Python model: 'simple' on INT8 tensors, which
grpc_explicit_int8_content_client.py sends in typed ``int_contents``. Sums wrap as int8 does."""
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", a + b),
                                                         pb_utils.Tensor("OUTPUT1", a - b)]))
        return responses
