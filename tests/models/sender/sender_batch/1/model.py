"""Y = X + 1000 * (the size of the batch the request came in); the batch's requests are answered
from threads after execute returned, the last request first. X = -1: the thread ends the process
instead (a worker that dies while requests wait for their answers)."""
import os
import threading
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        n = len(requests)
        for i, request in enumerate(requests):
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            sender = request.get_response_sender()
            threading.Thread(target=self.answer, args=(sender, x + 1000 * n, 0.05 * (n - i))).start()
        return None

    @staticmethod
    def answer(sender, y, delay):
        time.sleep(delay)
        if int(y.flat[0]) % 1000 == 999:  # X = -1
            os._exit(1)
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
