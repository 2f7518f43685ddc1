import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Two async_exec(decoupled=True) calls to word_stream at once (the second reversed), gathered."""

    async def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()[0].decode()
            calls = [pb_utils.InferenceRequest(model_name="word_stream", requested_output_names=["text_output"],
                                               inputs=[pb_utils.Tensor("text_input", np.array([t.encode()], dtype=object))]
                                               ).async_exec(decoupled=True)
                     for t in (text, " ".join(reversed(text.split())))]
            joined = []
            for stream in await asyncio.gather(*calls):
                joined.append(" ".join(pb_utils.get_output_tensor_by_name(r, "text_output").as_numpy()[0].decode()
                                       for r in stream))
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("WORDS", np.array([w.encode() for w in joined], dtype=object))]))
        return responses
