"""Worker entry point: ``python -m shmserve.workers`` with its spec as stdin (started by the broker,
not by hand: shm/child_spec.py)."""
from __future__ import annotations

import os
import signal
import sys

from shmserve.shm.child_spec import read_spec
from shmserve.shm.names import set_title


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel sends us SIGTERM when the broker dies, so no worker outlives it and none
    has to poll for it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the broker died before the line above
        sys.exit(1)


def main() -> int:
    spec = read_spec()
    _die_with_parent(spec["broker_pid"])
    # A GPU worker keeps the server's CUDA_VISIBLE_DEVICES, so device ids mean the same in every
    # process; its backend makes the instance's GPU the current device.
    device = "cpu" if spec["kind"] != "GPU" else f"gpu{spec.get('device_id', 0)}"
    title = f"shmserve worker {spec['model']} v{spec['version']} #{spec['instance_index']} {device}"
    set_title(title)
    from shmserve.shm import heap, logs

    heap.keep_large_buffers()  # a model's large outputs reuse memory instead of faulting it in per request

    logs.configure(spec.get("log") or {}, prefix=f"[{spec['model']} v{spec['version']} #{spec['instance_index']}] ")
    from shmserve.shm.profiling import run_profiled

    from .worker import run

    return run_profiled(f"worker-{spec['model']}", lambda: run(spec))


if __name__ == "__main__":
    sys.exit(main())
