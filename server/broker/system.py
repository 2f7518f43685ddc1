"""Host figures for the metrics: CPU utilization and memory from /proc, GPUs through NVML.

NVML is loaded with ctypes only when the CUDA driver reports devices (``workers/devices.py``), so
a CPU-only host pays nothing and exports no GPU families, as Triton does.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import time
from typing import Any

from shmserve.workers.devices import cuda_device_count

log = logging.getLogger("shmserve.metrics")


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    with open("/proc/stat", "rb") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already inside user and nice
    return total - idle, total


def _memory() -> tuple[int, int]:
    """(total, used) bytes of RAM, used meaning not available to new programs (MemAvailable)."""
    info: dict[str, int] = {}
    with open("/proc/meminfo", "rb") as f:
        for line in f:
            key, _, rest = line.partition(b":")
            info[key.decode()] = int(rest.split()[0]) * 1024
    total = info.get("MemTotal", 0)
    return total, total - info.get("MemAvailable", info.get("MemFree", 0))


class CpuSampler:
    """Utilization over the last interval: sampled at most once per ``interval_s`` (Triton's
    ``--metrics-interval-ms``), so scrapes in between see the same figure."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = max(0.05, interval_s)
        self._last = _cpu_times()
        self._at = time.monotonic()
        self._figures = (0.0, *_memory())

    def sample(self) -> tuple[float, int, int]:
        now = time.monotonic()
        if now - self._at >= self.interval_s:
            busy, total = _cpu_times()
            d_busy, d_total = busy - self._last[0], total - self._last[1]
            self._last, self._at = (busy, total), now
            self._figures = (d_busy / d_total if d_total > 0 else 0.0, *_memory())
        return self._figures


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


@functools.lru_cache(maxsize=1)
def _nvml() -> Any:
    if cuda_device_count() == 0:
        return None
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            return None
    except (OSError, AttributeError) as e:
        log.warning("CUDA devices present but NVML unavailable (%s): no GPU metrics", e)
        return None
    return lib


def gpu_samples() -> list[dict[str, Any]]:
    """Per device: uuid, utilization [0, 1] and memory; empty without CUDA or NVML."""
    lib = _nvml()
    if lib is None:
        return []
    out = []
    count = ctypes.c_uint(0)
    if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
        return []
    for i in range(count.value):
        handle = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0:
            continue
        uuid = ctypes.create_string_buffer(96)
        util, mem = _Utilization(), _Memory()
        if lib.nvmlDeviceGetUUID(handle, uuid, 96) != 0 or \
                lib.nvmlDeviceGetUtilizationRates(handle, ctypes.byref(util)) != 0 or \
                lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) != 0:
            continue
        out.append({"uuid": uuid.value.decode(), "nv_gpu_utilization": util.gpu / 100.0,
                    "nv_gpu_memory_total_bytes": mem.total, "nv_gpu_memory_used_bytes": mem.used})
    return out
