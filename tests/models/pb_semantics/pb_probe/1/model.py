import json
import os
import sys

import numpy as np
import triton_python_backend_utils as pb_utils

import folder_helper

from .sibling import SIBLING


class TritonPythonModel:
    """Reports what the Python backend API tells it; X = 1 raises SystemExit, X = 2 raises
    KeyboardInterrupt (Triton fails the execution, the instance lives on)."""

    def initialize(self, args):
        self.pid = os.getpid()
        config = json.loads(args["model_config"])
        self.config = {"default_model_filename": config["default_model_filename"],
                       "optimization": "optimization" in config, "optional": config["input"][0]["optional"]}

    def execute(self, requests):
        out = []
        for r in requests:
            x = int(pb_utils.get_input_tensor_by_name(r, "X").as_numpy()[0])
            if x == 1:
                raise SystemExit(3)
            if x == 2:
                raise KeyboardInterrupt("kb")
            info = {"sibling": SIBLING, "folder": folder_helper.FOLDER, "module": __name__,
                    "model_dir": pb_utils.get_model_dir(), "timeout": r.timeout(), "parameters": r.parameters(),
                    "pid": self.pid, "config": self.config,
                    "cwd_on_path": [p for p in sys.path if p in ("", os.getcwd())]}
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("INFO", np.array([json.dumps(info).encode()],
                                                                                    dtype=object))]))
        return out
