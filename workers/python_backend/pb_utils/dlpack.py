"""DLPack plumbing for ``Tensor.from_dlpack``: numpy imports what it can, torch (imported lazily,
an optional dependency) the rest, GPU and bfloat16 tensors.

A raw capsule can be consumed only once, so it is read without consuming it (through ctypes) to
pick the importer before either touches it.
"""
from __future__ import annotations

import ctypes
from typing import Any, Optional

from . import datatypes as dt
from .errors import TritonModelException

DL_CPU = 1
DL_CUDA = 2
DL_CUDA_HOST = 3

# DLPack dtype codes numpy can import: int(0), uint(1), float(2), bool(6).
NUMPY_DL_DTYPES = {(0, 8), (0, 16), (0, 32), (0, 64), (1, 8), (1, 16), (1, 32),
                   (1, 64), (2, 16), (2, 32), (2, 64), (6, 8)}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


# Byte offset of the DLTensor inside DLManagedTensorVersioned (version,
# manager_ctx, deleter, flags precede it); legacy DLManagedTensor starts with it.
_VERSIONED_DLTENSOR_OFFSET = 8 + 8 + 8 + 8

_capsule_get_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_get_name.restype = ctypes.c_char_p
_capsule_get_name.argtypes = [ctypes.py_object]
_capsule_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get_pointer.restype = ctypes.c_void_p
_capsule_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def is_capsule(obj: Any) -> bool:
    return type(obj).__name__ == "PyCapsule"


def peek_capsule(capsule: Any) -> tuple[bool, int, int, int, int]:
    """Read (versioned, device_type, device_id, dtype code, dtype bits) from
    an unused DLPack capsule without consuming it, to pick numpy vs torch."""
    name = _capsule_get_name(capsule)
    if name == b"dltensor":
        offset = 0
    elif name == b"dltensor_versioned":
        offset = _VERSIONED_DLTENSOR_OFFSET
    else:
        raise TritonModelException(
            f"invalid DLPack capsule (name {name!r}); a capsule can only be consumed once"
        )
    ptr = _capsule_get_pointer(capsule, name)
    t = _DLTensor.from_address(ptr + offset)
    return offset != 0, t.device.device_type, t.device.device_id, t.dtype.code, t.dtype.bits


class CapsuleProducer:
    """Adapts a raw capsule to the ``__dlpack__`` protocol numpy consumes."""

    def __init__(self, capsule: Any, device: tuple[int, int]) -> None:
        self._capsule = capsule
        self._device = device

    def __dlpack__(self, stream: Any = None, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device


def import_torch(why: str) -> Any:
    try:
        import torch  # noqa: PLC0415 - optional dependency, imported lazily
    except ImportError:
        raise TritonModelException(f"{why} requires PyTorch, which is not installed") from None
    return torch


_TORCH_TO_TRITON: Optional[dict[Any, int]] = None  # built on first use: torch is imported lazily


def torch_dtype_to_triton(torch: Any, dtype: Any) -> int:
    global _TORCH_TO_TRITON
    if _TORCH_TO_TRITON is None:
        _TORCH_TO_TRITON = {
            torch.bool: dt.TYPE_BOOL, torch.uint8: dt.TYPE_UINT8, torch.int8: dt.TYPE_INT8,
            torch.int16: dt.TYPE_INT16, torch.int32: dt.TYPE_INT32, torch.int64: dt.TYPE_INT64,
            torch.float16: dt.TYPE_FP16, torch.float32: dt.TYPE_FP32,
            torch.float64: dt.TYPE_FP64, torch.bfloat16: dt.TYPE_BF16,
        }
        for name, code in (("uint16", dt.TYPE_UINT16), ("uint32", dt.TYPE_UINT32),
                           ("uint64", dt.TYPE_UINT64)):
            if hasattr(torch, name):
                _TORCH_TO_TRITON[getattr(torch, name)] = code
    code = _TORCH_TO_TRITON.get(dtype)
    if code is None:
        raise TritonModelException(f"DLPack dtype {dtype} is not supported")
    return code
