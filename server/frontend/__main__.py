"""Frontend entry point: ``python -m server.frontend '<spec JSON>'`` (started by the launcher).

Serves the socket the launcher bound (inherited by descriptor) with uvicorn on uvloop and
httptools.
"""
from __future__ import annotations

import logging
import socket
import sys

import orjson
import uvicorn

from shm.names import set_title


def main() -> int:
    spec = orjson.loads(sys.argv[1])
    set_title(f"shmserve frontend {spec['server_id']} #{spec['index']}")
    logging.basicConfig(level=logging.DEBUG if spec.get("log_verbose") else logging.INFO,
                        format=f"%(asctime)s %(levelname).1s [frontend #{spec['index']}] %(name)s: %(message)s")
    from .app import build_app

    app = build_app(spec["server_id"], spec["arena_bytes"], spec["allow_remote_shm"], spec["max_input_bytes"])
    sock = socket.socket(fileno=spec["fd"])
    from .protocol import protocol_for

    config = uvicorn.Config(app, loop="uvloop", http=protocol_for(app.fe), access_log=False, log_level="warning",
                            timeout_graceful_shutdown=int(spec.get("exit_timeout_s", 30)), lifespan="on", proxy_headers=False, server_header=False, date_header=False)
    from shm.profiling import run_profiled

    return run_profiled(f"frontend{spec['index']}", lambda: uvicorn.Server(config).run(sockets=[sock]) or 0)


if __name__ == "__main__":
    sys.exit(main())
