import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Keeps per-sequence sums itself, keyed by the CORRID control input; reports the control
    values and the batch it ran in, so tests can see what the sequence batcher fed it."""

    def initialize(self, args):
        self.sums = {}
        self.executions = 0

    def execute(self, requests):
        # A few milliseconds per execution, so that on a loaded host too the requests of other
        # sequences queue up meanwhile and the batcher has something to put together.
        time.sleep(0.003)
        self.executions += 1
        out = []
        for r in requests:
            get = lambda n: pb_utils.get_input_tensor_by_name(r, n).as_numpy()  # noqa: E731
            corr = int(get("CORRID").reshape(-1)[0])
            start, end, ready = (int(get(n).reshape(-1)[0]) for n in ("START", "END", "READY"))
            if start:
                self.sums[corr] = 0
            if corr not in self.sums:
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"no sequence {corr}")))
                continue
            self.sums[corr] += int(get("VALUE").reshape(-1)[0])
            total = self.sums[corr]
            info = {"corr": corr, "start": start, "end": end, "ready": ready, "batch": len(requests),
                    "execution": self.executions}
            if end:
                del self.sums[corr]
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SUM", np.array([[total]], np.int32)),
                pb_utils.Tensor("INFO", np.array([[json.dumps(info).encode()]], dtype=object)),
            ]))
        return out
