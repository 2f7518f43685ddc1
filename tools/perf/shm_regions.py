"""``--shared-memory system|cuda`` over HTTP and gRPC: regions a client process creates, fills once
and registers with the server through tritonclient (the KServe shared-memory extensions), and
unregisters and frees when it closes. Every name starts with ``shmperf_`` and the run's id, so that
the parent can unlink what a killed client left in /dev/shm."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

PREFIX = "shmperf_"


def cuda_available() -> str | None:
    """None when a CUDA region can be made here, else why not (for a clear error up front)."""
    try:
        import tritonclient.utils.cuda_shared_memory as cudashm

        handle = cudashm.create_shared_memory_region(f"{PREFIX}probe", 64, 0)
        cudashm.destroy_shared_memory_region(handle)
    except Exception as exc:  # noqa: BLE001 - no GPU, no driver, or no cuda-python: each is "no"
        return f"{type(exc).__name__}: {exc}"
    return None


def byte_size(array: np.ndarray) -> int:
    """Bytes the array takes in a region (BYTES tensors serialized with their lengths)."""
    if array.dtype == np.object_:
        from tritonclient.utils import serialized_byte_size

        return int(serialized_byte_size(array))
    return int(array.nbytes)


class Regions:
    """The regions of one caller, registered through ``client`` (tritonclient HTTP or gRPC)."""

    def __init__(self, client: Any, kind: str, prefix: str) -> None:
        self.client, self.kind, self.prefix = client, kind, f"{PREFIX}{prefix}"
        self.handles: dict[str, Any] = {}
        if kind == "cuda":
            import tritonclient.utils.cuda_shared_memory as module
        else:
            import tritonclient.utils.shared_memory as module  # type: ignore[no-redef]
        self.module = module

    def add(self, tag: str, nbytes: int, array: np.ndarray | None = None) -> str:
        """A region of ``nbytes`` (holding ``array`` when given), registered; its name."""
        name = f"{self.prefix}_{tag}"
        if self.kind == "cuda":
            handle = self.module.create_shared_memory_region(name, nbytes, 0)
        else:
            handle = self.module.create_shared_memory_region(name, "/" + name, nbytes)
        self.handles[name] = handle
        if array is not None:
            self.module.set_shared_memory_region(handle, [array])
        if self.kind == "cuda":
            self.client.register_cuda_shared_memory(name, self.module.get_raw_handle(handle), 0, nbytes)
        else:
            self.client.register_system_shared_memory(name, "/" + name, nbytes)
        return name

    def close(self) -> None:
        """Unregister from the server (best effort: it may be gone), then free locally."""
        for name, handle in self.handles.items():
            try:
                if self.kind == "cuda":
                    self.client.unregister_cuda_shared_memory(name)
                else:
                    self.client.unregister_system_shared_memory(name)
            except Exception as exc:  # noqa: BLE001 - still free our side
                print(f"warning: could not unregister {name}: {exc}", file=sys.stderr)
            self.module.destroy_shared_memory_region(handle)
        self.handles.clear()


def remove_leftovers(run_id: str) -> None:
    """Unlink the system regions of run ``run_id`` that a killed client process left behind."""
    for path in Path("/dev/shm").glob(f"{PREFIX}{run_id}_*"):
        path.unlink(missing_ok=True)
