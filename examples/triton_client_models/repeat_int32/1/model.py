"""Triton's decoupled example model 'repeat_int32' (its repeat backend) as a Python model.

For each element i of IN it waits DELAY[i] milliseconds and sends one response, OUT = IN[i] and
IDX = i; then it waits WAIT milliseconds and closes the request with the final flag. The
responses are sent from a thread after execute() returns, as decoupled models may."""
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(-1)
            delays = pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy().reshape(-1)
            wait = pb_utils.get_input_tensor_by_name(request, "WAIT").as_numpy().reshape(-1)
            sender = request.get_response_sender()
            if len(delays) != len(values):
                error = pb_utils.TritonError(f"expected equal element counts in IN and DELAY, got "
                                             f"{len(values)} and {len(delays)}")
                sender.send(pb_utils.InferenceResponse(error=error),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            threading.Thread(target=self._repeat, args=(values, delays, int(wait[0]), sender), daemon=True).start()
        return None

    @staticmethod
    def _repeat(values, delays, wait_ms, sender):
        for i, (value, delay_ms) in enumerate(zip(values, delays)):
            time.sleep(int(delay_ms) / 1000.0)
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([value], dtype=np.int32)),
                                                    pb_utils.Tensor("IDX", np.array([i], dtype=np.uint32))]))
        time.sleep(wait_ms / 1000.0)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
