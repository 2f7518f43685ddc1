import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy().reshape(-1)[0])
            sender = request.get_response_sender()
            for i in range(abs(n)):
                v = np.array([100 * abs(n) + i], np.int32)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("V", v)]))
            log = json.loads(request.parameters() or "{}").get("log")
            if log:  # how many of the consumer's calls had ended when its last send returned
                ended = len(open(log).read().splitlines()) if os.path.exists(log) else 0
                with open(log + ".sent", "a") as f:
                    f.write(f"{ended}\n")
            if n < 0:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("repeat broke")))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
