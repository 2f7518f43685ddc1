import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """A ragged input as a Python model sees it under Triton: each request's own tensor, with the
    shape its client sent, and none of the batch inputs (the Python backend makes none). Each
    request gets the sum of its own elements, how many requests its execute() call held, its
    input's shape and the names of the inputs it carried."""

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            names = np.array([[t.name().encode() for t in r.inputs()]], dtype=object)
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SUM", x.sum(axis=1, keepdims=True).astype(np.float32)),
                pb_utils.Tensor("REQS", np.full((x.shape[0], 1), len(requests), np.int32)),
                pb_utils.Tensor("SHAPE", np.array([x.shape], np.int64)),
                pb_utils.Tensor("NAMES", names),
            ]))
        return out
