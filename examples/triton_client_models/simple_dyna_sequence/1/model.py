"""Triton's example model 'simple_dyna_sequence' (its dyna_sequence backend, oldest-first sequence
batching) as a Python model, answering what the --dyna sequence examples check: OUTPUT = INPUT,
plus 1 on a sequence's first request and plus the correlation id (CORRID, UINT64) on its last."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            def tensor(name):
                return pb_utils.get_input_tensor_by_name(request, name).as_numpy()

            corrid = tensor("CORRID").astype(np.int64)
            out = tensor("INPUT") + tensor("START") + tensor("END") * corrid.astype(np.int32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", out.astype(np.int32))]))
        return responses
