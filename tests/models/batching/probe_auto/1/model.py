import importlib.util
import os

import triton_python_backend_utils as pb_utils

# The probe's execute(), with a config completed by the model itself.
_spec = importlib.util.spec_from_file_location(
    "probe_model", os.path.join(os.path.dirname(__file__), "..", "..", "probe", "1", "model.py"))
_probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_probe)


class TritonPythonModel(_probe.TritonPythonModel):
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        auto_complete_model_config.set_max_batch_size(16)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config
