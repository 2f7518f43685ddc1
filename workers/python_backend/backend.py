"""Triton's Python backend: ``model.py`` with ``TritonPythonModel``, unchanged.

The worker process plays the part of Triton's Python stub: it imports ``model.py`` with our
``triton_python_backend_utils`` installed under that name, hands it ``pb_utils.InferenceRequest``
objects whose tensors are copies of the client's inputs (as Triton's stub holds them; read-only
views with the READ_ONLY_INPUTS parameter), and reads back its responses, returned by ``execute``
or sent through the requests' response senders. An ``async def execute`` runs on the instance's
event loop (event_loop.py).
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import sys
import traceback
from types import ModuleType
from typing import Any

from ..backend import Backend, Instance, InstanceContext, Model, ModelContext, Request, Response
from . import pb_utils
from .bls import Bls
from .convert import input_tensor, to_response
from .event_loop import EventLoop
from .pb_utils import runtime

log = logging.getLogger("shmserve.worker")

MODULE_NAME = "triton_python_backend_utils"


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
    """The response sender a request gives (``get_response_sender()``): ``send(response=None,
    flags=0)`` converts the response and hands it to ``stream``: for a decoupled model the
    request's ``Request.sender`` (the worker's StreamSender, workers/stream.py), for any other
    a ``Reply`` that keeps it for ``execute`` to return."""

    def __init__(self, stream: Any, cancel: Any) -> None:
        self._stream = stream
        self._cancel = cancel  # the request's CancelFlag (workers/backend.py)

    def send(self, response: Any = None, flags: int = 0) -> None:
        converted = to_response(response) if response is not None else None
        self._stream(converted, final=bool(flags & pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL))

    def is_cancelled(self) -> bool:
        """Whether the client cancelled the request (it disconnected, timed out or cancelled):
        the model may stop sending; what it still sends is freed unread."""
        return self._cancel is not None and self._cancel.is_set()


class Reply:
    """The one response a non-decoupled model may send through its response sender (Triton
    24.06+): it must carry ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``, and ``execute`` then returns
    None. The worker answers it as if ``execute`` had returned it."""

    def __init__(self) -> None:
        self.response: Response | None = None
        self.final = False

    def __call__(self, response: Response | None, final: bool) -> None:
        if self.final:
            raise pb_utils.TritonModelException("Unable to send response: the final response was already sent")
        if response is not None and self.response is not None:
            raise pb_utils.TritonModelException("Non-decoupled model cannot send more than one response")
        if not final:
            raise pb_utils.TritonModelException(
                "Non-decoupled model must send its response with TRITONSERVER_RESPONSE_COMPLETE_FINAL")
        self.response = response if response is not None else self.response
        self.final = True

    def result(self) -> Response:
        if self.response is None:
            return Response(error="execute() returned None and sent no response for the request", status=500)
        return self.response


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
        runtime.set_model_dir(str(ctx.model_dir))
        self.bls = Bls(ctx.server_id)
        runtime.set_executor(self.bls)
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
            # As Triton: the instance's GPU among the server's visible devices, which the worker
            # sees too, so torch.device(f"cuda:{id}") in a Triton model.py is its own GPU.
            "model_instance_device_id": str(ictx.device_id),
            "model_repository": str(self.ctx.model_dir),
            "model_version": str(self.ctx.version),
            "model_name": self.ctx.name,
        }
        on_gpu = ictx.kind == "GPU" and _select_gpu(ictx.device_id)
        if hasattr(model, "initialize"):
            model.initialize(args)
        if ictx.kind == "GPU" and not on_gpu:  # torch imported by initialize() itself
            on_gpu = _select_gpu(ictx.device_id)
        instance = PythonInstance(model, self.ctx, ictx.name, EventLoop(
            (lambda: _select_gpu(ictx.device_id)) if on_gpu else None))
        instance.device_inputs = on_gpu and not _force_cpu_inputs(self.ctx.config)
        instance.copy_inputs = not _read_only_inputs(self.ctx.config)
        return instance


class PythonInstance(Instance):
    copy_inputs = True  # each request's host inputs are the model's own copies (see convert.input_tensor)

    def __init__(self, model: Any, ctx: ModelContext, name: str, loop: EventLoop) -> None:
        self.model = model
        self.ctx = ctx
        self.name = name
        self.loop = loop  # for ``async def execute``
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(ctx.config)

    def execute(self, requests: list[Request]) -> list[Response]:
        replies = [] if self.decoupled else [Reply() for _ in requests]
        pb_requests = self._pb_requests(requests, replies)
        results = self.model.execute(pb_requests)
        if type(results) is not list and inspect.isawaitable(results):  # async def execute (e.g. BLS async_exec)
            if self.decoupled:
                senders = [r.sender for r in requests]
                self.loop.start(results, lambda e: self._fail_streams(senders, e))
                return []  # its responses go through the senders while the worker takes more requests
            results = self.loop.run(results)
        if self.decoupled:
            return []  # its responses went through the senders
        if results is None:  # it answered through its response senders
            return [reply.result() for reply in replies]
        if len(results) != len(requests):
            raise RuntimeError(f"execute() returned {len(results)} responses for {len(requests)} requests")
        return [to_response(r) for r in results]

    def _pb_requests(self, requests: list[Request], replies: list[Reply]) -> list[Any]:
        """The requests as pb_utils objects, each with its response sender: to its stream for a
        decoupled model, else to its entry of ``replies``."""
        name = self.ctx.name
        copy_inputs = self.copy_inputs
        incoming = pb_utils.InferenceRequest._incoming
        # An input read from a client's region is already the worker's own copy (the read was the
        # copy): given as it is.
        pb_requests = [incoming(name, [input_tensor(n, arr, copy_inputs, n in r.own_inputs)
                                       for n, arr in r.inputs.items()], r)
                       for r in requests]
        for r, pb in zip(requests, pb_requests):
            pb._cancel = r.cancel
        if replies:
            for r, pb, reply in zip(requests, pb_requests, replies):
                pb._response_sender = ResponseSender(reply, r.cancel)
        else:
            for r, pb in zip(requests, pb_requests):
                if r.sender is not None:
                    pb._response_sender = ResponseSender(r.sender, r.cancel)
        return pb_requests

    def _fail_streams(self, senders: list[Any], e: BaseException) -> None:
        """A decoupled model's coroutine raised: each of its requests not yet finished ends with
        the error, as when a synchronous execute raises (workers/worker.py)."""
        msg = f"Failed to process the request(s) for model instance '{self.name}', message: {type(e).__name__}: {e}"
        log.error("%s\n%s", msg, "".join(traceback.format_exception(e)))
        for sender in senders:
            sender.fail(500, msg)

    def finalize(self) -> None:
        self.loop.close()
        if hasattr(self.model, "finalize"):
            self.model.finalize()


def _select_gpu(device_id: int) -> bool:
    """Make the instance's GPU the current device of a model that uses torch (a bare ``.cuda()``
    then lands there); whether torch can use the GPU, so that inputs may stay on it."""
    if "torch" not in sys.modules:
        return False
    torch = sys.modules["torch"]
    if not torch.cuda.is_available():
        return False
    torch.cuda.set_device(device_id)
    return True


def _force_cpu_inputs(config: dict[str, Any]) -> bool:
    """Triton's ``FORCE_CPU_ONLY_INPUT_TENSORS`` parameter (default "yes"): with "no", a GPU
    instance gets inputs that lie in a client's CUDA region as GPU tensors."""
    value = (config.get("parameters") or {}).get("FORCE_CPU_ONLY_INPUT_TENSORS") or {}
    return str(value.get("string_value", "yes")).strip().lower() not in ("no", "false", "0", "off")


def _read_only_inputs(config: dict[str, Any]) -> bool:
    """The ``READ_ONLY_INPUTS`` parameter (shmserve's own, default "no"): with "yes", host inputs
    are read-only views over the client's shared memory instead of copies, for models that never
    write into their inputs and take large ones."""
    value = (config.get("parameters") or {}).get("READ_ONLY_INPUTS") or {}
    return str(value.get("string_value", "no")).strip().lower() in ("yes", "true", "1", "on")
