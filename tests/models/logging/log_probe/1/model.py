"""Writes one pb_utils.Logger line per level for each request (tests/test_logging.py reads them).

Each method logs with its own marker: "<how> <level> <request id>", e.g. "method verbose r1" from
Logger.log_verbose and "enum verbose r1" from Logger.log(..., LogLevel.VERBOSE). The info line
comes last, so once it is in the log every enabled line of that request is too.
"""
import triton_python_backend_utils as pb_utils

Logger = pb_utils.Logger


class TritonPythonModel:
    def initialize(self, args):
        Logger.log_info(f"log_probe initialized as {args['model_instance_name']}")

    def execute(self, requests):
        responses = []
        for request in requests:
            rid = request.request_id()
            Logger.log_verbose(f"method verbose {rid}")
            Logger.log_error(f"method error {rid}")
            Logger.log_warn(f"method warning {rid}")
            Logger.log(f"enum verbose {rid}", Logger.LogLevel.VERBOSE)
            Logger.log(f"enum error {rid}", Logger.LogLevel.ERROR)
            Logger.log(f"enum warning {rid}", Logger.LogLevel.WARNING)
            Logger.log(f"enum info {rid}", Logger.LogLevel.INFO)
            Logger.log_info(f"method info {rid}")
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("Y", x)]))
        return responses
