"""Triton's ``inference.GRPCInferenceService`` on the broker channel.

Each RPC is the broker control operation the HTTP frontend sends for the same endpoint
(server/frontend/app.py), with the answer turned into its protobuf; ModelInfer goes through
infer.py. Errors carry the broker's (Triton's) messages, with the gRPC code Triton gives them.
"""
from __future__ import annotations

import base64
import logging
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, NoReturn

import grpc
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from shmserve.server import __version__
from shmserve.server.frontend.link import BrokerError, BrokerLink
from shmserve.server.frontend.metadata import EXTENSIONS, is_loopback
from shmserve.shm import logs
from shmserve.shm.protocol import LOAD_FROM_NETWORK

from .infer import Aborted, GrpcInference
from .restricted import KEY_CHECKED
from .status import code_of
from .tensors import param_value

log = logging.getLogger("shmserve.grpc")
Context = grpc.aio.ServicerContext


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``, ``unix:...``)."""
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return "localhost"
    if kind == "ipv6":
        return rest.rpartition("]")[0].lstrip("[")
    return rest.rpartition(":")[0]


class InferenceService(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, server_id: str, link: BrokerLink, inference: GrpcInference, allow_remote_shm: bool) -> None:
        self.server_id = server_id
        self.link = link
        self.inference = inference
        self.allow_remote_shm = allow_remote_shm

    async def _control(self, doc: dict, context: Context) -> Any:
        """The broker's answer to a control operation; an error answer aborts the call."""
        try:
            status, answer = await self.link.control(doc)
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
            _, answer = await self.link.control({"op": "server_ready"})
        except BrokerError:
            return False
        return bool(answer.get("ready"))

    async def ModelReady(self, request: Any, context: Context) -> Any:
        answer = await self._control({"op": "model_ready", "model": request.name, "version": request.version},
                                     context)
        return pb.ModelReadyResponse(ready=bool(answer.get("ready")))

    async def ServerMetadata(self, request: Any, context: Context) -> Any:
        return pb.ServerMetadataResponse(name=self.server_id, version=__version__, extensions=EXTENSIONS)

    async def ModelMetadata(self, request: Any, context: Context) -> Any:
        answer = await self._control({"op": "model_metadata", "model": request.name, "version": request.version},
                                     context)
        return json_format.ParseDict(answer, pb.ModelMetadataResponse(), ignore_unknown_fields=True)

    async def ModelConfig(self, request: Any, context: Context) -> Any:
        answer = await self._control({"op": "model_config", "model": request.name, "version": request.version},
                                     context)
        try:
            config = json_format.ParseDict(answer, model_config_pb2.ModelConfig(), ignore_unknown_fields=True)
        except json_format.ParseError as e:
            await _abort(context, 500, f"the configuration of '{request.name}' does not fit the ModelConfig "
                                       f"message: {e}")
        return pb.ModelConfigResponse(config=config)

    async def ModelStatistics(self, request: Any, context: Context) -> Any:
        answer = await self._control({"op": "model_stats", "model": request.name, "version": request.version},
                                     context)
        return json_format.ParseDict(answer, pb.ModelStatisticsResponse(), ignore_unknown_fields=True)

    # -- repository API -------------------------------------------------------------------------
    async def RepositoryIndex(self, request: Any, context: Context) -> Any:
        answer = await self._control({"op": "repository_index", "ready": request.ready}, context)
        return json_format.ParseDict({"models": answer}, pb.RepositoryIndexResponse(), ignore_unknown_fields=True)

    async def RepositoryModelLoad(self, request: Any, context: Context) -> Any:
        params = {}
        for key, p in request.parameters.items():
            value = param_value(p)
            # file contents travel as base64 strings to the broker, as over HTTP
            params[key] = base64.b64encode(value).decode() if isinstance(value, bytes) else value
        # whether it may load 'file:' contents (server/broker/control.py)
        call = {"op": "load", "model": request.model_name, "parameters": params,
                LOAD_FROM_NETWORK: "key" if KEY_CHECKED.get() else "open"}
        await self._control(call, context)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(self, request: Any, context: Context) -> Any:
        params = {key: param_value(p) for key, p in request.parameters.items()}
        await self._control({"op": "unload", "model": request.model_name, "parameters": params}, context)
        return pb.RepositoryModelUnloadResponse()

    # -- shared memory --------------------------------------------------------------------------
    async def _check_local(self, context: Context, kind: str) -> None:
        if not self.allow_remote_shm and not is_loopback(peer_host(context.peer())):
            await _abort(context, 403, f"registering {kind} shared memory is only allowed from this host "
                                       f"(start the server with --allow-remote-shm to change that)")

    async def SystemSharedMemoryStatus(self, request: Any, context: Context) -> Any:
        answer = await self._control({"op": "shm_status", "name": request.name or None}, context)
        resp = pb.SystemSharedMemoryStatusResponse()
        for r in answer:
            json_format.ParseDict(r, resp.regions[r["name"]], ignore_unknown_fields=True)
        return resp

    async def SystemSharedMemoryRegister(self, request: Any, context: Context) -> Any:
        await self._check_local(context, "system")
        await self._control({"op": "shm_register", "name": request.name, "key": request.key,
                             "offset": request.offset, "byte_size": request.byte_size}, context)
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request: Any, context: Context) -> Any:
        await self._control({"op": "shm_unregister", "name": request.name or None}, context)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request: Any, context: Context) -> Any:
        answer = await self._control({"op": "cuda_status", "name": request.name or None}, context)
        resp = pb.CudaSharedMemoryStatusResponse()
        for r in answer:
            json_format.ParseDict(r, resp.regions[r["name"]], ignore_unknown_fields=True)
        return resp

    async def CudaSharedMemoryRegister(self, request: Any, context: Context) -> Any:
        await self._check_local(context, "CUDA")
        await self._control({"op": "cuda_register", "name": request.name,
                             "raw_handle": base64.b64encode(request.raw_handle).decode(),
                             "device_id": request.device_id, "byte_size": request.byte_size}, context)
        return pb.CudaSharedMemoryRegisterResponse()

    async def CudaSharedMemoryUnregister(self, request: Any, context: Context) -> Any:
        await self._control({"op": "cuda_unregister", "name": request.name or None}, context)
        return pb.CudaSharedMemoryUnregisterResponse()

    # -- logging and trace extensions -----------------------------------------------------------
    async def LogSettings(self, request: Any, context: Context) -> Any:
        """No settings: the current ones; else change those given (applied here at once, by
        the other processes from the broker's published copy, as over HTTP)."""
        doc: dict[str, Any] = {"op": "log_settings"}
        if len(request.settings):
            doc["update"] = {k: param_value(v) for k, v in request.settings.items()}
        answer = await self._control(doc, context)
        if "update" in doc:
            logs.configure(answer)
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
        doc: dict[str, Any] = {"op": "trace_settings", "model": request.model_name}
        if len(request.settings):
            update: dict[str, Any] = {}
            for key, v in request.settings.items():
                values = list(v.value)
                update[key] = None if not values else values[0] if len(values) == 1 else values
            doc["update"] = update
        answer = await self._control(doc, context)
        if "update" in doc:
            self.inference.tracer.refresh()  # this frontend follows at once, the others on their tick
        resp = pb.TraceSettingResponse()
        for key, value in answer.items():
            values = value if isinstance(value, list) else [] if value is None else [value]
            resp.settings[key].value.extend(str(x) for x in values)
        return resp

    # -- inference ------------------------------------------------------------------------------
    async def ModelInfer(self, request: Any, context: Context) -> Any:
        try:
            return await self.inference.infer(request, context)
        except Aborted as e:
            await context.abort(e.code, str(e))


    async def ModelStreamInfer(self, request_iterator: Any, context: Context) -> AsyncIterator[Any]:
        """Requests on one stream are answered in the order they come, each to its end before
        the next starts (so a sequence's requests reach the model in order). Whether a model is
        decoupled is asked once per model and stream. An error is an ``error_message`` and the
        stream goes on, or, for a client that opened the stream with the ``triton_grpc_error:
        true`` header, the status that ends the stream, as Triton does. While tracing is on, the
        wait for each request and its read are timed (Triton's GRPC_WAITREAD_START and _END) for
        the trace it may get (infer.py)."""
        grpc_error = ("triton_grpc_error", "true") in (context.invocation_metadata() or ())
        decoupled: dict[tuple[str, str], bool] = {}
        tracer = self.inference.tracer
        waiting = time.monotonic_ns() if tracer.on else 0
        async for request in request_iterator:
            read = (waiting, time.monotonic_ns()) if waiting else (0, 0)
            key = (request.model_name, request.model_version)
            if key not in decoupled:
                decoupled[key] = await self.inference.decoupled(*key)
            async with aclosing(await self.inference.stream(request, decoupled[key], read)) as messages:
                async for message in messages:
                    if isinstance(message, Aborted):
                        if grpc_error:
                            await context.abort(message.code, str(message))
                        message = pb.ModelStreamInferResponse(error_message=str(message))
                    yield message
            waiting = time.monotonic_ns() if tracer.on else 0


async def _abort(context: Context, status: int, message: str) -> NoReturn:
    await context.abort(code_of(status), message)
    raise AssertionError("context.abort returns only by raising")
