import json

import numpy as np
import triton_python_backend_utils as pb_utils

ADD_ONE = b"""
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() + 1)])
                for r in requests]
"""
CONFIG = {"name": "add_one", "backend": "python", "max_batch_size": 0,
          "input": [{"name": "X", "data_type": "TYPE_INT32", "dims": [1]}],
          "output": [{"name": "Y", "data_type": "TYPE_INT32", "dims": [1]}]}


class TritonPythonModel:
    """The model loading API from inside execute(): ACTION 'load' uploads and loads add_one and
    calls it, 'unload' unloads it, 'ready' asks; 'load_missing' loads a model nobody has.
    RESULT is JSON: what happened, or the TritonModelException's message."""

    def execute(self, requests):
        responses = []
        for request in requests:
            action = pb_utils.get_input_tensor_by_name(request, "ACTION").as_numpy()[0].decode()
            try:
                if action == "load":
                    pb_utils.load_model("add_one", config=json.dumps(CONFIG), files={"file:1/model.py": ADD_ONE})
                    y = pb_utils.InferenceRequest(model_name="add_one", requested_output_names=["Y"],
                                                  inputs=[pb_utils.Tensor("X", np.array([41], np.int32))]).exec()
                    result = {"ready": pb_utils.is_model_ready("add_one"),
                              "y": int(pb_utils.get_output_tensor_by_name(y, "Y").as_numpy()[0])}
                elif action == "unload":
                    pb_utils.unload_model("add_one")
                    result = {"ready": pb_utils.is_model_ready("add_one")}
                elif action == "ready":
                    result = {"ready": pb_utils.is_model_ready("add_one", "1")}
                else:
                    pb_utils.load_model("no_such_model_anywhere")
                    result = {"loaded": True}
            except pb_utils.TritonModelException as e:
                result = {"error": e.message()}
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("RESULT", np.array([json.dumps(result).encode()], dtype=object))]))
        return responses
