"""A Triton Python model that uses much of the triton_python_backend_utils API.

TEXT (BYTES [-1]) and optional SCALE (FP32 [1]) in; UPPER (upper-cased TEXT), LENGTHS
(len of each element times SCALE, dtype taken from the output config) and INFO (a JSON
document describing what the model saw) out. Only requested outputs are produced. A request
parameter "fail" makes the model answer that request with a TritonError instead.
"""
import json

import numpy as np
import triton_python_backend_utils as pb_utils

INPUTS = [
    {"name": "TEXT", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "SCALE", "data_type": "TYPE_FP32", "dims": [1], "optional": True},
]
OUTPUTS = [
    {"name": "UPPER", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "LENGTHS", "data_type": "TYPE_FP32", "dims": [-1]},
    {"name": "INFO", "data_type": "TYPE_STRING", "dims": [1]},
]


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        config = auto_complete_model_config.as_dict()
        have_inputs = {i["name"] for i in config["input"]}
        have_outputs = {o["name"] for o in config["output"]}
        for spec in INPUTS:
            if spec["name"] not in have_inputs:
                auto_complete_model_config.add_input(spec)
        for spec in OUTPUTS:
            if spec["name"] not in have_outputs:
                auto_complete_model_config.add_output(spec)
        auto_complete_model_config.set_max_batch_size(0)
        return auto_complete_model_config

    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        lengths_config = pb_utils.get_output_config_by_name(self.model_config, "LENGTHS")
        self.lengths_dtype = pb_utils.triton_string_to_numpy(lengths_config["data_type"])
        self.args = {k: args[k] for k in ("model_name", "model_version", "model_instance_kind",
                                          "model_instance_name")}
        pb_utils.Logger.log_info(f"pbutils_full initialized as {self.args['model_instance_name']}")

    def execute(self, requests):
        responses = []
        for request in requests:
            params = json.loads(request.parameters())
            if "fail" in params:
                pb_utils.Logger.log_warn(f"pbutils_full refusing request '{request.request_id()}'")
                code = pb_utils.TritonError.INVALID_ARG if params["fail"] == "invalid_arg" \
                    else pb_utils.TritonError.INTERNAL
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"pbutils_full refused request '{request.request_id()}': {params['fail']}", code)))
                continue
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy().reshape(-1)
            scale_tensor = pb_utils.get_input_tensor_by_name(request, "SCALE")
            scale = float(scale_tensor.as_numpy()[0]) if scale_tensor is not None else 1.0
            wanted = request.requested_output_names()
            outputs = []
            if "UPPER" in wanted:
                outputs.append(pb_utils.Tensor("UPPER", np.array([t.upper() for t in text], dtype=np.object_)))
            if "LENGTHS" in wanted:
                lengths = np.array([len(t) for t in text], dtype=np.float64) * scale
                outputs.append(pb_utils.Tensor("LENGTHS", lengths.astype(self.lengths_dtype)))
            if "INFO" in wanted:
                info = {"request_id": request.request_id(), "parameters": params, "requested": sorted(wanted),
                        "scale_given": scale_tensor is not None, "input_names": sorted(t.name() for t in request.inputs()),
                        **self.args}
                outputs.append(pb_utils.Tensor("INFO", np.array([json.dumps(info).encode()], dtype=np.object_)))
            pb_utils.Logger.log(f"pbutils_full served request '{request.request_id()}'", pb_utils.Logger.INFO)
            responses.append(pb_utils.InferenceResponse(
                output_tensors=outputs, parameters={"served_by": self.args["model_instance_name"],
                                                    "element_count": int(text.size)}))
        return responses
