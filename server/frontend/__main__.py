"""Frontend entry point: ``python -m shmserve.server.frontend``, its spec as stdin (started by the launcher).

Serves the socket the launcher bound (inherited by descriptor) with uvicorn on uvloop and
httptools, each connection under the limits of protocol.py; the ASGI application is asgi.py's
``FrontendApp`` (built by app.py's ``build_app``).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from types import FrameType
from typing import Awaitable, Callable, Iterable

import uvicorn

from shmserve.shm import heap, logs
from shmserve.shm.child_spec import read_spec
from shmserve.shm.names import set_title
from shmserve.server.edge.stop_signal import FROM_OUTSIDE, STOP, launcher_stops_us

log = logging.getLogger("shmserve.frontend")


def main() -> int:
    spec = read_spec()  # stdin (shm/child_spec.py)
    heap.keep_large_buffers()  # request and response bodies reuse memory instead of faulting it in
    set_title(f"shmserve frontend {spec['server_id']} #{spec['index']}")
    logs.configure(spec.get("log") or {})
    log_settings = logs.BrokerSettings(spec["server_id"])  # run-time changes (POST /v2/logging) from any frontend
    from shmserve.descriptor_limit import connection_bound, raise_descriptor_limit
    from shmserve.server.edge.edge_counts import EdgeCounts
    from shmserve.server.edge.header_forward import HTTP_FLAG, compile_pattern
    from shmserve.server.edge.shared_port import wait_for_initial_loads

    from .app import build_app
    from .limits import HttpLimits
    from .protocol import protocol_class
    from .restricted import restrict

    limits = HttpLimits.from_spec(spec.get("http_limits"))
    descriptors = raise_descriptor_limit()
    max_connections = limits.max_connections or connection_bound(descriptors)
    if max_connections > connection_bound(descriptors):
        log.warning("--http-max-connections %d leaves fewer than %d of this frontend's %d descriptors for "
                    "itself: it may run out of them", max_connections, descriptors - connection_bound(descriptors),
                    descriptors)

    header_forward = compile_pattern(spec.get("header_forward_pattern"), HTTP_FLAG)  # checked at start (cli.py)
    frontend = build_app(spec["server_id"], spec["arena_bytes"], spec["allow_remote_shm"], spec["max_input_bytes"],
                         spec["max_tensor_elements"], spec["max_inflight"], spec["poll_us"], header_forward,
                         spec.get("allow_client_shm", True))
    app = restrict(frontend, spec.get("restricted") or {})  # --http-restricted-api
    sock = socket.socket(fileno=spec["fd"])
    # log_config=None: uvicorn's records go to our handler (same format, same file), not its own.
    edge = EdgeCounts("http")  # what the limits refused, for the broker's metrics
    http = protocol_class(limits, max_connections, edge, keep_header_names=header_forward is not None)
    config = uvicorn.Config(app, loop="uvloop", http=http, access_log=False, log_level="warning", log_config=None,
                            timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]
                            timeout_graceful_shutdown=int(spec.get("exit_timeout_s", 30)),
                            lifespan="on", proxy_headers=False, server_header=False, date_header=False)
    from shmserve.shm.profiling import run_profiled

    # The broker's log and trace settings are followed, and the edge's counts reported, on the
    # loop's own tick: no thread of their own to wake twice a second. The line that says it
    # serves comes once it does.
    host, port = sock.getsockname()[:2]
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    ticks = [log_settings.check, frontend.tracer.follow, lambda: edge.report(frontend.inference.link)]
    server = QuietServer(config, ticks=ticks, serving=lambda: log.info(
        "frontend #%d serving HTTP on %s (at most %d connections)", spec["index"], address, max_connections),
        gate=(lambda stopping: wait_for_initial_loads(frontend.inference.link, stopping))
        if spec.get("shared_port") else None)
    # uvicorn stops gracefully on SIGTERM or SIGINT, then raises the signal again under the handler
    # it found: with the default one that ends the process there, before what follows the serving
    # (the SHMSERVE_PROFILE dump). Found handlers that exit quietly instead.
    for sig in FROM_OUTSIDE:
        signal.signal(sig, _exit_after_shutdown)
    signal.signal(STOP, lambda *_: server.stop())  # the launcher's, once the broker drained
    return run_profiled(f"frontend{spec['index']}", lambda: server.run(sockets=[sock]) or 0)


def _exit_after_shutdown(signum: int, frame: object) -> None:
    raise SystemExit(0)


class QuietServer(uvicorn.Server):
    """uvicorn's server, ticking twice a second instead of ten times: each tick wakes an idle
    frontend, and those wake-ups would be most of an idle server's CPU. A tick only refreshes
    default headers (we send no date header) and notices a requested exit, which takes up to
    0.5 s. It overrides ``uvicorn.Server.main_loop`` and calls its ``on_tick``, which are not
    public: pyproject.toml pins uvicorn to the versions tested."""

    TICK_S = 0.5

    def __init__(self, config: uvicorn.Config, ticks: Iterable[Callable[[], None]] = (),
                 serving: Callable[[], None] = lambda: None,
                 gate: Callable[[Callable[[], bool]], Awaitable[bool]] | None = None) -> None:
        super().__init__(config)
        self.ticks = list(ticks)  # also run every tick
        self.serving = serving  # called once uvicorn has started serving the socket
        self.gate = gate  # awaited before the socket listens; False: stop without listening
        self.launcher = os.getppid()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """SIGTERM or SIGINT: ours to act on only once the launcher is gone; while it lives, they
        were sent to the whole server and the launcher stops us after the drain (stop_signal.py)."""
        if not launcher_stops_us(self.launcher):
            super().handle_exit(sig, frame)

    def stop(self) -> None:
        """Stop as uvicorn stops on SIGTERM: no new connection, then what is in flight finishes."""
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's, once the gate (a shared port's: server/edge/shared_port.py) lets it listen.
        Asked to stop meanwhile, it returns with ``should_exit`` set and uvicorn stops there."""
        if self.gate is not None and not await self.gate(lambda: self.should_exit):
            self.should_exit = True
            return
        await super().startup(sockets)

    async def main_loop(self) -> None:
        self.serving()
        counter = 0  # in uvicorn's units of 0.1 s, so its once-a-second work runs every tick
        while not await self.on_tick(counter):
            for tick in self.ticks:
                try:
                    tick()
                except Exception:  # noqa: BLE001 - one failing tick (out of descriptors...) stops no other
                    log.exception("a periodic task of the frontend failed; it runs again next tick")
            counter = (counter + 10) % 864000
            await asyncio.sleep(self.TICK_S)


if __name__ == "__main__":
    sys.exit(main())
