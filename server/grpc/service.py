"""Triton's ``inference.GRPCInferenceService`` on the broker channel.

Each RPC is the broker control operation the HTTP frontend sends for the same endpoint
(server/frontend/app.py), with the answer turned into its protobuf; ModelInfer goes through
infer.py. Errors carry the broker's (Triton's) messages, with the gRPC code Triton gives them.
"""
from __future__ import annotations

import base64
import logging
import re
from contextlib import aclosing
from typing import Any, AsyncIterator, NoReturn
from urllib.parse import unquote

import grpc
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from shmserve.server import __version__
from shmserve.server.edge.link import BrokerError, BrokerLink
from shmserve.server.edge.metadata import EXTENSIONS, NAMED_REPOSITORY
from shmserve.server.edge.shm_callers import ShmRefused, registering_caller, unregistering_caller
from shmserve.server.shm_caller import ADMIN_GROUP
from shmserve.shm import control_messages as control, logs

from .handlers import refuse
from .infer import GrpcInference, check_version
from .restricted import PASSED_GROUP
from .status import Aborted, code_of
from .stream import StreamRun
from .requests import param_value

log = logging.getLogger("shmserve.grpc")
Context = grpc.aio.ServicerContext


def peer_address(peer: str) -> tuple[str, int | None]:
    """(host, port) of a gRPC peer string: ``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``, which
    grpcio percent-encodes (``ipv6:%5B::1%5D:5000``), or a Unix socket (``unix:/path``,
    ``unix-abstract:name``: this host, no port). ('', None) for a form it does not know."""
    kind, _, rest = unquote(peer).partition(":")
    if kind in ("unix", "unix-abstract"):
        return "localhost", None
    if kind not in ("ipv4", "ipv6"):
        return "", None
    host, _, port = rest.rpartition(":")
    if kind == "ipv6":
        host = host.removeprefix("[").removesuffix("]")
    return host, int(port) if port.isdigit() else None


class InferenceService(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, server_id: str, link: BrokerLink, inference: GrpcInference, allow_remote_shm: bool) -> None:
        self.server_id = server_id
        self.link = link
        self.inference = inference
        self.allow_remote_shm = allow_remote_shm

    async def _control(self, message: control.ControlMessage, context: Context) -> Any:
        """The broker's answer to a control message; an error answer aborts the call."""
        try:
            status, answer = await self.link.control(message)
        except BrokerError as e:
            await _abort(context, e.status, str(e))
        if status != 200:
            await _abort(context, status, (answer or {}).get("error", "the request failed"))
        return answer

    # -- health and metadata --------------------------------------------------------------------
    async def ServerLive(self, request: Any, context: Context) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Context) -> Any:
        return pb.ServerReadyResponse(ready=await self.server_ready())

    async def server_ready(self) -> bool:
        try:
            _, answer = await self.link.control(control.ServerReady())
        except BrokerError:
            return False
        return bool(answer.get("ready"))

    async def ModelReady(self, request: Any, context: Context) -> Any:
        version = check_version(request.version)  # Triton reads the version first, whatever the model
        answer = await self._control(control.ModelReady(request.name, version), context)
        return pb.ModelReadyResponse(ready=bool(answer.get("ready")))

    async def ServerMetadata(self, request: Any, context: Context) -> Any:
        return pb.ServerMetadataResponse(name=self.server_id, version=__version__, extensions=EXTENSIONS)

    async def ModelMetadata(self, request: Any, context: Context) -> Any:
        version = check_version(request.version)  # Triton reads the version first, whatever the model
        answer = await self._control(control.ModelMetadata(request.name, version), context)
        return json_format.ParseDict(answer, pb.ModelMetadataResponse(), ignore_unknown_fields=True)

    async def ModelConfig(self, request: Any, context: Context) -> Any:
        version = check_version(request.version)  # Triton reads the version first, whatever the model
        answer = await self._control(control.ModelConfig(request.name, version), context)
        try:
            config = json_format.ParseDict(answer, model_config_pb2.ModelConfig(), ignore_unknown_fields=True)
        except json_format.ParseError as e:
            await _abort(context, 500, f"the configuration of '{request.name}' does not fit the ModelConfig "
                                       f"message: {e}")
        return pb.ModelConfigResponse(config=config)

    async def ModelStatistics(self, request: Any, context: Context) -> Any:
        version = check_version(request.version)  # Triton reads the version first, whatever the model
        answer = await self._control(control.ModelStatistics(request.name, version), context)
        return json_format.ParseDict(answer, pb.ModelStatisticsResponse(), ignore_unknown_fields=True)

    # -- repository API -------------------------------------------------------------------------
    async def RepositoryIndex(self, request: Any, context: Context) -> Any:
        if request.repository_name:
            await _abort(context, 501, NAMED_REPOSITORY)
        answer = await self._control(control.RepositoryIndex(request.ready), context)
        return json_format.ParseDict({"models": answer}, pb.RepositoryIndexResponse(), ignore_unknown_fields=True)

    async def RepositoryModelLoad(self, request: Any, context: Context) -> Any:
        if request.repository_name:
            await _abort(context, 501, NAMED_REPOSITORY)
        params = {}
        for key, p in request.parameters.items():
            kind = _LOAD_PARAM_KINDS.get(key, "bytes_param" if key.startswith("file:") else None)
            if kind is None:  # Triton's texts
                await _abort(context, 400, f"unrecognized load parameter '{key}'.")
            if p.WhichOneof("parameter_choice") != kind:
                await _abort(context, 400, f"invalid value type for load parameter '{key}', expected {kind}.")
            value = param_value(p)
            # file contents travel as base64 strings to the broker, as over HTTP
            params[key] = base64.b64encode(value).decode() if isinstance(value, bytes) else value
        # whether it may load 'file:' contents (server/broker/control.py)
        call = control.LoadModel(request.model_name, params,
                                 from_network="key" if PASSED_GROUP.get() == "model-repository" else "open")
        await self._control(call, context)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, context: Context) -> Any:
        if request.repository_name:
            await _abort(context, 501, NAMED_REPOSITORY)
        params = {key: param_value(p) for key, p in request.parameters.items()}
        dependents = request.parameters.get("unload_dependents")
        if dependents is not None and dependents.WhichOneof("parameter_choice") != "bool_param":
            await _abort(context, 400, "invalid value type for 'unload_dependents' parameter, expected bool_param.")
        await self._control(control.UnloadModel(request.model_name, params), context)
        return pb.RepositoryModelUnloadResponse()

    # -- shared memory --------------------------------------------------------------------------
    async def _registering(self, context: Context, kind: str) -> control.NetworkCaller:
        """Who registers (server/edge/shm_callers.py); a peer that may not is refused."""
        try:
            return await registering_caller(kind, *peer_address(context.peer()), None, self.allow_remote_shm,
                                            PASSED_GROUP.get() == ADMIN_GROUP)
        except ShmRefused as e:
            await _abort(context, e.status, str(e))

    async def _unregistering(self, context: Context) -> control.NetworkCaller:
        return await unregistering_caller(*peer_address(context.peer()), None, PASSED_GROUP.get() == ADMIN_GROUP)

    async def SystemSharedMemoryStatus(self, request: Any, context: Context) -> Any:
        answer = await self._control(control.SystemRegionStatus(request.name or None), context)
        resp = pb.SystemSharedMemoryStatusResponse()
        for r in answer:
            json_format.ParseDict(r, resp.regions[r["name"]], ignore_unknown_fields=True)
        return resp

    async def SystemSharedMemoryRegister(self, request: Any, context: Context) -> Any:
        caller = await self._registering(context, "system")
        await self._control(control.RegisterSystemRegion(request.name, request.key, request.byte_size, request.offset,
                                                         caller), context)
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request: Any, context: Context) -> Any:
        await self._control(control.UnregisterSystemRegion(request.name or None, await self._unregistering(context)),
                            context)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request: Any, context: Context) -> Any:
        answer = await self._control(control.CudaRegionStatus(request.name or None), context)
        resp = pb.CudaSharedMemoryStatusResponse()
        for r in answer:
            json_format.ParseDict(r, resp.regions[r["name"]], ignore_unknown_fields=True)
        return resp

    async def CudaSharedMemoryRegister(self, request: Any, context: Context) -> Any:
        caller = await self._registering(context, "CUDA")
        await self._control(control.RegisterCudaRegion(request.name, base64.b64encode(request.raw_handle).decode(),
                                                       request.byte_size, request.device_id, caller), context)
        return pb.CudaSharedMemoryRegisterResponse()

    async def CudaSharedMemoryUnregister(self, request: Any, context: Context) -> Any:
        await self._control(control.UnregisterCudaRegion(request.name or None, await self._unregistering(context)),
                            context)
        return pb.CudaSharedMemoryUnregisterResponse()

    # -- logging and trace extensions -----------------------------------------------------------
    async def LogSettings(self, request: Any, context: Context) -> Any:
        """No settings: the current ones; else change those given (applied here at once, by
        the other processes from the broker's published copy, as over HTTP)."""
        update = {k: param_value(v) for k, v in request.settings.items()} if len(request.settings) else None
        if update is not None:
            refusal = _log_setting_refusal(update)
            if refusal:
                raise Aborted(grpc.StatusCode.INVALID_ARGUMENT, refusal)
        answer = await self._control(control.LogSettings(update), context)
        if update is not None:
            logs.follow(answer)
        resp = pb.LogSettingsResponse()
        for key, value in answer.items():
            setting = resp.settings[key]
            if isinstance(value, bool):
                setting.bool_param = value
            elif isinstance(value, int):
                setting.uint32_param = value
            else:
                setting.string_param = "" if value is None else str(value)
        return resp

    async def TraceSetting(self, request: Any, context: Context) -> Any:
        """Triton's trace settings: an empty value list clears a setting (null over HTTP)."""
        update: dict[str, Any] | None = None
        if len(request.settings):
            update = {}
            for key, v in request.settings.items():
                values = list(v.value)
                refusal = _trace_number_refusal(key, values)
                if refusal:
                    raise Aborted(grpc.StatusCode.INVALID_ARGUMENT, refusal)
                update[key] = None if not values else values[0] if len(values) == 1 else values
        answer = await self._control(control.TraceSettings(request.model_name, update), context)
        if update is not None:
            self.inference.tracer.refresh()  # this frontend follows at once, the others on their tick
        resp = pb.TraceSettingResponse()
        for key, value in answer.items():
            values = value if isinstance(value, list) else [] if value is None else [value]
            resp.settings[key].value.extend(str(x) for x in values)
        return resp

    # -- inference ------------------------------------------------------------------------------
    async def ModelInfer(self, request: Any, context: Context) -> Any:
        return await self.inference.infer(request, context)  # an Aborted is the call's status (handlers.py)

    async def ModelStreamInfer(self, request_iterator: Any, context: Context) -> AsyncIterator[Any]:
        """Requests on one stream run side by side, each submitted as it is read and answered as
        it ends, as in Triton (stream.py). An error is an ``error_message`` and the stream goes
        on, or, for a client that opened the stream with the ``triton_grpc_error: true`` header,
        the status that ends the stream, as Triton does; a message that is not a
        ModelInferRequest is such an error (INVALID_ARGUMENT).
        Messages are read with ``context.read`` rather than ``request_iterator``, whose generator
        would hold the last request (up to the message limit) while the stream waits."""
        grpc_error = ("triton_grpc_error", "true") in (context.invocation_metadata() or ())
        run = StreamRun(self.inference, context, self.inference.metadata_params(context))
        async with aclosing(run.messages()) as messages:
            async for message in messages:
                if isinstance(message, Aborted):
                    if grpc_error:
                        refuse(context, message.code, str(message))
                        return
                    message = pb.ModelStreamInferResponse(error_message=str(message), infer_response=message.head)
                yield message


async def _abort(context: Context, status: int, message: str) -> NoReturn:
    """End the call with the code of the broker's ``status`` (handlers.py sends it)."""
    raise Aborted(code_of(status), message)


# The load parameters Triton takes, and the type of each ('file:<path>' ones are bytes_param).
_LOAD_PARAM_KINDS = {"config": "string_param"}
# Triton's gRPC log settings: the parameter type each takes.
_LOG_SETTING_TYPES = {"log_info": (bool, "boolean"), "log_warning": (bool, "boolean"), "log_error": (bool, "boolean"),
                      "log_verbose_level": (int, "int32"), "log_format": (str, "string")}
_TRACE_NUMBERS = ("trace_rate", "trace_count", "log_frequency")
_LEADING_INTEGER = re.compile(r"\s*[+-]?\d")


def _log_setting_refusal(update: dict[str, Any]) -> str | None:
    """Triton's gRPC words for a log setting of the wrong parameter type or an unknown format
    (the broker checks the rest, as for HTTP)."""
    for key, value in update.items():
        kind = _LOG_SETTING_TYPES.get(key)
        if kind is None:
            continue
        if not isinstance(value, kind[0]) or (kind[0] is int and isinstance(value, bool)):
            return f"expect {kind[1]} for '{key}'"
        if key == "log_format" and value not in logs.FORMATS:
            return f"invalid argument for log_format, got: {value}"
    return None


def _trace_number_refusal(key: str, values: list[str]) -> str | None:
    """Triton's gRPC words for a numeric trace setting given more than one value, or one that
    does not start with an integer (its ``stoi``)."""
    if key not in _TRACE_NUMBERS:
        return None
    if len(values) > 1:
        return f"expect only 1 value for '{key}'"
    if values and not _LEADING_INTEGER.match(values[0]):
        return f"Unable to parse '{key}', got: {values[0]}"
    return None
