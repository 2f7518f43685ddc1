"""Broker entry point: ``python -m shmserve.server.broker '<options JSON>'`` (started by the launcher)."""
from __future__ import annotations

import sys

import orjson

from shmserve.shm import logs
from shmserve.shm.names import set_title

from .options import BrokerOptions


def main() -> int:
    opts = BrokerOptions.from_json(orjson.loads(sys.argv[1]))
    logs.configure(opts.log)
    set_title(f"shmserve broker {opts.server_id}")
    from shmserve.shm.profiling import run_profiled

    from .broker import main as run

    return run_profiled("broker", lambda: run(opts))


if __name__ == "__main__":
    sys.exit(main())
