import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Answers the shape its warm-up sample reached it in: the config's ``reshape`` (2, 2), as
    Triton 2.51 gives it, not the sample's dims (4)."""

    def initialize(self, args):
        self.warm_shape = [0, 0]

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            if r.request_id().startswith("warmup"):
                self.warm_shape = (list(x.shape) + [0, 0])[:2]
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("WARM_SHAPE", np.array(self.warm_shape, np.int64))]))
        return out
