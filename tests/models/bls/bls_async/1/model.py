import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """async execute: fans out two BLS calls at once (to add_sub and to a missing model)."""

    async def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            good = pb_utils.InferenceRequest(model_name="add_sub", requested_output_names=["OUTPUT0"],
                                             inputs=[a, b])
            bad = pb_utils.InferenceRequest(model_name="no_such_model", requested_output_names=["X"], inputs=[a])
            ok, failed = await asyncio.gather(good.async_exec(), bad.async_exec())
            message = ""
            if failed.has_error():  # the message, and whether its code is Triton's NOT_FOUND
                found = failed.error().code() == pb_utils.TritonError.NOT_FOUND
                message = failed.error().message() + (" [NOT_FOUND]" if found else " [other code]")
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SUM", pb_utils.get_output_tensor_by_name(ok, "OUTPUT0").as_numpy()),
                pb_utils.Tensor("ERROR", np.array([message.encode()], dtype=object)),
            ]))
        return responses
