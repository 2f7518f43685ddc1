"""CUDA IPC for the KServe CUDA shared-memory extension, through the CUDA runtime via ctypes.

A client registers device memory by its ``cudaIpcMemHandle_t`` (64 bytes, base64 on the wire). A
worker opens the handle once (cached), then copies tensor bytes between that device memory and
host memory with ``cudaMemcpy``. Only loaded when a CUDA device exists (``devices.cuda_device_count``):
on a machine without one the extension answers clear errors and nothing here is touched.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import os

from .devices import cuda_device_count

IPC_HANDLE_BYTES = 64
_LAZY_PEER_ACCESS = 1
_H2D, _D2H = 1, 2


class CudaError(RuntimeError):
    pass


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


def _candidates() -> list[str]:
    names = ["libcudart.so", "libcudart.so.12", "libcudart.so.11.0"]
    found = ctypes.util.find_library("cudart")
    if found:
        names.insert(0, found)
    try:  # torch's CUDA wheels carry their own runtime
        import importlib.util

        spec = importlib.util.find_spec("nvidia.cuda_runtime")
        if spec and spec.submodule_search_locations:
            for loc in spec.submodule_search_locations:
                names += glob.glob(os.path.join(loc, "lib", "libcudart.so*"))
    except (ImportError, ValueError):
        pass
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
        self._opened: dict[tuple[bytes, int], int] = {}

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            self._lib.cudaGetErrorString.restype = ctypes.c_char_p
            raise CudaError(f"{what} failed: {self._lib.cudaGetErrorString(code).decode()} ({code})")

    def open(self, handle: bytes, device: int) -> int:
        """Device pointer of the memory behind an IPC handle (opened once per process)."""
        key = (handle, device)
        ptr = self._opened.get(key)
        if ptr is None:
            if len(handle) != IPC_HANDLE_BYTES:
                raise CudaError(f"a CUDA IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
            self._check(self._lib.cudaSetDevice(ctypes.c_int(device)), "cudaSetDevice")
            out = ctypes.c_void_p()
            self._check(self._lib.cudaIpcOpenMemHandle(ctypes.byref(out), _Handle(handle), _LAZY_PEER_ACCESS),
                        "cudaIpcOpenMemHandle")
            ptr = self._opened[key] = int(out.value or 0)
        return ptr

    def to_host(self, dst: memoryview, ptr: int) -> None:
        buf = (ctypes.c_char * len(dst)).from_buffer(dst)
        self._check(self._lib.cudaMemcpy(buf, ctypes.c_void_p(ptr), ctypes.c_size_t(len(dst)), _D2H), "cudaMemcpy")

    def to_device(self, ptr: int, src: bytes | memoryview) -> None:
        data = bytes(src)
        self._check(self._lib.cudaMemcpy(ctypes.c_void_p(ptr), data, ctypes.c_size_t(len(data)), _H2D), "cudaMemcpy")

    def close_all(self) -> None:
        for ptr in self._opened.values():
            self._lib.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr))
        self._opened.clear()


@functools.lru_cache(maxsize=1)
def runtime() -> CudaRuntime:
    """The process's CUDA runtime; raises CudaError where there is no CUDA device."""
    if cuda_device_count() == 0:
        raise CudaError("CUDA shared memory is not available: this server has no CUDA device")
    return CudaRuntime()
