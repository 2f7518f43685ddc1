"""The worker side of ``shmserve.serve``: a Python-backend model (``TritonPythonModel``) that
imports the user's script by its path and calls the function or class it declared.

The script is imported under a module name of its own, never ``__main__``, so its
``if __name__ == "__main__": shmserve.serve()`` does not run in the worker. A batched model gets
the requests of a batch stacked along the first dimension and its outputs are split back per
request; a generator streams one response per ``yield``.
"""
from __future__ import annotations

import hashlib
import importlib.util
import sys
from typing import Any

import numpy as np

from .bind import MODELS


def _import_script(path: str) -> None:
    name = "shmserve_app_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the script {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def bound_model(script: str, name: str) -> type:
    """The ``TritonPythonModel`` class of the model ``name`` declared in ``script``."""
    _import_script(script)
    if name not in MODELS:
        raise RuntimeError(f"the script {script} no longer declares a model named '{name}'")
    declared = MODELS[name]

    class TritonPythonModel:
        def initialize(self, args: dict) -> None:
            import triton_python_backend_utils as pb_utils

            self.pb = pb_utils
            target = declared.target
            if isinstance(target, type):
                instance = target()
                instance.device = f"cuda:{args.get('model_instance_device_id', 0)}" \
                    if args.get("model_instance_kind") == "GPU" else "cpu"
                if hasattr(instance, "setup"):
                    instance.setup()
                target = instance
            self.call = target

        def execute(self, requests: list) -> list | None:
            if declared.streaming:
                for request in requests:
                    self._stream(request)
                return None
            if declared.max_batch_size > 0:
                return self._batch(requests)
            return [self._response(self._returned(self.call(**self._inputs(r)))) for r in requests]

        def _inputs(self, request: Any) -> dict[str, np.ndarray]:
            out = {}
            for spec in declared.inputs:
                tensor = self.pb.get_input_tensor_by_name(request, spec.name)
                if tensor is not None:
                    out[spec.name] = tensor.as_numpy()
            return out

        def _returned(self, result: Any) -> dict[str, Any]:
            if isinstance(result, dict):
                return result
            if len(declared.outputs) == 1:
                return {declared.outputs[0].name: result}
            raise TypeError(f"model '{name}' must return a dict of its outputs "
                            f"({', '.join(o.name for o in declared.outputs)})")

        def _response(self, outputs: dict[str, Any]) -> Any:
            return self.pb.InferenceResponse([self.pb.Tensor(spec.name, np.asarray(outputs[spec.name],
                                                                                   dtype=spec.numpy_dtype))
                                              for spec in declared.outputs if spec.name in outputs])

        def _batch(self, requests: list) -> list:
            each = [self._inputs(r) for r in requests]
            sizes = [len(next(iter(i.values()))) if i else 1 for i in each]
            stacked = {k: np.concatenate([i[k] for i in each]) for k in each[0]}
            outputs = self._returned(self.call(**stacked))
            responses, start = [], 0
            for n in sizes:
                responses.append(self._response({k: np.asarray(v)[start:start + n] for k, v in outputs.items()}))
                start += n
            return responses

        def _stream(self, request: Any) -> None:
            sender = request.get_response_sender()
            try:
                for piece in self.call(**self._inputs(request)):
                    sender.send(self._response(self._returned(piece)))
            except Exception as e:  # noqa: BLE001 - the client hears why its stream ended
                sender.send(self.pb.InferenceResponse(error=self.pb.TritonError(f"{type(e).__name__}: {e}")))
            sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    TritonPythonModel.__doc__ = f"The model '{name}' of {script}"
    return TritonPythonModel
