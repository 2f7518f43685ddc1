import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.3)
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "A").as_numpy() + pb_utils.get_input_tensor_by_name(r, "B").as_numpy())])
            for r in requests]
