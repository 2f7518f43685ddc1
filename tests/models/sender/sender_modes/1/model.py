"""Answers Y = 2 * X through the request's response sender, as the request parameter "mode" says:

- one_call: ``send(response, FINAL)`` in execute; two_calls: ``send(response)``, then
  ``send(flags=FINAL)``; thread / thread_one_call: the same from a thread after execute returned
  (after "delay_ms"); list_none: a thread answers, and execute returns ``[None]``;
- twice: two responses (refused); final_first: the final flag alone (refused); sent_and_returned:
  ``send(response)`` and the response returned too (refused);
- probe: from a thread, every send Triton refuses before the answer (their messages are ERRORS),
  and after it (kept for "report", which returns them);
- abandon: returns None and drops the sender; forgot_return: returns None and never takes the
  sender (a model missing its ``return``); never: keeps the sender and never sends (the
  client's timeout or cancel ends it; "release" lets go of those kept).
"""
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def answer(x, errors=()):
    return pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2),
                                       pb_utils.Tensor("ERRORS", np.array(list(errors), dtype=object))])


def refusal(send):
    try:
        send()
    except pb_utils.TritonModelException as e:
        return str(e).encode()
    return b"accepted"


class TritonPythonModel:
    def initialize(self, args):
        self.after_final = []  # what probe's sends after the answer raised
        self.never = []  # senders of "never" requests

    def execute(self, requests):
        returned = []
        for request in requests:
            params = json.loads(request.parameters())
            mode = params.get("mode", "one_call")
            delay = params.get("delay_ms", 0) / 1000
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy().copy()
            sender = request.get_response_sender() if mode != "forgot_return" else None
            returned.append(None)
            if mode == "one_call":
                sender.send(answer(x), flags=FINAL)
            elif mode in ("two_calls", "twice"):
                sender.send(answer(x))
                if mode == "twice":
                    sender.send(answer(x), flags=FINAL)
                sender.send(flags=FINAL)
            elif mode in ("thread", "thread_one_call", "list_none"):
                threading.Thread(target=self.later, args=(sender, x, delay, mode == "thread_one_call")).start()
            elif mode == "final_first":
                sender.send(flags=FINAL)
            elif mode == "sent_and_returned":
                sender.send(answer(x))
                returned[-1] = answer(x)
            elif mode == "probe":
                threading.Thread(target=self.probe, args=(sender, x)).start()
            elif mode == "report":
                sender.send(answer(x, self.after_final), flags=FINAL)
            elif mode == "never":
                self.never.append(sender)
            elif mode == "release":
                held, self.never = len(self.never), []
                sender.send(answer(x, [str(held).encode()]), flags=FINAL)
            elif mode not in ("abandon", "forgot_return"):
                raise ValueError(f"unknown mode {mode}")
        if any(mode in ("list_none", "sent_and_returned") for mode in
               (json.loads(r.parameters()).get("mode") for r in requests)):
            return returned
        return None

    @staticmethod
    def later(sender, x, delay, one_call):
        time.sleep(delay)
        if one_call:
            sender.send(answer(x), flags=FINAL)
        else:
            sender.send(answer(x))
            sender.send(flags=FINAL)

    def probe(self, sender, x):
        time.sleep(0.05)  # after execute returned
        before = [refusal(lambda: sender.send(answer(x), flags=2)),
                  refusal(lambda: sender.send(None, flags=0)),
                  refusal(lambda: sender.send(flags=FINAL))]
        sender.send(answer(x, before))
        after = [refusal(lambda: sender.send(answer(x)))]
        sender.send(flags=FINAL)
        after += [refusal(lambda: sender.send(flags=FINAL)), refusal(lambda: sender.send(answer(x), flags=FINAL))]
        self.after_final[:] = after
