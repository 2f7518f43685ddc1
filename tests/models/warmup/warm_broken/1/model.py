import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Answers how many executions (and warm-up requests) it saw before this one."""

    def initialize(self, args):
        self.executions = 0
        self.warm = 0
        self.last_sum = 0.0

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            if r.request_id().startswith("warmup-"):
                self.warm += 1
                self.last_sum = float(x.sum())
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SEEN", np.array([self.executions, self.warm], np.int64)),
                pb_utils.Tensor("LAST_SUM", np.array([self.last_sum], np.float32))]))
        self.executions += 1
        return out
