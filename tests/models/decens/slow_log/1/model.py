import json
import os
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            params = json.loads(request.parameters() or "{}")
            start = time.monotonic()
            time.sleep(float(params.get("sleep_ms", 0)) / 1000)
            v = pb_utils.get_input_tensor_by_name(request, "V").as_numpy()
            if params.get("log"):
                fd = os.open(params["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, f"{start} {time.monotonic()} {int(v[0])}\n".encode())
                finally:
                    os.close(fd)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("W", v * 2)]))
        return responses
