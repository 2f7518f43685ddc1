import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils

SLEEP_S = 0.3


class TritonPythonModel:
    def initialize(self, args):
        self.instance_name = args["model_instance_name"]

    def execute(self, requests):
        responses = []
        for _ in requests:
            time.sleep(SLEEP_S)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("INSTANCE", np.array([self.instance_name.encode()], dtype=np.object_)),
                pb_utils.Tensor("PID", np.array([os.getpid()], dtype=np.int64)),
            ]))
        return responses
