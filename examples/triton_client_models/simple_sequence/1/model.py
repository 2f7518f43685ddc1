"""Triton's example model 'simple_sequence': OUTPUT = INPUT, plus 1 on a sequence's first request
(what Triton's sequence examples check); START and READY come from the sequence batcher."""
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            start = pb_utils.get_input_tensor_by_name(request, "START").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", value + start)]))
        return responses
