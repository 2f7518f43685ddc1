"""Triton's example model 'simple_string_dyna_sequence' (its dyna_sequence backend with string
correlation ids) as a Python model, answering what the --dyna sequence examples check: the
running sum of a sequence's INPUTs, plus on its last request the correlation id (CORRID, a string
holding an integer). A sequence stays on one instance, so the sums live here, keyed by CORRID."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            def tensor(name):
                return pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)

            corrid = tensor("CORRID")[0]
            value = int(tensor("INPUT")[0])
            total = value if tensor("START")[0] else self.sums.get(corrid, 0) + value
            self.sums[corrid] = total
            if tensor("END")[0]:
                del self.sums[corrid]
                total += int(corrid)
            out = np.array([[total]], dtype=np.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out)]))
        return responses
