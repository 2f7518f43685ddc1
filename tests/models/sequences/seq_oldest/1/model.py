import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Implicit state: ACC_IN is what ACC_OUT was after the sequence's previous request."""

    def execute(self, requests):
        out = []
        for r in requests:
            value = pb_utils.get_input_tensor_by_name(r, "VALUE").as_numpy()
            acc = pb_utils.get_input_tensor_by_name(r, "ACC_IN").as_numpy() + value
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("TOTAL", acc.astype(np.int64)),
                                                   pb_utils.Tensor("ACC_OUT", acc.astype(np.int64))]))
        return out
