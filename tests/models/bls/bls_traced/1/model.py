import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """async execute: an exec() and an async_exec() of add_sub, each with trace=request.trace()."""

    async def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1")
            first = pb_utils.InferenceRequest(model_name="add_sub", requested_output_names=["OUTPUT0"],
                                              inputs=[a, b], trace=request.trace()).exec()
            once = pb_utils.Tensor("INPUT0", pb_utils.get_output_tensor_by_name(first, "OUTPUT0").as_numpy())
            second = await pb_utils.InferenceRequest(model_name="add_sub", requested_output_names=["OUTPUT0"],
                                                     inputs=[once, b], trace=request.trace()).async_exec()
            responses.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("SUM", pb_utils.get_output_tensor_by_name(second, "OUTPUT0").as_numpy())]))
        return responses
