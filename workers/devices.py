"""Device detection without importing torch (the broker must start fast and stay small).

CUDA is present when the driver library loads and reports devices. The driver honours the server's
``CUDA_VISIBLE_DEVICES`` itself, so ``cuda_device_count`` counts only the devices that mask allows:
KIND_AUTO becomes GPU, and a KIND_GPU group without ``gpus`` gets one instance per GPU, over those
devices alone, and a ``gpus`` entry is an index into them (as in Triton). Workers inherit the
mask unchanged, so an index means the same device in every process of the server; a GPU
instance makes its device the current one (see the backends).
"""
from __future__ import annotations

import ctypes
import functools


@functools.lru_cache(maxsize=1)
def cuda_device_count() -> int:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    try:
        if lib.cuInit(0) != 0:
            return 0
        count = ctypes.c_int(0)
        if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
        return count.value
    except AttributeError:
        return 0


def visible_devices(mask: str) -> list[str]:
    """The entries of a ``CUDA_VISIBLE_DEVICES`` value, in order, whatever their form (indices,
    ``GPU-`` UUIDs, ``MIG-`` ids). The driver reads the list up to its first unusable entry, so an
    empty entry ends it here too; an empty value means no device."""
    entries = []
    for entry in mask.split(","):
        entry = entry.strip()
        if not entry:
            break
        entries.append(entry)
    return entries
