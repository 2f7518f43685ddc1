import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """A decoupled (streaming) model: one response per word of the input text, like a token
    stream. Responses are sent from a thread after execute() returns, as decoupled models may.
    Parameter ``delay_ms`` spaces the words out. A request its client gave up on
    (``is_cancelled()``: the client disconnected or cancelled) stops at the next word."""

    def execute(self, requests):
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
            delay = float(json.loads(request.parameters()).get("delay_ms", 0)) / 1000.0
            sender = request.get_response_sender()
            threading.Thread(target=self._speak, args=(text.decode(), delay, sender), daemon=True).start()
        return None

    @staticmethod
    def _speak(text, delay, sender):
        words = text.split()
        for i, word in enumerate(words):
            if delay:
                time.sleep(delay)
            if sender.is_cancelled():
                break
            out = pb_utils.Tensor("text_output", np.array([word.encode()], dtype=object))
            index = pb_utils.Tensor("index", np.array([i], dtype=np.int32))
            sender.send(pb_utils.InferenceResponse([out, index]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
