import json
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy().reshape(-1)[0])
            params = json.loads(request.parameters() or "{}")
            sender = request.get_response_sender()
            if params.get("later"):  # from a thread, after execute has returned
                threading.Thread(target=self._send, args=(n, params, sender), daemon=True).start()
            else:
                self._send(n, params, sender)
        return None

    @staticmethod
    def _send(n, params, sender):
        pause = float(params.get("pause_ms", 0)) / 1000
        for i in range(abs(n)):
            time.sleep(pause if i else 0)
            v = np.array([100 * abs(n) + i], np.int32)
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("V", v)]))
        log = params.get("log")
        if log:  # how many of the consumer's calls had ended when its last send returned
            ended = len(open(log).read().splitlines()) if os.path.exists(log) else 0
            with open(log + ".sent", "a") as f:
                f.write(f"{ended}\n")
        if n < 0:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("repeat broke")))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
