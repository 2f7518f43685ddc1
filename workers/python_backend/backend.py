"""Triton's Python backend: ``model.py`` with ``TritonPythonModel``, unchanged.

The worker process plays the part of Triton's Python stub: it imports ``model.py`` with our
``triton_python_backend_utils`` installed under that name, hands it ``pb_utils.InferenceRequest``
objects whose tensors are numpy views over shared memory, and reads back its responses.
"""
from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import sys
from types import ModuleType
from typing import Any

import numpy as np

from shmserve.shm.tensors import DTYPES

from ..backend import Backend, Instance, InstanceContext, Model, ModelContext, Request, Response
from . import pb_utils
from .bls import Bls

MODULE_NAME = "triton_python_backend_utils"
# TritonError codes -> HTTP status, as Triton's HTTP frontend answers them.
ERROR_STATUS = {
    pb_utils.TritonError.INVALID_ARG: 400,
    pb_utils.TritonError.NOT_FOUND: 404,
    pb_utils.TritonError.ALREADY_EXISTS: 409,
    pb_utils.TritonError.UNAVAILABLE: 503,
    pb_utils.TritonError.UNSUPPORTED: 501,
    pb_utils.TritonError.CANCELLED: 499,
    pb_utils.TritonError.INTERNAL: 500,
    pb_utils.TritonError.UNKNOWN: 500,
}


def _tensor(name: str, arr: np.ndarray) -> Any:
    """A pb_utils.Tensor; BF16 (no numpy type in Triton's API) is torch-backed, as in Triton,
    and reachable through DLPack."""
    if arr.dtype == DTYPES["BF16"] and arr.dtype != np.uint16:
        import torch

        t = torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16)
        return pb_utils.Tensor._from_torch(name, t, pb_utils._TYPE_BF16)
    return pb_utils.Tensor(name, arr)


# numpy dtype -> Triton type code of the inputs that need no conversion (BF16 is torch-backed).
_PLAIN_INPUT_TYPES = {dt: pb_utils.numpy_to_triton_type(dt) for k, dt in DTYPES.items() if k != "BF16"}


def _input(name: str, arr: np.ndarray) -> Any:
    """An input tensor: wrapped as it is in the common case (the worker's arrays are already
    checked views), else through ``_tensor``."""
    code = _PLAIN_INPUT_TYPES.get(arr.dtype)
    if code is not None and arr.flags.c_contiguous:
        return pb_utils.Tensor._wrap(name, arr, code)
    return _tensor(name, arr)


def _array_of(t: Any) -> np.ndarray:
    """The bytes of an output tensor as numpy, whatever backs it (numpy, or torch for BF16/GPU)."""
    arr = getattr(t, "_array", None)
    if arr is not None:
        return np.asarray(arr)
    torch_tensor = t._torch.detach().cpu().contiguous()
    import torch

    if torch_tensor.dtype == torch.bfloat16:
        return torch_tensor.view(torch.int16).numpy().view(DTYPES["BF16"])
    return torch_tensor.numpy()


def _install_pb_utils() -> None:
    sys.modules.setdefault(MODULE_NAME, pb_utils)


def _import_model(ctx: ModelContext) -> ModuleType:
    filename = ctx.config.get("default_model_filename") or "model.py"
    path = ctx.version_dir / filename
    # Triton puts the version folder on the path, so a model may import its sibling modules.
    sys.path.insert(0, str(ctx.version_dir))
    spec = importlib.util.spec_from_file_location("model", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["model"] = module
    spec.loader.exec_module(module)
    if not hasattr(module, "TritonPythonModel"):
        raise AttributeError(f"{path} does not define class TritonPythonModel")
    return module


class ResponseSender:
    """pb_utils' response sender of a decoupled model: ``send(response=None, flags=0)``."""

    def __init__(self, send: Any) -> None:
        self._send = send

    def send(self, response: Any = None, flags: int = 0) -> None:
        converted = PythonInstance._convert(response) if response is not None else None
        self._send(converted, final=bool(flags & pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL))

    def is_cancelled(self) -> bool:
        return False


class PythonBackend(Backend):
    def __init__(self) -> None:
        _install_pb_utils()
        self._module: ModuleType | None = None

    def _model_module(self, ctx: ModelContext) -> ModuleType:
        if self._module is None:
            self._module = _import_model(ctx)
        return self._module

    def auto_complete_config(self, ctx: ModelContext) -> dict[str, Any]:
        cls = self._model_module(ctx).TritonPythonModel
        hook = getattr(cls, "auto_complete_config", None)
        if hook is None:
            return ctx.config
        completed = hook(pb_utils.ModelConfig(ctx.config))
        return completed.as_dict() if completed is not None else ctx.config

    def create_model(self, ctx: ModelContext) -> Model:
        pb_utils._set_model_dir(str(ctx.model_dir))
        self.bls = Bls(ctx.server_id)
        pb_utils._set_bls(self.bls)
        return PythonModel(self._model_module(ctx), ctx)

    def finalize(self) -> None:
        bls = getattr(self, "bls", None)
        if bls is not None:
            bls.close()


class PythonModel(Model):
    def __init__(self, module: ModuleType, ctx: ModelContext) -> None:
        self.module = module
        self.ctx = ctx

    def create_instance(self, ictx: InstanceContext) -> Instance:
        model = self.module.TritonPythonModel()
        args = {
            "model_config": json.dumps(self.ctx.config),
            "model_instance_kind": ictx.kind,
            "model_instance_name": ictx.name,
            "model_instance_device_id": str(ictx.device_id),
            "model_repository": str(self.ctx.model_dir),
            "model_version": str(self.ctx.version),
            "model_name": self.ctx.name,
        }
        if hasattr(model, "initialize"):
            model.initialize(args)
        return PythonInstance(model, self.ctx)


class PythonInstance(Instance):
    def __init__(self, model: Any, ctx: ModelContext) -> None:
        self.model = model
        self.ctx = ctx
        self.loop: asyncio.AbstractEventLoop | None = None
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(ctx.config)

    def execute(self, requests: list[Request]) -> list[Response]:
        pb_requests = self._pb_requests(requests)
        results = self.model.execute(pb_requests)
        if type(results) is not list and inspect.isawaitable(results):  # async def execute (e.g. BLS async_exec)
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
            results = self.loop.run_until_complete(results)
        if self.decoupled:
            return []  # its responses went through the senders
        if results is None or len(results) != len(requests):
            got = "None" if results is None else str(len(results))
            raise RuntimeError(f"execute() returned {got} responses for {len(requests)} requests")
        return [self._convert(r) for r in results]

    def _pb_requests(self, requests: list[Request]) -> list[Any]:
        name = self.ctx.name
        incoming = pb_utils.InferenceRequest._incoming
        pb_requests = [incoming(name, [_input(n, arr) for n, arr in r.inputs.items()], r.requested_outputs,
                                r.id, r.correlation_id, r.flags, r.parameters)
                       for r in requests]
        for r, pb in zip(requests, pb_requests):
            if r.sender is not None:
                pb._response_sender = ResponseSender(r.sender)
        return pb_requests

    @staticmethod
    def _convert(resp: Any) -> Response:
        params = resp.parameters() if hasattr(resp, "parameters") else None
        params = json.loads(params) if isinstance(params, str) and params not in ("", "{}") else None
        if resp.has_error():
            err = resp.error()
            code = err.code() if hasattr(err, "code") else pb_utils.TritonError.INTERNAL
            return Response(error=err.message() if hasattr(err, "message") else str(err),
                            status=ERROR_STATUS.get(code, 500), parameters=params)
        outputs: dict[str, np.ndarray] = {}
        for t in resp.output_tensors():
            arr = getattr(t, "_array", None)
            outputs[t.name()] = arr if type(arr) is np.ndarray else _array_of(t)
        return Response(outputs, None, params)  # (by position: half the time of a dataclass by name)

    def finalize(self) -> None:
        if hasattr(self.model, "finalize"):
            self.model.finalize()
