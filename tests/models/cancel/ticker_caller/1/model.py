import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Streams "ticker" through exec(decoupled=True), or async_exec(decoupled=True) when the request
    parameter "async" is true, reads its first response and cancels the rest."""

    async def execute(self, requests):
        out = []
        for request in requests:
            params = json.loads(request.parameters())
            call = pb_utils.InferenceRequest(model_name="ticker", requested_output_names=["T"],
                                             inputs=[pb_utils.get_input_tensor_by_name(request, "N")],
                                             parameters={"gate": params["gate"]})
            responses = await call.async_exec(decoupled=True) if params.get("async") else call.exec(decoupled=True)
            first = next(responses)
            if first.has_error():
                raise pb_utils.TritonModelException(first.error().message())
            responses.cancel()
            read = 1 + sum(1 for r in responses if not r.has_error())  # none: cancel() ends the iterator
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("READ", np.array([read], np.int32))]))
        return out
