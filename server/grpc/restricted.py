"""Triton's ``--grpc-restricted-protocol``: RPC groups that answer only calls whose metadata
carries ``triton-grpc-protocol-<key>: <value>``; any other call ends with UNAVAILABLE and
Triton's message before the servicer runs.

The groups are ``--http-restricted-api``'s (server/edge/restrictions.py parses both flags).
The interceptor is installed only when some group is restricted; then a call pays one dict
lookup of its method name, plus the metadata check when its group is restricted.
"""
from __future__ import annotations

import contextvars
from typing import Any, Awaitable, Callable

import grpc

from shmserve.server.shm_caller import ADMIN_GROUP

from .handlers import refuse

HEADER_PREFIX = "triton-grpc-protocol-"  # Triton's; gRPC metadata keys are lower case
SERVICE = "/inference.GRPCInferenceService/"

# Each RPC's group, as Triton's gRPC server assigns them (src/grpc/grpc_server.cc).
GROUPS: dict[str, tuple[str, ...]] = {
    "health": ("ServerLive", "ServerReady", "ModelReady"),
    "metadata": ("ServerMetadata", "ModelMetadata"),
    "inference": ("ModelInfer", "ModelStreamInfer"),
    "shared-memory": ("SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
                      "CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister"),
    "model-config": ("ModelConfig",),
    "model-repository": ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload"),
    "statistics": ("ModelStatistics",),
    "trace": ("TraceSetting",),
    "logging": ("LogSettings",),
}
HEALTH_CHECK = "/grpc.health.v1.Health/Check"  # in Triton's health group too

# The restricted group whose key the call being served carried (None: none was needed, or its
# group does not ask). Set around the servicer's own coroutine.
PASSED_GROUP: contextvars.ContextVar[str | None] = contextvars.ContextVar("restricted_group", default=None)
# The groups whose RPCs ask which key a call carried: an admin's shared-memory calls, and a load
# with 'file:' contents that the model-repository key allows (unless --allow-model-file-uploads).
ASKS_FOR_KEY = (ADMIN_GROUP, "model-repository")


def method_rules(restricted: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    """Full method name -> (metadata key, expected value, group) for each RPC of a restricted group."""
    rules: dict[str, tuple[str, str, str]] = {}
    for group, (key, value) in restricted.items():
        rule = (HEADER_PREFIX + key, value, group)
        for name in GROUPS[group]:
            rules[SERVICE + name] = rule
        if group == "health":
            rules[HEALTH_CHECK] = rule
    return rules


class RestrictedProtocols(grpc.aio.ServerInterceptor):
    def __init__(self, restricted: dict[str, Any]) -> None:
        self.rules = method_rules(restricted)

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        rule = self.rules.get(details.method)
        if rule is None or handler is None:
            return handler
        key, value, group = rule
        if (key, value) in (details.invocation_metadata or ()):
            return _admitted(handler, group) if group in ASKS_FOR_KEY else handler
        return _refusal(handler, f"This protocol is restricted, expecting header '{key}'")


def _admitted(handler: Any, group: str) -> Any:
    """``handler`` (a unary RPC's) run with ``PASSED_GROUP`` set to ``group``."""
    behaviour = handler.unary_unary

    async def admitted(request: Any, context: grpc.aio.ServicerContext) -> Any:
        token = PASSED_GROUP.set(group)
        try:
            return await behaviour(request, context)
        finally:
            PASSED_GROUP.reset(token)

    return grpc.unary_unary_rpc_method_handler(admitted, request_deserializer=handler.request_deserializer,
                                               response_serializer=handler.response_serializer)


def _refusal(handler: Any, message: str) -> Any:
    """A handler of ``handler``'s kind that ends the call with Triton's status and message."""
    async def refusal(request: Any, context: grpc.aio.ServicerContext) -> None:
        refuse(context, grpc.StatusCode.UNAVAILABLE, message)  # not context.abort: see handlers.py

    make = {(False, False): grpc.unary_unary_rpc_method_handler, (True, False): grpc.stream_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}[handler.request_streaming, handler.response_streaming]
    return make(refusal, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
