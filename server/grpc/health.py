"""The standard ``grpc.health.v1.Health/Check``: SERVING while the server is ready (what
``ServerReady`` answers), whatever service it names, as Triton answers it: a Kubernetes gRPC probe
with any ``service:`` set passes on both."""
from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .service import InferenceService


class HealthService(health_pb2_grpc.HealthServicer):
    def __init__(self, inference: InferenceService) -> None:
        self.inference = inference

    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        ready = await self.inference.server_ready()
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)
