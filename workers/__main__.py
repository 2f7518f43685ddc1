"""Worker entry point: ``python -m workers '<spec JSON>'`` (started by the broker, not by hand)."""
from __future__ import annotations

import logging
import os
import sys

import orjson


def main() -> int:
    spec = orjson.loads(sys.argv[1])
    device = "cpu" if spec["kind"] != "GPU" else f"gpu{spec.get('device_id', 0)}"
    if spec["kind"] == "GPU":
        # Before torch is imported: this process sees only its own GPU (as cuda:0).
        os.environ["CUDA_VISIBLE_DEVICES"] = str(spec.get("device_id", 0))
    title = f"shmserve worker {spec['model']} v{spec['version']} #{spec['instance_index']} {device}"
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:  # pragma: no cover - setproctitle is a dependency
        pass
    logging.basicConfig(
        level=logging.DEBUG if spec.get("log_verbose") else logging.INFO,
        format=f"%(asctime)s %(levelname).1s [{spec['model']} v{spec['version']} #{spec['instance_index']}] "
               f"%(name)s: %(message)s",
    )
    from shm.profiling import run_profiled

    from .worker import run

    return run_profiled(f"worker-{spec['model']}", lambda: run(spec))


if __name__ == "__main__":
    sys.exit(main())
