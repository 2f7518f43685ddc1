"""Echo every input IN_<T> as OUT_<T>, exactly as a Triton Python model would write it.

BF16 has no numpy dtype in Triton's Python backend (``as_numpy()`` refuses it), so Triton
models pass BF16 tensors through DLPack; every other datatype goes through numpy.
"""
import triton_python_backend_utils as pb_utils

TYPE_BF16 = 14


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            outputs = []
            for tensor in request.inputs():
                out_name = "OUT_" + tensor.name()[len("IN_"):]
                if tensor.triton_dtype() == TYPE_BF16:
                    outputs.append(pb_utils.Tensor.from_dlpack(out_name, tensor.to_dlpack()))
                else:
                    outputs.append(pb_utils.Tensor(out_name, tensor.as_numpy()))
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses
