"""CUDA IPC for the KServe CUDA shared-memory extension, through the CUDA runtime via ctypes.

A client registers device memory by its ``cudaIpcMemHandle_t`` (64 bytes, base64 on the wire).
The broker opens the handle once at registration to refuse a bad one with a 400 (as Triton does);
a worker opens it when a request first names the region, keeps the mapping while the region is
registered, and closes it once the broker's published table no longer lists the handle.

A worker sees every GPU the server sees (its instance's GPU is only its current device), so it
can open a region that lives on another GPU. Opening switches to the region's device and back,
so the model's current device never changes under it. Only loaded when a CUDA device exists
(``devices.cuda_device_count``): without one the extension answers clear errors.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.util
import os
import threading

from .devices import cuda_device_count

IPC_HANDLE_BYTES = 64
_LAZY_PEER_ACCESS = 1
_H2D, _D2H = 1, 2


class CudaError(RuntimeError):
    pass


class _Handle(ctypes.Structure):
    # c_byte, not c_char: a c_char array reads and writes as a C string, which stops at the first
    # NUL, and real handles contain NULs.
    _fields_ = [("reserved", ctypes.c_byte * IPC_HANDLE_BYTES)]


def _loaded_cudart() -> list[str]:
    """The runtime this process already mapped (torch's, say): sharing it shares its state."""
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    except OSError:
        return []


def _wheel_cudart() -> list[str]:
    """The runtimes the NVIDIA wheels carry: ``nvidia/cu13/lib`` (CUDA 13) and
    ``nvidia/cuda_runtime/lib`` (CUDA 11 and 12)."""
    found: list[str] = []
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return found
    for root in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13", "cuda_runtime"):
            found += sorted(glob.glob(os.path.join(root, sub, "lib", "libcudart.so*")), reverse=True)
    return found


def _candidates() -> list[str]:
    names = _loaded_cudart()
    found = ctypes.util.find_library("cudart")
    if found:
        names.append(found)
    names += _wheel_cudart()
    names += ["libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"]
    return names


class CudaRuntime:
    def __init__(self) -> None:
        lib = None
        for name in _candidates():
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        if lib is None:
            raise CudaError("the CUDA runtime library (libcudart) cannot be loaded")
        self._lib = lib
        self._lib.cudaGetErrorString.restype = ctypes.c_char_p
        self._opened: dict[tuple[bytes, int], int] = {}
        self._lock = threading.Lock()  # a model's own threads (async decoupled execute) open handles too

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise CudaError(f"{what} failed: {self._lib.cudaGetErrorString(code).decode()} ({code})")

    def _open_on(self, handle: bytes, device: int) -> int:
        """Map the memory behind ``handle`` on ``device``; the caller's current device is kept."""
        if len(handle) != IPC_HANDLE_BYTES:
            raise CudaError(f"a CUDA IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
        current = ctypes.c_int(0)
        self._check(self._lib.cudaGetDevice(ctypes.byref(current)), "cudaGetDevice")
        self._check(self._lib.cudaSetDevice(ctypes.c_int(device)), "cudaSetDevice")
        try:
            out = ctypes.c_void_p()
            self._check(self._lib.cudaIpcOpenMemHandle(ctypes.byref(out), _Handle.from_buffer_copy(handle),
                                                       ctypes.c_uint(_LAZY_PEER_ACCESS)), "cudaIpcOpenMemHandle")
            return int(out.value or 0)
        finally:
            self._lib.cudaSetDevice(current)

    def check(self, handle: bytes, device: int) -> None:
        """Open and close a handle: the broker's check that a registration names real memory."""
        ptr = self._open_on(handle, device)
        self._check(self._lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr)), "cudaIpcCloseMemHandle")

    def open(self, handle: bytes, device: int) -> int:
        """Device pointer of the memory behind an IPC handle (opened once, kept until ``close_unlisted``)."""
        key = (handle, device)
        with self._lock:
            ptr = self._opened.get(key)
            if ptr is None:
                ptr = self._opened[key] = self._open_on(handle, device)
            return ptr

    def close_unlisted(self, registered: set[bytes]) -> int:
        """Close the mappings of handles no longer registered; how many were closed."""
        with self._lock:
            gone = [key for key in self._opened if key[0] not in registered]
            for key in gone:
                self._lib.cudaIpcCloseMemHandle(ctypes.c_void_p(self._opened.pop(key)))
            return len(gone)

    def to_host(self, dst: memoryview, ptr: int) -> None:
        buf = (ctypes.c_char * len(dst)).from_buffer(dst)
        self._check(self._lib.cudaMemcpy(buf, ctypes.c_void_p(ptr), ctypes.c_size_t(len(dst)), _D2H), "cudaMemcpy")

    def to_device(self, ptr: int, src: bytes | memoryview) -> None:
        data = bytes(src)
        self._check(self._lib.cudaMemcpy(ctypes.c_void_p(ptr), data, ctypes.c_size_t(len(data)), _H2D), "cudaMemcpy")


_runtime: CudaRuntime | None = None
_runtime_lock = threading.Lock()


def runtime() -> CudaRuntime:
    """The process's CUDA runtime; raises CudaError where there is no CUDA device."""
    global _runtime
    if _runtime is None:
        with _runtime_lock:
            if _runtime is None:
                if cuda_device_count() == 0:
                    raise CudaError("CUDA shared memory is not available: this server has no CUDA device")
                _runtime = CudaRuntime()
    return _runtime


def loaded() -> bool:
    """Whether this process has used CUDA IPC at all (so there may be mappings to close): one
    read, for the worker's loop."""
    return _runtime is not None
