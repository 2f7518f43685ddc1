"""Broker entry point: ``python -m server.broker '<options JSON>'`` (started by the launcher)."""
from __future__ import annotations

import logging
import sys

import orjson

from shm.names import set_title

from .options import BrokerOptions


def main() -> int:
    opts = BrokerOptions.from_json(orjson.loads(sys.argv[1]))
    logging.basicConfig(level=logging.DEBUG if opts.log_verbose else logging.INFO,
                        format="%(asctime)s %(levelname).1s [broker] %(name)s: %(message)s")
    set_title(f"shmserve broker {opts.server_id}")
    from shm.profiling import run_profiled

    from .broker import main as run

    return run_profiled("broker", lambda: run(opts))


if __name__ == "__main__":
    sys.exit(main())
