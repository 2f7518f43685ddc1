import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """BLS to decoupled models with exec(decoupled=True): the words word_stream streams for TEXT,
    joined; and err_stream's N values, then the error it ends with."""

    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT")
            words = []
            for r in pb_utils.InferenceRequest(model_name="word_stream", inputs=[pb_utils.Tensor("text_input", text.as_numpy())],
                                               requested_output_names=["text_output"]).exec(decoupled=True):
                if r.has_error():
                    raise pb_utils.TritonModelException(r.error().message())
                words.append(pb_utils.get_output_tensor_by_name(r, "text_output").as_numpy()[0].decode())
            n = pb_utils.get_input_tensor_by_name(request, "N")
            outs, error = [], ""
            for r in pb_utils.InferenceRequest(model_name="err_stream", inputs=[pb_utils.Tensor("N", n.as_numpy())],
                                               requested_output_names=["OUT"]).exec(decoupled=True):
                if r.has_error():
                    error = r.error().message()
                else:
                    outs.append(int(pb_utils.get_output_tensor_by_name(r, "OUT").as_numpy()[0]))
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("WORDS", np.array([" ".join(words).encode()], dtype=object)),
                pb_utils.Tensor("OUTS", np.array(outs, dtype=np.int32)),
                pb_utils.Tensor("ERROR", np.array([error.encode()], dtype=object))]))
        return responses
