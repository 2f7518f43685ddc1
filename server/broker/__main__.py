"""Broker entry point: ``python -m shmserve.server.broker`` with its options as stdin (started by the
launcher: shm/child_spec.py)."""
from __future__ import annotations

import sys

from shmserve.descriptor_limit import raise_descriptor_limit
from shmserve.shm import logs
from shmserve.shm.child_spec import read_spec
from shmserve.shm.names import set_title

from .options import BrokerOptions


def main() -> int:
    opts = BrokerOptions.from_json(read_spec())
    logs.configure(opts.log)
    set_title(f"shmserve broker {opts.server_id}")
    raise_descriptor_limit()  # one descriptor per guarded client segment, however many clients
    from shmserve.shm.profiling import run_profiled

    from .broker import main as run

    return run_profiled("broker", lambda: run(opts))


if __name__ == "__main__":
    sys.exit(main())
