"""Device detection without importing torch (the broker must start fast and stay small).

CUDA is present when the driver library loads and reports devices; ``CUDA_VISIBLE_DEVICES`` is
honoured by the driver itself. KIND_AUTO instance groups become GPU instances only then.
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
