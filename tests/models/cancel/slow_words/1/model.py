import os
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

WORDS = 5
INTERVAL_S = 30.0  # between words: far longer than any test waits for a cancel to be seen


def _folder(prompt: str) -> Path:
    lines = [line for line in prompt.splitlines() if line.strip() and line.strip() != "assistant:"]
    last = lines[-1].strip() if lines else ""
    return Path(last.split(": ", 1)[1] if ": " in last else last)


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            prompt = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0].decode()
            folder = _folder(prompt)
            for n in range(WORDS):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor(
                    "text_output", np.array([f"word{n} ".encode()], dtype=object))]))
                (folder / f"sent-{n}").touch()
                deadline = time.monotonic() + INTERVAL_S
                while not sender.is_cancelled() and time.monotonic() < deadline:
                    time.sleep(0.01)
                if sender.is_cancelled():
                    (folder / f"stopped-{os.getpid()}-{time.monotonic_ns()}").touch()
                    break
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
