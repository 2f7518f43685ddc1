"""How the gRPC services' handlers are registered: a request message that does not parse, and a
call a handler refuses, are answered with a status without keeping the request's memory.

grpcio's generated ``add_..._to_server`` registers handlers whose deserializer raises on a
malformed message: the call then ends with UNKNOWN and an error logged with its traceback. Here
each deserializer returns a ``Malformed`` instead, which a unary call answers with
INVALID_ARGUMENT and ModelStreamInfer answers as one refused request of its stream.

A handler refuses a call by raising ``Aborted`` (status.py), which the unary wrapper turns into
the call's code and details. grpcio's own ``context.abort`` keeps its exception in the call's
state, and the exception's traceback holds the handler's frames and so the request: a cycle that
only the garbage collector frees, so a few refused 300 MB messages used to stay in memory.

A unary method given ``ReceiveSlots`` (receiving.py: ModelInfer) is registered as stream-unary,
the same on the wire, so that it reads its message itself, under those slots, rather than grpc
reading it before the handler runs.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from .receiving import ReceiveSlots
from .status import Aborted


class Malformed:
    """A request message that did not parse; ``message`` says so, naming the expected type."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def lenient(parse: Callable[[bytes], Any], type_name: str) -> Callable[[bytes], Any]:
    """``parse``, answering a ``Malformed`` where it raises ``DecodeError``."""
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError:
            return Malformed(f"the request is not a valid {type_name} message")
    return deserialize


def refuse(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """End the call with ``code`` once its handler returns: grpcio sends the status it has set."""
    context.set_code(code)
    context.set_details(message)


def _unary(behavior: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if type(request) is Malformed:
            refuse(context, grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return None
        try:
            return await behavior(request, context)
        except Aborted as e:
            code, message = e.code, str(e)
        refuse(context, code, message)  # the exception (and the frames it holds) is gone by now
        return None
    return call


def _reading(behavior: Callable[[Any, Any], Awaitable[Any]],
             slots: ReceiveSlots) -> Callable[[Any, Any], Awaitable[Any]]:
    """A unary ``behavior`` (``_unary``'s) as a stream-unary one that reads its one message under ``slots``."""
    async def call(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = await slots.receive(context)
        except Aborted as e:
            code, message = e.code, str(e)
        else:
            return await behavior(request, context)
        refuse(context, code, message)
        return None
    return call


def passing_bytes(serialize: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    """``serialize``, except for a response already serialized (responses.py), sent as it is."""
    def serializer(message: Any) -> bytes:
        return message if type(message) is bytes else serialize(message)
    return serializer


def _type_name(parse: Callable[[bytes], Any]) -> str:
    owner = getattr(parse, "__self__", None)  # FromString is a class method of the message type
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", "request")


def _wrapped(handler: grpc.RpcMethodHandler, parse: Callable[[bytes], Any] | None = None,
             slots: ReceiveSlots | None = None) -> grpc.RpcMethodHandler:
    """``handler`` with a lenient deserializer and a serializer that passes serialized responses;
    a unary-unary one also answers ``Malformed`` and ``Aborted`` itself (streaming handlers see
    the ``Malformed`` and answer it as they answer errors). ``parse``: reads the request in place
    of the generated deserializer; ``slots``: a unary one reads its message under them."""
    generated = handler.request_deserializer
    changes: dict[str, Any] = {}
    if generated is not None:
        changes["request_deserializer"] = lenient(parse or generated, _type_name(generated))
    if handler.unary_unary is not None and slots is not None:
        changes.update(unary_unary=None, request_streaming=True,
                       stream_unary=_reading(_unary(handler.unary_unary), slots))
    elif handler.unary_unary is not None:
        changes["unary_unary"] = _unary(handler.unary_unary)
    if handler.response_serializer is not None:
        changes["response_serializer"] = passing_bytes(handler.response_serializer)
    return handler._replace(**changes)  # type: ignore[attr-defined]


class _Registration:
    """Stands in for the server while generated code registers a servicer: keeps its handlers."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same handlers come again by name just after

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.service, self.handlers = service, handlers


def add_servicer(server: grpc.aio.Server, add_to_server: Callable[[Any, Any], None], servicer: Any,
                 parsers: dict[str, Callable[[bytes], Any]] | None = None,
                 receiving: dict[str, ReceiveSlots] | None = None) -> None:
    """Register ``servicer`` as the generated ``add_to_server`` would, each handler ``_wrapped``;
    ``parsers``: a method's own request reader, by method name; ``receiving``: the slots a unary
    method's message is read under, by method name."""
    registration = _Registration()
    add_to_server(servicer, registration)
    if not registration.handlers:
        raise RuntimeError(f"{add_to_server.__name__} registered no method handlers by name")
    handlers = {name: _wrapped(h, (parsers or {}).get(name), (receiving or {}).get(name))
                for name, h in registration.handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(registration.service, handlers),))
    server.add_registered_method_handlers(registration.service, handlers)
