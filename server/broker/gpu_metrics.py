"""Triton's per-GPU metric families, read from NVML (``libnvidia-ml.so.1``) with ctypes.

NVML enumerates every physical device and ignores ``CUDA_VISIBLE_DEVICES``, while Triton reports
only the GPUs the server may use; ``device_lookups`` turns the server's mask into the NVML lookups
that find those devices (an index entry by index, a ``GPU-`` entry by UUID). The mapping is a pure
function so it is tested without a GPU. NVML is loaded only when the CUDA driver reports a visible
device, so a CPU-only host pays nothing; where NVML cannot be loaded or finds no device, no GPU
family appears (not zeros) and nothing is logged above debug, as metrics are optional.
"""
from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import Any, Union

from shmserve.workers.devices import cuda_device_count, visible_devices

log = logging.getLogger("shmserve.metrics")

# name, HELP text, type: Triton's exact families (its core src/metrics.cc).
FAMILIES = (
    ("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)", "gauge"),
    ("nv_gpu_memory_total_bytes", "GPU total memory, in bytes", "gauge"),
    ("nv_gpu_memory_used_bytes", "GPU used memory, in bytes", "gauge"),
    ("nv_gpu_power_usage", "GPU power usage in watts", "gauge"),
    ("nv_gpu_power_limit", "GPU power management limit in watts", "gauge"),
    ("nv_energy_consumption", "GPU energy consumption in joules since the Triton Server started", "counter"),
)

Lookup = tuple[str, Union[int, str]]  # ("index", 0) or ("uuid", "GPU-...")
Figures = dict[str, float]  # family name -> value, for the families the device reported

_UUID_CHARS = 96  # NVML_DEVICE_UUID_V2_BUFFER_SIZE


def device_lookups(mask: str | None, count: int) -> tuple[list[Lookup], list[str]]:
    """The NVML lookups for the devices a ``CUDA_VISIBLE_DEVICES`` value allows, and its MIG entries.

    ``count`` is NVML's device count. Without a mask every device is visible. An index entry is
    looked up by index and a ``GPU-`` entry by UUID; ``MIG-`` entries are returned apart, since a
    MIG instance is not a device NVML reports these figures for. The CUDA driver reads the mask up
    to its first unusable entry (not a number, or an index past the last device), so that ends the
    list here too. Index entries assume NVML's order matches CUDA's, which holds with one GPU, with
    identical GPUs and with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.
    """
    if mask is None:
        return [("index", i) for i in range(count)], []
    lookups: list[Lookup] = []
    mig: list[str] = []
    for entry in visible_devices(mask):
        if entry.startswith("MIG-"):
            mig.append(entry)
        elif entry.startswith("GPU-"):
            lookups.append(("uuid", entry))
        elif entry.isdigit() and int(entry) < count:
            lookups.append(("index", int(entry)))
        else:
            break
    return lookups, mig


class _Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _load_nvml() -> Any:
    """The initialized NVML library, or None where the host has no visible CUDA device or no NVML."""
    if cuda_device_count() == 0:
        return None
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            log.debug("nvmlInit failed: no GPU metrics")
            return None
    except (OSError, AttributeError) as e:
        log.debug("NVML unavailable (%s): no GPU metrics", e)
        return None
    return lib


class GpuSampler:
    """The visible GPUs' figures, read at most once per ``interval_s`` (``--metrics-interval-ms``)
    so scrapes in between see the same figures, like ``system.CpuSampler``. Energy counts from
    the first reading, as Triton's counter starts at zero when the server starts."""

    def __init__(self, interval_s: float, mask: str | None) -> None:
        self.interval_s = max(0.05, interval_s)
        self._lock = threading.Lock()  # scrapes run on threads of their own
        self._at = 0.0
        self._figures: list[tuple[str, Figures]] = []
        self._energy_start: dict[str, int] = {}
        self._devices: list[tuple[str, ctypes.c_void_p]] = []
        self._lib: Any = None
        try:
            self._lib = _load_nvml()
            if self._lib is not None:
                self._devices = self._open(mask)
            self._figures = self._read()
            self._at = time.monotonic()
        except Exception as e:  # noqa: BLE001 - GPU metrics are optional, never fatal
            log.debug("GPU metrics unavailable: %s", e)
            self._devices = []

    def _open(self, mask: str | None) -> list[tuple[str, ctypes.c_void_p]]:
        """(uuid, handle) of each visible device, each once."""
        count = ctypes.c_uint(0)
        if self._lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return []
        lookups, mig = device_lookups(mask, count.value)
        if mig:
            log.warning("GPU metrics leave out the MIG devices in CUDA_VISIBLE_DEVICES: %s", ",".join(mig))
        devices: list[tuple[str, ctypes.c_void_p]] = []
        for how, key in lookups:
            handle = ctypes.c_void_p()
            if how == "index":
                rc = self._lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(int(key)), ctypes.byref(handle))
            else:
                rc = self._lib.nvmlDeviceGetHandleByUUID(str(key).encode(), ctypes.byref(handle))
            uuid = ctypes.create_string_buffer(_UUID_CHARS)
            if rc != 0 or self._lib.nvmlDeviceGetUUID(handle, uuid, ctypes.c_uint(_UUID_CHARS)) != 0:
                log.debug("NVML has no device for CUDA_VISIBLE_DEVICES entry %s", key)
                continue
            name = uuid.value.decode()
            if all(name != known for known, _ in devices):
                devices.append((name, handle))
        return devices

    def sample(self) -> list[tuple[str, Figures]]:
        """(gpu_uuid, figures) per visible device; empty without NVML or devices."""
        with self._lock:
            now = time.monotonic()
            if self._devices and now - self._at >= self.interval_s:
                try:
                    self._figures = self._read()
                except Exception as e:  # noqa: BLE001 - a scrape must never fail for NVML
                    log.debug("reading GPU metrics failed: %s", e)
                    self._figures = []
                self._at = now
            return self._figures

    def _read(self) -> list[tuple[str, Figures]]:
        """Each device's figures; a figure its device does not support (NVML error) is left out."""
        lib = self._lib
        out = []
        for uuid, handle in self._devices:
            figures: Figures = {}
            util, mem = _Utilization(), _Memory()
            milliwatts, limit, millijoules = ctypes.c_uint(0), ctypes.c_uint(0), ctypes.c_ulonglong(0)
            if lib.nvmlDeviceGetUtilizationRates(handle, ctypes.byref(util)) == 0:
                figures["nv_gpu_utilization"] = util.gpu / 100.0
            if lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) == 0:
                figures["nv_gpu_memory_total_bytes"] = float(mem.total)
                figures["nv_gpu_memory_used_bytes"] = float(mem.used)
            if lib.nvmlDeviceGetPowerUsage(handle, ctypes.byref(milliwatts)) == 0:
                figures["nv_gpu_power_usage"] = milliwatts.value / 1000.0
            if lib.nvmlDeviceGetPowerManagementLimit(handle, ctypes.byref(limit)) == 0:
                figures["nv_gpu_power_limit"] = limit.value / 1000.0
            if lib.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(millijoules)) == 0:
                start = self._energy_start.setdefault(uuid, millijoules.value)
                figures["nv_energy_consumption"] = max(0, millijoules.value - start) / 1000.0
            out.append((uuid, figures))
        return out
