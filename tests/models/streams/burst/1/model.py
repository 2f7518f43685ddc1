import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = int(json.loads(request.parameters() or "{}").get("count", 5))
            sender = request.get_response_sender()
            for k in range(count):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("T", np.array([k], np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
