"""Worker entry point: ``python -m shmserve.workers`` with its spec as stdin (started by the broker,
not by hand: shm/child_spec.py)."""
from __future__ import annotations

import os
import signal
import sys

from shmserve.descriptor_limit import raise_descriptor_limit
from shmserve.parent_death import die_with_parent
from shmserve.shm.child_spec import read_spec
from shmserve.shm.names import set_title


def main() -> int:
    if sys.path and sys.path[0] in ("", os.getcwd()):
        # ``python -m`` put the server's working directory first, where a module of the same name
        # as a model's own (a helpers.py beside it) would shadow it; Triton's stub has no such entry.
        del sys.path[0]
    spec = read_spec()
    die_with_parent(signal.SIGTERM, spec["broker_pid"])  # no worker outlives its broker, none polls for it
    # A GPU worker keeps the server's CUDA_VISIBLE_DEVICES, so device ids mean the same in every
    # process; its backend makes the instance's GPU the current device.
    device = "cpu" if spec["kind"] != "GPU" else f"gpu{spec.get('device_id', 0)}"
    # The server's id last: ``pgrep -f <id>`` finds every process of one server, and scripts that
    # match ``shmserve worker <model> `` go on matching.
    title = (f"shmserve worker {spec['model']} v{spec['version']} #{spec['instance_index']} {device} "
             f"(server {spec['server_id']})")
    set_title(title)
    raise_descriptor_limit()  # a guarded mapping of each client's arena it reads holds a descriptor
    from shmserve.shm import heap, logs

    heap.keep_large_buffers()  # a model's large outputs reuse memory instead of faulting it in per request

    logs.configure(spec.get("log") or {}, prefix=f"[{spec['model']} v{spec['version']} #{spec['instance_index']}] ")
    from shmserve.shm.profiling import run_profiled

    from .worker import run

    return run_profiled(f"worker-{spec['model']}", lambda: run(spec))


if __name__ == "__main__":
    sys.exit(main())
