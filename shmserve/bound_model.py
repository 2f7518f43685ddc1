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

from .bind import MODELS, Declaration, TensorSpec


class OutputError(TypeError):
    """A bound function returned outputs other than it declared: said by output name, since the
    client would otherwise get a 200 without them."""


def _dims_match(shape: tuple[int, ...], dims: tuple[int, ...]) -> bool:
    return len(shape) == len(dims) and all(d == -1 or d == s for s, d in zip(shape, dims))


def _checked_output(model: str, spec: TensorSpec, value: Any, rows: int | None) -> np.ndarray:
    """``value`` as its declared output: the dtype the declaration names (a cast within the same
    kind, e.g. float64 to FP32; not float to INT32 or text to numbers) and shape (``rows`` ahead
    of the declared dims for a batched model)."""
    arr = np.asarray(value)
    want = spec.numpy_dtype
    if want is object:
        if arr.dtype.kind not in "OSU":
            raise OutputError(f"model '{model}' returned output '{spec.name}' as {arr.dtype}, but declared it "
                              f"as bytes")
    elif not np.can_cast(arr.dtype, want, "same_kind"):
        raise OutputError(f"model '{model}' returned output '{spec.name}' as {arr.dtype}, which does not convert "
                          f"to the declared {np.dtype(want)}")
    shape = tuple(arr.shape)
    if rows is not None:
        if not shape or shape[0] != rows:
            raise OutputError(f"model '{model}' returned output '{spec.name}' with shape {list(shape)} for a batch "
                              f"of {rows}: its first dimension must be the batch")
        shape = shape[1:]
    if not _dims_match(shape, spec.dims):
        raise OutputError(f"model '{model}' returned output '{spec.name}' with shape {list(shape)}, but declared "
                          f"{list(spec.dims)}" + (" (after the batch dimension)" if rows is not None else ""))
    return arr.astype(want, copy=False)


def checked_outputs(declared: Declaration, outputs: dict[str, Any], rows: int | None) -> dict[str, np.ndarray]:
    """Every declared output, each checked; an output the declaration lacks, or one it names and
    the function left out, is an ``OutputError`` naming it."""
    names = [o.name for o in declared.outputs]
    extra = [k for k in outputs if k not in names]
    if extra:
        raise OutputError(f"model '{declared.name}' returned output(s) {extra} it does not declare "
                          f"(declared: {names})")
    missing = [n for n in names if n not in outputs]
    if missing:
        raise OutputError(f"model '{declared.name}' did not return its declared output(s) {missing}")
    return {spec.name: _checked_output(declared.name, spec, outputs[spec.name], rows) for spec in declared.outputs}


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
            return [self._response(checked_outputs(declared, self._returned(self.call(**self._inputs(r))), None))
                    for r in requests]

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

        def _response(self, outputs: dict[str, np.ndarray]) -> Any:
            return self.pb.InferenceResponse([self.pb.Tensor(name, value) for name, value in outputs.items()])

        def _batch(self, requests: list) -> list:
            each = [self._inputs(r) for r in requests]
            sizes = [len(next(iter(i.values()))) if i else 1 for i in each]
            stacked = {k: np.concatenate([i[k] for i in each]) for k in each[0]}
            outputs = checked_outputs(declared, self._returned(self.call(**stacked)), sum(sizes))
            responses, start = [], 0
            for n in sizes:
                responses.append(self._response({k: v[start:start + n] for k, v in outputs.items()}))
                start += n
            return responses

        def _stream(self, request: Any) -> None:
            sender = request.get_response_sender()
            try:
                for piece in self.call(**self._inputs(request)):
                    sender.send(self._response(checked_outputs(declared, self._returned(piece), None)))
            except Exception as e:  # noqa: BLE001 - the client hears why its stream ended
                sender.send(self.pb.InferenceResponse(error=self.pb.TritonError(f"{type(e).__name__}: {e}")))
            sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    TritonPythonModel.__doc__ = f"The model '{name}' of {script}"
    return TritonPythonModel
