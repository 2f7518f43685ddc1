import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Reports how each execute() call was batched: requests in it, their total batch size, and a
    running execution counter (to observe the order batches ran in)."""

    def initialize(self, args):
        self.executions = 0

    def execute(self, requests):
        self.executions += 1
        sleep = max(float(json.loads(r.parameters()).get("sleep_s", 0)) for r in requests)
        if sleep:
            time.sleep(sleep)
        sizes = [pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy().shape[0] for r in requests]
        out = []
        for r, n in zip(requests, sizes):
            shape = (n, 1)
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("REQS", np.full(shape, len(requests), np.int32)),
                pb_utils.Tensor("TOTAL", np.full(shape, sum(sizes), np.int32)),
                pb_utils.Tensor("ORDER", np.full(shape, self.executions, np.int64)),
            ]))
        return out
