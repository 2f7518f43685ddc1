import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils

HANG_LIMIT_S = 120.0  # a test that never ends its hang: answer anyway


class TritonPythonModel:
    def initialize(self, args):
        self.folder = os.environ.get("SHMSERVE_TEST_DOUBT_DIR", "")

    def _has(self, name):
        return bool(self.folder) and os.path.exists(os.path.join(self.folder, name))

    async def is_ready(self):  # async, as Triton allows
        if self._has("no"):
            return False
        if self._has("raise"):
            raise RuntimeError("the feature store is unreachable")
        if self._has("text"):
            return "yes"
        deadline = time.monotonic() + HANG_LIMIT_S
        while self._has("hang") and time.monotonic() < deadline:
            time.sleep(0.01)
        return True

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("PID", np.array([os.getpid()], dtype=np.int64))])
                for _ in requests]
