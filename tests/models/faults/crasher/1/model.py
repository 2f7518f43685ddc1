import ctypes
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = int(pb_utils.get_input_tensor_by_name(request, "X").as_numpy()[0])
            if x == 1:
                os._exit(1)
            if x == 2:
                ctypes.string_at(0)  # SIGSEGV
            if x == 3:
                time.sleep(3600)
            if x == 5:
                time.sleep(1.5)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("PID", np.array([os.getpid()], dtype=np.int64))]))
        return out
