import numpy as np
import triton_python_backend_utils as pb_utils

DEFAULT_MAX_TOKENS = 16


class TritonPythonModel:
    """A scripted generative model in Triton's text conventions, for trying the OpenAI-compatible
    endpoints end to end with no download: it streams back the words of the prompt's last line
    (a chat prompt's last user message), one token per response, then "[end]", at most
    ``max_tokens`` tokens. Decoupled, so it streams; a plain call collects the tokens."""

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            prompt = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0].decode()
            limit = pb_utils.get_input_tensor_by_name(request, "max_tokens")
            limit = int(limit.as_numpy().reshape(-1)[0]) if limit is not None else DEFAULT_MAX_TOKENS
            lines = [line for line in prompt.splitlines() if line.strip() and line.strip() != "assistant:"]
            last = lines[-1].split(":", 1)[-1] if lines else ""
            tokens = (last.split() + ["[end]"])[:max(limit, 0)]
            for i, token in enumerate(tokens):
                text = token if i == 0 else " " + token
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("text_output",
                                                                        np.array([text.encode()], dtype=object))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
