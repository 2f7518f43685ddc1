"""Triton's Python backend: ``model.py`` with ``TritonPythonModel``, unchanged.

The worker process plays the part of Triton's Python stub: it imports ``model.py`` with our
``triton_python_backend_utils`` installed under that name, hands it ``pb_utils.InferenceRequest``
objects whose tensors are the model's own (copies, as Triton's stub holds them, or from 2 MiB
private copy-on-write views, workers/input_views.py; read-only views with the READ_ONLY_INPUTS
parameter), and reads back its responses, returned by ``execute``
or sent through the requests' response senders. An ``async def execute`` runs on the instance's
event loop (event_loop.py).
"""
from __future__ import annotations

import asyncio
import importlib.machinery
import importlib.util
import inspect
import logging
import sys
import traceback
import weakref
from pathlib import Path
from types import ModuleType
from typing import Any

from shmserve.config_view import model_config_json

from ..backend import Backend, Instance, InstanceContext, Model, ModelContext, Request, Response
from ..failure import execute_failure
from ..late_answers import Deferred
from . import pb_utils
from .bls import Bls
from .convert import input_tensor, to_response
from .event_loop import EventLoop
from .pb_utils import runtime
from .sender import Reply, ResponseSender

log = logging.getLogger("shmserve.worker")

MODULE_NAME = "triton_python_backend_utils"


def _install_pb_utils() -> None:
    sys.modules.setdefault(MODULE_NAME, pb_utils)


def _import_model(ctx: ModelContext) -> ModuleType:
    """The model's module, imported as Triton's stub imports it: as ``<version>.<file>`` (so
    ``from .helper import x`` finds ``1/helper.py``), with the version folder and the model
    folder appended to the path (so ``import helper`` finds either folder's)."""
    filename = ctx.config.get("default_model_filename") or "model.py"
    path = ctx.version_dir / filename
    for folder in (str(ctx.version_dir), str(ctx.model_dir)):
        if folder not in sys.path:
            sys.path.append(folder)
    package = ctx.version_dir.name
    if package not in sys.modules:  # the version folder as a package of its own (no __init__.py needed)
        holder = ModuleType(package)
        holder.__path__ = [str(ctx.version_dir)]  # type: ignore[attr-defined]
        sys.modules[package] = holder
    name = f"{package}.{Path(filename).stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = sys.modules["model"] = module
    _write_bytecode(spec.loader, name)
    spec.loader.exec_module(module)
    if not hasattr(module, "TritonPythonModel"):
        raise AttributeError(f"{path} does not define class TritonPythonModel")
    return module


def _write_bytecode(loader: Any, name: str) -> None:
    """Write the model file's bytecode (``<version>/__pycache__``) as Triton's stub does, whatever
    PYTHONDONTWRITEBYTECODE says: the first load of a version so writes into its folder, which the
    next load without a config sees, as Triton's does (server/broker/load_stamp.py). A folder that
    cannot be written is left alone, as by Python's own import."""
    if not isinstance(loader, importlib.machinery.SourceFileLoader):
        return
    before, sys.dont_write_bytecode = sys.dont_write_bytecode, False
    try:
        loader.get_code(name)
    except Exception:  # noqa: BLE001 - exec_module raises it again, as the import's own error
        pass
    finally:
        sys.dont_write_bytecode = before


class ExecuteContract(Exception):
    """What a model's ``execute`` returned breaks the backend's contract (Triton's words)."""


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
        if not isinstance(completed, pb_utils.ModelConfig):  # Triton's refusal of the load
            raise pb_utils.TritonModelException(f"auto_complete_config function in model '{ctx.name}' must return "
                                                f"a valid pb.ModelConfig object.")
        return completed.as_dict()

    def create_model(self, ctx: ModelContext) -> Model:
        runtime.set_model_dir(str(ctx.version_dir))  # as Triton's: the folder model.py lies in
        self.bls = Bls(ctx.server_id)
        runtime.set_executor(self.bls)
        return PythonModel(self._model_module(ctx), ctx)

    def finalize(self) -> None:
        bls = getattr(self, "bls", None)
        if bls is not None:
            bls.close()


def _instance_kind(config: dict[str, Any], ictx: InstanceContext) -> str:
    """The kind Triton's Python backend tells a model its instance has: its group's, so an
    instance of a KIND_MODEL group is "MODEL" though it runs as a CPU instance does."""
    if ictx.kind == "CPU":
        for group in config.get("instance_group") or []:
            count = int(group.get("count") or 1)
            if group.get("kind") == "KIND_MODEL" and ictx.name in {f"{group.get('name')}_{k}" for k in range(count)}:
                return "MODEL"
    return ictx.kind


class PythonModel(Model):
    def __init__(self, module: ModuleType, ctx: ModelContext) -> None:
        self.module = module
        self.ctx = ctx

    def create_instance(self, ictx: InstanceContext) -> Instance:
        model = self.module.TritonPythonModel()
        args = {
            "model_config": model_config_json(self.ctx.config),  # completed and normalized, as Triton's
            "model_instance_kind": _instance_kind(self.ctx.config, ictx),
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
        instance.writable_inputs = instance.copy_inputs and not instance.decoupled
        return instance


class PythonInstance(Instance):
    copy_inputs = True  # each request's host inputs are the model's own copies (see convert.input_tensor)

    def __init__(self, model: Any, ctx: ModelContext, name: str, loop: EventLoop) -> None:
        self.model = model
        self.ctx = ctx
        self.name = name
        self.loop = loop  # for ``async def execute``
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(ctx.config)

    def readiness_check(self) -> Any:
        """``is_ready()`` when the model defines it (sync or ``async def``; an async one runs on
        an event loop of the readiness thread's own, not on the execution's)."""
        if not hasattr(self.model, "is_ready"):
            return None

        def check() -> Any:
            answer = self.model.is_ready()
            return asyncio.run(answer) if inspect.iscoroutine(answer) else answer
        return check

    def execute(self, requests: list[Request]) -> list[Response | Deferred]:
        """The requests' responses; for a non-decoupled model's request still to be answered
        through its sender (``execute`` returned None, or None in its place in the list), the
        Deferred the worker keeps it under (workers/late_answers.py)."""
        replies = [] if self.decoupled else [Reply() for _ in requests]
        pb_requests = self._pb_requests(requests, replies)
        senders = [pb._response_sender for pb in pb_requests]
        try:
            results = self.model.execute(pb_requests)
            if type(results) is not list and inspect.isawaitable(results):  # async def execute (e.g. BLS async_exec)
                if self.decoupled:
                    streams = [r.sender for r in requests]
                    self.loop.start(results, lambda e: self._fail_streams(streams, senders, e))
                    return []  # its responses go through the senders while the worker takes more requests
                results = self.loop.run(results)
            if self.decoupled:
                if results is not None:  # (its responses would be lost, and its clients wait for good)
                    raise ExecuteContract(f"Python model '{self.name}' is using the decoupled mode and the "
                                          f"execute function must return None.")
                return []  # its responses went through the senders
            answers = self._answers(results, replies, senders)
        except (Exception, KeyboardInterrupt, SystemExit) as e:  # noqa: BLE001 - model code may raise anything
            for sender in senders:
                if sender is not None:
                    sender.close()
            if any(reply.done for reply in replies):
                return self._failed(e, replies)
            raise  # the worker answers every request with the error
        for pb, answer in zip(pb_requests, answers):
            children = pb._trace._children if pb._trace is not None else None
            if children and isinstance(answer, Response):  # a traced request's BLS calls (bls.py)
                answer.steps = tuple(children)
            if isinstance(answer, Deferred):
                # Once the model holds neither the request nor its sender, no final flag can come.
                weakref.finalize(pb._response_sender, answer.abandon)
        return answers

    def _answers(self, results: Any, replies: list[Reply], senders: list[ResponseSender]) -> list[Response | Deferred]:
        """What a non-decoupled ``execute`` gave: None (every request answers through its
        sender), or one entry per request, None for those that do (Triton's stub alike)."""
        if results is None:
            return [reply.answer() for reply in replies]
        if type(results) is not list:  # Triton's words, each
            raise ExecuteContract(f"Expected a list in the execute return, found type '{type(results)}'.")
        if len(results) != len(replies):
            raise ExecuteContract(f"Number of InferenceResponse objects do not match the number of InferenceRequest "
                                  f"objects. InferenceRequest(s) size is:{len(replies)}, and InferenceResponse(s) "
                                  f"size is:{len(results)}\n")  # (Triton's line end too)
        answers: list[Response | Deferred] = []
        for result, reply, sender in zip(results, replies, senders):
            if result is None:
                answers.append(reply.answer())
            elif not isinstance(result, pb_utils.InferenceResponse):
                raise ExecuteContract(f"Expected an 'InferenceResponse' object in the execute function return list, "
                                      f"found type '{type(result)}'.")
            else:
                sender.returned()  # refused if the sender already sent a response
                answers.append(to_response(result))
        return answers

    def _failed(self, e: BaseException, replies: list[Reply]) -> list[Response | Deferred]:
        """``execute`` raised after some requests had their final response: those keep it (Triton
        sent it already) and the others get the error the worker gives when ``execute`` raises."""
        msg = self.failure(self.name, e)
        log.error("%s\n%s", msg, "".join(traceback.format_exception(e)))
        return [reply.response if reply.done and reply.response is not None else Response(error=msg, status=500)
                for reply in replies]

    def _pb_requests(self, requests: list[Request], replies: list[Reply]) -> list[Any]:
        """The requests as pb_utils objects, each with its response sender: to its stream for a
        decoupled model, else to its entry of ``replies``."""
        name = self.ctx.name
        copy_inputs = self.copy_inputs
        incoming = pb_utils.InferenceRequest._incoming
        # An input read from a client's region (the read was the copy), or given as a private view,
        # is already the worker's own: given as it is.
        pb_requests = [incoming(name, [input_tensor(n, arr, copy_inputs, n in r.own_inputs)
                                       for n, arr in r.inputs.items()], r)
                       for r in requests]
        for r, pb in zip(requests, pb_requests):
            pb._cancel = r.cancel
        if replies:
            for r, pb, reply in zip(requests, pb_requests, replies):
                pb._response_sender = ResponseSender(reply, r.cancel, False)
        else:
            for r, pb in zip(requests, pb_requests):
                if r.sender is not None:
                    pb._response_sender = ResponseSender(r.sender, r.cancel, True)
        return pb_requests

    def _fail_streams(self, streams: list[Any], senders: list[Any], e: BaseException) -> None:
        """A decoupled model's coroutine raised: each of its requests not yet finished ends with
        the error, as when a synchronous execute raises (workers/worker.py), and its senders
        take nothing more."""
        msg = self.failure(self.name, e)
        log.error("%s\n%s", msg, "".join(traceback.format_exception(e)))
        for sender in senders:
            if sender is not None:
                sender.close()
        for stream in streams:
            stream.fail(500, msg)

    def failure(self, name: str, e: BaseException) -> str:
        if isinstance(e, ExecuteContract):  # the backend's own words, as Triton's stub says them
            return f"Failed to process the request(s) for model '{name}', message: {e}"
        return execute_failure(name, e)

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
