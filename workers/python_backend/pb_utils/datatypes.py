"""Triton's data types: the TRITONSERVER_DataType codes, their numpy types, and the BYTES format.

``Tensor.triton_dtype()`` answers these codes; the tables are keyed so that the common lookup
(a numpy array's dtype) is one dict hit.
"""
from __future__ import annotations

import struct
from typing import Any, Optional

import numpy as np

# TRITONSERVER_DataType codes, as in tritonserver.h.
TYPE_INVALID = 0
TYPE_BOOL = 1
TYPE_UINT8 = 2
TYPE_UINT16 = 3
TYPE_UINT32 = 4
TYPE_UINT64 = 5
TYPE_INT8 = 6
TYPE_INT16 = 7
TYPE_INT32 = 8
TYPE_INT64 = 9
TYPE_FP16 = 10
TYPE_FP32 = 11
TYPE_FP64 = 12
TYPE_BYTES = 13
TYPE_BF16 = 14

# Config-file type strings -> numpy type. Same table as Triton (BOOL maps to Python's ``bool``
# there, which numpy treats as np.bool_).
TRITON_STRING_TO_NUMPY: dict[str, Any] = {
    "TYPE_BOOL": bool,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}

TRITON_TO_NUMPY: dict[int, Any] = {
    TYPE_BOOL: np.bool_,
    TYPE_UINT8: np.uint8,
    TYPE_UINT16: np.uint16,
    TYPE_UINT32: np.uint32,
    TYPE_UINT64: np.uint64,
    TYPE_INT8: np.int8,
    TYPE_INT16: np.int16,
    TYPE_INT32: np.int32,
    TYPE_INT64: np.int64,
    TYPE_FP16: np.float16,
    TYPE_FP32: np.float32,
    TYPE_FP64: np.float64,
    TYPE_BYTES: np.object_,
}

# Keyed by native-endian np.dtype so lookups from arr.dtype are one hash.
NUMPY_TO_TRITON: dict[np.dtype, int] = {
    np.dtype(t): code for code, t in TRITON_TO_NUMPY.items() if t is not np.object_
}


def triton_to_numpy_type(data_type: int) -> Any:
    """TRITONSERVER_DataType code (e.g. 11) -> numpy type (np.float32).
    Returns None for codes numpy cannot represent (INVALID, BF16)."""
    return TRITON_TO_NUMPY.get(data_type)


def numpy_to_triton_type(data_type: Any) -> Optional[int]:
    """numpy dtype/type -> TRITONSERVER_DataType code, or None if Triton has
    no equivalent.  Object and fixed-width bytes (``S``) dtypes are BYTES."""
    if isinstance(data_type, np.dtype):  # the common case, without np.dtype() again
        code = NUMPY_TO_TRITON.get(data_type)
        if code is not None:
            return code
    if data_type is None:
        return None
    try:
        dt = np.dtype(data_type)
    except TypeError:
        return None
    if dt.kind in ("O", "S"):
        return TYPE_BYTES
    return NUMPY_TO_TRITON.get(dt)


def triton_string_to_numpy(triton_type_string: str) -> Any:
    """Config data_type string (e.g. "TYPE_FP32") -> numpy type.  Raises
    KeyError for unknown strings, as Triton does."""
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def serialize_byte_tensor(input_tensor: np.ndarray) -> Optional[bytes]:
    """Flatten a BYTES tensor (object or ``S`` array) in C order into Triton's
    wire format: each element as <uint32 little-endian length><bytes>.

    Returns b"" for an empty tensor and None for non-BYTES dtypes.  str
    elements are UTF-8 encoded; other non-bytes objects go through str().
    """
    if input_tensor.dtype.kind not in ("O", "S"):
        return None
    if input_tensor.size == 0:
        return b""
    pack = struct.Struct("<I").pack
    parts: list[bytes] = []
    for item in input_tensor.reshape(-1, order="C"):
        if isinstance(item, (bytes, bytearray, memoryview)):
            b = bytes(item)
        elif isinstance(item, str):
            b = item.encode("utf-8")
        else:
            b = str(item).encode("utf-8")
        parts.append(pack(len(b)))
        parts.append(b)
    return b"".join(parts)


class TruncatedBytesTensor(struct.error, ValueError):
    """A BYTES buffer that ends inside an element: ``struct.error`` as Triton's ``struct``-based
    decoder raises it (a model may catch that), and the ValueError it is."""


def deserialize_bytes_tensor(encoded_tensor: Any) -> np.ndarray:
    """Inverse of serialize_byte_tensor: length-prefixed buffer (bytes,
    bytearray, memoryview or uint8 array) -> 1-D object array of bytes."""
    mv = memoryview(encoded_tensor).cast("B")
    unpack = struct.Struct("<I").unpack_from
    total = len(mv)
    out: list[bytes] = []
    offset = 0
    while offset < total:
        if offset + 4 > total:
            raise TruncatedBytesTensor("truncated BYTES tensor: incomplete length prefix")
        (n,) = unpack(mv, offset)
        offset += 4
        end = offset + n
        if end > total:
            raise TruncatedBytesTensor("truncated BYTES tensor: element exceeds buffer")
        out.append(mv[offset:end].tobytes())
        offset = end
    arr = np.empty(len(out), dtype=np.object_)
    arr[:] = out
    return arr
