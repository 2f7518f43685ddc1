import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Logits to the predicted digit and its softmax probability."""

    def execute(self, requests):
        out = []
        for r in requests:
            logits = pb_utils.get_input_tensor_by_name(r, "LOGITS").as_numpy().astype(np.float64)
            e = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs = e / e.sum(axis=1, keepdims=True)
            label = probs.argmax(axis=1).astype(np.int32).reshape(-1, 1)
            prob = probs.max(axis=1).astype(np.float32).reshape(-1, 1)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("LABEL", label), pb_utils.Tensor("PROB", prob)]))
        return out
