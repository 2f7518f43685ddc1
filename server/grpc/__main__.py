"""gRPC frontend entry point: ``python -m shmserve.server.grpc``, its spec as stdin (started by the
launcher when ``--allow-grpc`` is true).

grpcio's asyncio server on the standard asyncio loop (grpc.aio does not run on uvloop), with the
settings of Triton's gRPC flags (options.py): channel arguments (the message limits among them:
Triton's 2 GiB - 1 for responses, ``--grpc-max-input-size`` for requests), the slots ModelInfer
messages are received under (receiving.py), TLS credentials, the
restricted-protocol interceptor (restricted.py); handlers registered by handlers.py. SIGTERM stops
it gracefully within ``--exit-timeout-secs``.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys

import grpc
from grpc_health.v1 import health_pb2_grpc
from tritonclient.grpc import service_pb2_grpc

from shmserve.descriptor_limit import connection_bound, raise_descriptor_limit
from shmserve.server.edge.edge_counts import EdgeCounts
from shmserve.server.edge.header_forward import GRPC_FLAG, compile_pattern
from shmserve.server.edge.link import BrokerLink
from shmserve.server.edge.shared_port import wait_for_initial_loads
from shmserve.server.edge.stop_signal import FROM_OUTSIDE, STOP, launcher_stops_us
from shmserve.server.edge.tracing import Tracer
from shmserve.shm import logs
from shmserve.shm.child_spec import read_spec
from shmserve.shm.names import set_title

from .handlers import add_servicer
from .health import HealthService
from .infer import GrpcInference
from .memory import HeapWatch
from .options import read_pem
from .receiving import ReceiveSlots
from .requests import read_infer_request
from .restricted import RestrictedProtocols
from .service import InferenceService

log = logging.getLogger("shmserve.grpc")
TICK_S = 0.5  # how often the broker's published log and trace settings are followed


def credentials(tls: dict) -> grpc.ServerCredentials:
    """Triton's TLS: the server's key and certificate; with mutual TLS, a client certificate
    that chains to the root certificate is required."""
    root = read_pem(tls["root"], "--grpc-root-cert") if tls["root"] else None
    pair = (read_pem(tls["key"], "--grpc-server-key"), read_pem(tls["cert"], "--grpc-server-cert"))
    return grpc.ssl_server_credentials([pair], root_certificates=root, require_client_auth=tls["mutual"])


def connection_bounded(asked: int) -> int:
    """``--grpc-max-connections``, or by default what the descriptor limit leaves (as HTTP's):
    past its descriptors, the frontend could neither accept nor reach the broker."""
    descriptors = raise_descriptor_limit()  # (raised at start already: the limit in force)
    bound = connection_bound(descriptors)
    if asked > bound:
        log.warning("--grpc-max-connections %d leaves fewer than %d of this frontend's %d descriptors for itself: "
                    "it may run out of them", asked, descriptors - bound, descriptors)
    return asked or bound


def bind(server: grpc.aio.Server, spec: dict) -> str:
    """Listen on the spec's address (plaintext, or TLS); its text. Raises RuntimeError or ValueError."""
    address = f"{spec['address']}:{spec['port']}" if ":" not in spec["address"] else \
        f"[{spec['address']}]:{spec['port']}"
    if spec["tls"]:
        server.add_secure_port(address, credentials(spec["tls"]))
        return address + " over TLS"
    server.add_insecure_port(address)
    return address


async def serve(spec: dict) -> int:
    link = BrokerLink(spec["server_id"], spec["arena_bytes"], spec["max_inflight"], spec["poll_us"])
    tracer = Tracer(spec["server_id"])
    inference = GrpcInference(link, tracer, spec["max_tensor_elements"], spec["arena_bytes"],
                              compile_pattern(spec.get("header_forward_pattern"), GRPC_FLAG))
    service = InferenceService(spec["server_id"], link, inference, spec["allow_remote_shm"])
    options = [*map(tuple, spec["options"])]  # message sizes, keepalive, SO_REUSEPORT: options.py
    max_connections = connection_bounded(spec.get("max_connections", 0))
    # (grpc closes a connection past it as it comes, before reading a byte)
    options.append(("grpc.max_allowed_incoming_connections", max_connections))
    interceptors = [RestrictedProtocols(spec["restricted"])] if spec["restricted"] else []
    server = grpc.aio.server(options=options, interceptors=interceptors)
    edge = EdgeCounts("grpc")  # what its limits refused, for the broker's metrics
    receiving = ReceiveSlots(spec["receive_slots"], spec["receive_timeout_s"], edge)
    add_servicer(server, service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server, service,
                 {"ModelInfer": read_infer_request, "ModelStreamInfer": read_infer_request}, {"ModelInfer": receiving})
    add_servicer(server, health_pb2_grpc.add_HealthServicer_to_server, HealthService(service))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    launcher = os.getppid()

    def signalled() -> None:
        """SIGTERM or SIGINT: while the launcher lives, sent to the whole server, and the launcher
        stops us with STOP after the drain (server/edge/stop_signal.py)."""
        if not launcher_stops_us(launcher):
            stop.set()

    for sig in FROM_OUTSIDE:
        loop.add_signal_handler(sig, signalled)
    loop.add_signal_handler(STOP, stop.set)
    # grpcio listens as it binds: a port shared with other servers is bound once the loads are over
    if spec.get("shared_port") and not await wait_for_initial_loads(link, stop.is_set):
        link.close()
        return 0
    try:
        address = bind(server, spec)
    except (RuntimeError, ValueError) as e:
        log.error("cannot serve gRPC on %s:%s: %s", spec["address"], spec["port"], e)
        link.close()
        return 1
    link.open_early()
    await server.start()
    tracer.start()
    log.info("serving gRPC on %s (at most %d connections), receiving at most %d ModelInfer messages at once",
             address, max_connections, receiving.slots)
    log_settings = logs.BrokerSettings(spec["server_id"])  # run-time changes made through any frontend
    heap_watch = HeapWatch()  # large messages' memory goes back to the kernel once freed
    while not stop.is_set():
        log_settings.check()
        tracer.follow()
        receiving.sweep()  # (before the heap's trim, which may take a while on a large heap)
        edge.report(link)
        await heap_watch.check()
        try:
            await asyncio.wait_for(stop.wait(), TICK_S)
        except asyncio.TimeoutError:
            pass
    await server.stop(spec.get("exit_timeout_s", 30))
    tracer.stop()
    link.close()
    return 0


def main() -> int:
    spec = read_spec()  # stdin (shm/child_spec.py)
    set_title(f"shmserve grpc {spec['server_id']}")
    raise_descriptor_limit()  # one descriptor per connection
    logs.configure(spec.get("log") or {})
    from shmserve.shm.profiling import run_profiled

    return run_profiled("grpc", lambda: asyncio.run(serve(spec)))


if __name__ == "__main__":
    sys.exit(main())
