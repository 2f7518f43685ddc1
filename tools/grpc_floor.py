"""The floor of any Python gRPC frontend: grpcio's asyncio server, with the options of shmserve's
gRPC frontend, answering each ``ModelInfer`` with its own inputs as outputs and doing nothing else.
It reads and writes messages as shmserve's frontend does (server/grpc/requests.py, responses.py:
a large request's raw tensors are views of the received bytes, and each output is copied once into
the serialized response), so the floor pays no protobuf copy our frontend does not.

Run as a third server beside Triton's and shmserve's gRPC endpoints (``tools/side_by_side.sh
paired``), it shows how much of shmserve's gRPC cost per request is grpcio's own, which no change
to shmserve's code can remove::

    python -m shmserve.tools.grpc_floor --port 18701 &
    shmserve-perf -m add_sub -i grpc -u 127.0.0.1:18601 --compare floor=grpc:127.0.0.1:18701 ...
"""
from __future__ import annotations

import argparse
import asyncio
from typing import Any

import grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc

from shmserve.server.grpc.handlers import passing_bytes
from shmserve.server.grpc.options import MAX_INT as MAX_MESSAGE_BYTES  # Triton's message limit
from shmserve.server.grpc.requests import read_infer_request
from shmserve.server.grpc.responses import RAW_OUTPUT_TAG, varint


class EchoService(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Live, ready, and every model's outputs are its inputs (named OUTPUT<k>)."""

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=True)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        return pb.ModelReadyResponse(ready=True)

    async def ModelInfer(self, request: Any, context: Any) -> bytes:
        response = pb.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
        for k, tensor in enumerate(request.inputs):
            response.outputs.add(name=f"OUTPUT{k}", datatype=tensor.datatype, shape=tensor.shape)
        parts: list[Any] = [response.SerializeToString()]
        for data in request.raw_input_contents:
            parts += (RAW_OUTPUT_TAG, varint(len(data)), data)
        return b"".join(parts)


def _read_as_shmserve(handler: grpc.RpcMethodHandler, name: str) -> grpc.RpcMethodHandler:
    """ModelInfer's messages read and written as shmserve's frontend does (handlers.py)."""
    if name != "ModelInfer":
        return handler
    return handler._replace(request_deserializer=read_infer_request,  # type: ignore[attr-defined]
                            response_serializer=passing_bytes(handler.response_serializer))


class _Server:
    """Stands in for the server while the generated code registers the servicer (handlers.py's
    ``_Registration``, with ModelInfer's handler changed on its way)."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self.server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same handlers come again by name

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        changed = {name: _read_as_shmserve(h, name) for name, h in handlers.items()}
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, changed),))
        self.server.add_registered_method_handlers(service, changed)


async def serve(address: str, port: int) -> None:
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), ("grpc.so_reuseport", 0)]
    server = grpc.aio.server(options=options)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(EchoService(), _Server(server))
    server.add_insecure_port(f"{address}:{port}")
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18701)
    args = p.parse_args()
    asyncio.run(serve(args.address, args.port))


if __name__ == "__main__":
    main()
