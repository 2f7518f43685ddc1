"""A Python model whose answer is as large as the caller asks, and an ensemble of it: for tests
of the arenas answers lie in (the worker's, the broker's)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

BLOB_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """OUT: N bytes, each the first byte of IN (an answer as large as the caller asks)."""

    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            n = int(pb_utils.get_input_tensor_by_name(request, "N").as_numpy()[0])
            out = np.full(n, data[0], dtype=np.uint8)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]))
        return responses
'''

BLOB_CONFIG = '''
name: "blob"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_UINT8 dims: [ -1 ] }, { name: "N" data_type: TYPE_INT64 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_UINT8 dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
response_cache { enable: true }
'''

ENSEMBLE_CONFIG = '''
name: "blob_ensemble"
platform: "ensemble"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_UINT8 dims: [ -1 ] }, { name: "N" data_type: TYPE_INT64 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_UINT8 dims: [ -1 ] } ]
ensemble_scheduling { step [ { model_name: "blob" model_version: -1
  input_map { key: "IN" value: "IN" } input_map { key: "N" value: "N" } output_map { key: "OUT" value: "OUT" } } ] }
'''


def write_repo(root: Path, cache: bool = False) -> Path:
    """``blob`` (with the response cache on where ``cache``) and ``blob_ensemble`` under ``root``."""
    blob = BLOB_CONFIG if cache else BLOB_CONFIG.replace("response_cache { enable: true }\n", "")
    for name, config in (("blob", blob), ("blob_ensemble", ENSEMBLE_CONFIG)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config)
    (root / "blob" / "1" / "model.py").write_text(BLOB_MODEL)
    return root


def infer(client: httpclient.InferenceServerClient, model: str, size: int, n: int, fill: int) -> np.ndarray:
    """OUT of ``model`` for an IN of ``size`` bytes of ``fill`` and N = ``n``."""
    inputs = [httpclient.InferInput("IN", [size], "UINT8"), httpclient.InferInput("N", [1], "INT64")]
    inputs[0].set_data_from_numpy(np.full(size, fill, dtype=np.uint8), binary_data=True)
    inputs[1].set_data_from_numpy(np.array([n], dtype=np.int64), binary_data=True)
    out = client.infer(model, inputs, outputs=[httpclient.InferRequestedOutput("OUT", binary_data=True)])
    return out.as_numpy("OUT")
