"""Tensors that stay on the GPU between a client's CUDA region and a GPU model.

An input in a CUDA region reaches a GPU instance as a torch tensor over that device memory (no
copy through the host), and a model's device output named for a CUDA region is copied device to
device into it. Everything else crosses to the host as before. torch is imported only when a
tensor here is used: a worker that never sees device memory never pays for it.
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

from shmserve.shm.tensors import DTYPES

# Triton datatype -> the CUDA array interface's type string (BF16 travels as 2-byte words, then
# is viewed as bfloat16: the interface has no spelling for it).
_TYPESTR = {"BOOL": "|b1", "UINT8": "|u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8", "INT8": "|i1",
            "INT16": "<i2", "INT32": "<i4", "INT64": "<i8", "FP16": "<f2", "FP32": "<f4", "FP64": "<f8",
            "BF16": "<i2"}
_WIRE_NAMES = {"bool": "BOOL", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32", "uint64": "UINT64",
               "int8": "INT8", "int16": "INT16", "int32": "INT32", "int64": "INT64", "float16": "FP16",
               "float32": "FP32", "float64": "FP64", "bfloat16": "BF16"}


class _DeviceMemory:
    """Device memory described by the CUDA array interface, which ``torch.as_tensor`` wraps as it is."""

    def __init__(self, ptr: int, shape: list[int], typestr: str) -> None:
        # No "stream" entry: the client's bytes are in place before its request is sent.
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr, "data": (ptr, False),
                                         "strides": None, "version": 2}


def is_tensor(value: Any) -> bool:
    """Whether a backend's value is a torch tensor rather than a numpy array."""
    return not isinstance(value, np.ndarray) and hasattr(value, "is_cuda")


def region_tensor(ptr: int, datatype: str, shape: list[int], device: int) -> Any:
    """A tensor over ``ptr`` on ``device`` (a client's CUDA region), shared, not copied."""
    import torch

    if datatype not in _TYPESTR:
        raise ValueError(f"a {datatype} tensor cannot be used on the device")
    t = torch.as_tensor(_DeviceMemory(ptr, shape, _TYPESTR[datatype]), device=torch.device("cuda", device))
    return t.view(torch.bfloat16) if datatype == "BF16" else t


def wire_datatype(t: Any) -> str:
    """A tensor's Triton datatype (``torch.float32`` -> ``FP32``)."""
    name = str(t.dtype).rpartition(".")[2]
    try:
        return _WIRE_NAMES[name]
    except KeyError:
        raise ValueError(f"unsupported torch dtype {t.dtype}") from None


def host_array(t: Any) -> np.ndarray:
    """A tensor as a numpy array on the host (bfloat16 as the 2-byte words the wire carries)."""
    torch = sys.modules["torch"]
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(DTYPES["BF16"])
    return t.numpy()


def copy_to_region(t: Any, ptr: int, device: int) -> None:
    """Copy a tensor's bytes (from any device) into a CUDA region at ``ptr``, and wait for the copy:
    the answer tells the client its output is there."""
    torch = sys.modules["torch"]
    src = t.detach().contiguous().reshape(-1).view(torch.uint8)
    dst = region_tensor(ptr, "UINT8", [src.numel()], device)
    dst.copy_(src)
    torch.cuda.synchronize(dst.device)


def nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())
