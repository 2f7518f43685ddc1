"""Triton's ``--grpc-restricted-protocol``: RPC groups that answer only calls whose metadata
carries ``triton-grpc-protocol-<key>: <value>``; any other call ends with UNAVAILABLE and
Triton's message before the servicer runs.

The groups are ``--http-restricted-api``'s (server/frontend/restricted.py parses both flags).
The interceptor is installed only when some group is restricted; then a call pays one dict
lookup of its method name, plus the metadata check when its group is restricted.
"""
from __future__ import annotations

import contextvars
from typing import Any, Awaitable, Callable

import grpc

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
LOAD = SERVICE + "RepositoryModelLoad"
# True while RepositoryModelLoad runs for a call that carried the restricted model-repository
# group's key: it may load 'file:' contents without --allow-model-file-uploads (service.py).
KEY_CHECKED: contextvars.ContextVar[bool] = contextvars.ContextVar("repository_key_checked", default=False)


def method_rules(restricted: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Full method name -> (metadata key, expected value) for each RPC of a restricted group."""
    rules: dict[str, tuple[str, str]] = {}
    for group, (key, value) in restricted.items():
        rule = (HEADER_PREFIX + key, value)
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
        if rule in (details.invocation_metadata or ()):
            return _key_checked(handler) if details.method == LOAD else handler
        return _refusal(handler, f"This protocol is restricted, expecting header '{rule[0]}'")


def _key_checked(handler: Any) -> Any:
    """``handler`` (a unary call's) with ``KEY_CHECKED`` set while it runs."""
    behavior = handler.unary_unary

    async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
        token = KEY_CHECKED.set(True)
        try:
            return await behavior(request, context)
        finally:
            KEY_CHECKED.reset(token)

    return grpc.unary_unary_rpc_method_handler(checked, request_deserializer=handler.request_deserializer,
                                               response_serializer=handler.response_serializer)


def _refusal(handler: Any, message: str) -> Any:
    """A handler of ``handler``'s kind that ends the call with Triton's status and message."""
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, message)

    make = grpc.stream_stream_rpc_method_handler if handler.request_streaming else grpc.unary_unary_rpc_method_handler
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
