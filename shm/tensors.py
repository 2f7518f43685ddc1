"""Triton datatypes, their numpy equivalents, and the length-prefixed wire form of BYTES tensors."""
from __future__ import annotations

import struct
from typing import Any

import numpy as np

try:  # BF16 has no numpy dtype; torch's ml_dtypes-free path keeps it as raw uint16 in numpy.
    from ml_dtypes import bfloat16 as _bf16  # type: ignore
except ImportError:  # pragma: no cover - depends on the environment
    _bf16 = None

# Triton wire datatype -> numpy dtype. BF16 travels as 2-byte words (numpy has no bfloat16).
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BF16": np.dtype(_bf16) if _bf16 is not None else np.dtype(np.uint16),
    "BYTES": np.dtype(np.object_),
}

# Model-config spelling (TYPE_FP32) <-> wire spelling (FP32).
CONFIG_TO_WIRE = {f"TYPE_{k}": k for k in DTYPES if k != "BYTES"}
CONFIG_TO_WIRE["TYPE_STRING"] = "BYTES"
WIRE_TO_CONFIG = {v: k for k, v in CONFIG_TO_WIRE.items()}

_NUMPY_TO_WIRE = {np.dtype(np.bool_): "BOOL", np.dtype(np.uint8): "UINT8", np.dtype(np.uint16): "UINT16",
                  np.dtype(np.uint32): "UINT32", np.dtype(np.uint64): "UINT64", np.dtype(np.int8): "INT8",
                  np.dtype(np.int16): "INT16", np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64",
                  np.dtype(np.float16): "FP16", np.dtype(np.float32): "FP32", np.dtype(np.float64): "FP64",
                  np.dtype(np.object_): "BYTES"}

_LEN = struct.Struct("<I")


def wire_datatype(array: np.ndarray) -> str:
    dt = array.dtype
    if dt.kind in ("S", "U", "O"):
        return "BYTES"
    if _bf16 is not None and dt == DTYPES["BF16"]:
        return "BF16"
    try:
        return _NUMPY_TO_WIRE[dt]
    except KeyError:
        raise ValueError(f"unsupported numpy dtype {dt}") from None


def element_count(shape: list[int] | tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def itemsize(datatype: str) -> int:
    """Bytes per element, 0 for BYTES (variable length)."""
    return 0 if datatype == "BYTES" else DTYPES[datatype].itemsize


def _as_bytes(item: object) -> bytes:
    if isinstance(item, bytes):
        return item
    if isinstance(item, str):
        return item.encode()
    if isinstance(item, (bytearray, memoryview, np.bytes_)):
        return bytes(item)
    return str(item).encode()


def serialize_bytes(array: np.ndarray) -> bytes:
    """Triton's BYTES layout: each element as a 4-byte little-endian length and its bytes."""
    parts = []
    for item in array.reshape(-1):
        b = _as_bytes(item)
        parts.append(_LEN.pack(len(b)))
        parts.append(b)
    return b"".join(parts)


def deserialize_bytes(buf: memoryview | bytes, count: int | None = None) -> np.ndarray:
    """Inverse of ``serialize_bytes``; raises ValueError on a malformed buffer (``BytesFraming``,
    in the words of Triton's check, when ``count`` is given)."""
    out: list[bytes] = []
    pos, end = 0, len(buf)
    while pos < end and (count is None or len(out) < count):
        if pos + 4 > end:
            raise _malformed(buf, count)
        (n,) = _LEN.unpack_from(buf, pos)
        pos += 4
        if pos + n > end:
            raise _malformed(buf, count)
        out.append(bytes(buf[pos:pos + n]))
        pos += n
    if count is not None and (len(out) != count or pos != end):
        raise BytesFraming(buf, count)
    arr = np.empty(len(out), dtype=np.object_)
    arr[:] = out
    return arr


def bytes_framing_problem(buf: Any, count: int) -> tuple[str, int, int]:
    """What is wrong with BYTES ``buf`` that should hold ``count`` elements, found as Triton's
    core walks the 4-byte lengths: ("more", count + 1, 0): an element past ``count`` starts;
    ("length", available, 0): a length is cut off; ("data", length, available): the last element
    is cut off; ("fewer", elements, 0): fewer elements (a cut-off one counted)."""
    view = memoryview(buf).cast("B")
    pos = checked = 0
    end = len(view)
    while pos < end:
        if end - pos < 4:  # (looked at before the count, as the core does)
            return "length", end - pos, 0
        if checked == count:
            return "more", count + 1, 0
        (length,) = _LEN.unpack_from(view, pos)
        pos += 4
        checked += 1
        if pos + length > end and checked == count:
            return "data", length, end - pos
        pos += length
    return "fewer", checked, 0


def _malformed(buf: Any, count: int | None) -> ValueError:
    return ValueError("BYTES tensor is truncated: an element is cut off") if count is None else BytesFraming(buf, count)


def bytes_count_words(tag: str, model: str, name: str, expected: int, got: int) -> str:
    """Triton's core's refusal of BYTES input ``name`` holding ``got`` elements where its shape
    holds ``expected`` (the core counts one past ``expected`` and stops); ``tag``: the request's
    ``[request id: ...] `` prefix (shmserve/signature.py request_tag)."""
    if got > expected:
        return (f"{tag}unexpected number of string elements {expected + 1} for inference input '{name}' for model "
                f"'{model}', expecting {expected}")
    return f"{tag}expected {expected} string elements for inference input '{name}' for model '{model}', got {got}"


class BytesFraming(ValueError):
    """A BYTES tensor whose 4-byte lengths do not frame the ``count`` elements of its shape, as
    Triton's core finds it (``bytes_framing_problem``). Its text names no input (not known where
    the bytes are read); ``for_input`` gives Triton's whole text where it is."""

    input_name = ""  # the input it is, where the reader knows it (workers/requests.py)

    def __init__(self, buf: Any, count: int) -> None:
        self.kind, self.first, self.second = bytes_framing_problem(buf, count)
        self.count = count
        super().__init__(self.for_input("", "", "", named=False))

    def for_input(self, tag: str, model: str, name: str, named: bool = True) -> str:
        """Triton's refusal, naming input ``name`` of ``model`` after the request's ``tag``."""
        where = f"inference input '{name}' for model '{model}'" if named else "a BYTES tensor"
        a, b = self.first, self.second
        if self.kind == "length":
            return (f"{tag}incomplete string length indicator for {where}, expecting 4 bytes but only {a} bytes "
                    f"available" + (". Please make sure the string length indicator is in one buffer." if named else ""))
        if self.kind == "data":
            where = f"inference input '{name}'" if named else "a BYTES tensor"
            return f"incomplete string data for {where}, expecting string of length {a} but only {b} bytes available"
        if named:
            return bytes_count_words(tag, model, name, self.count, a if self.kind == "fewer" else self.count + 1)
        if self.kind == "more":
            return f"unexpected number of string elements {a} for a BYTES tensor, expecting {self.count}"
        return f"expected {self.count} string elements for a BYTES tensor, got {a}"


def byte_view(array: np.ndarray) -> memoryview:
    """The raw bytes of a numeric tensor (a view when contiguous), of any shape, empty included.
    A contiguous array's own buffer, cast, is three times cheaper than the numpy way; casts
    refuse some shapes (zeros in them) and dtypes (bfloat16), which take the numpy way."""
    if array.flags.c_contiguous:
        try:
            return memoryview(array).cast("B")  # type: ignore[arg-type] # (numpy's stubs lack Buffer)
        except (TypeError, ValueError, BufferError):
            pass
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def from_buffer(buf: memoryview, datatype: str, shape: list[int]) -> np.ndarray:
    """A numpy view over ``buf`` (no copy) or, for BYTES, the decoded object array."""
    if datatype == "BYTES":
        return deserialize_bytes(buf, element_count(shape)).reshape(shape)
    dtype = DTYPES[datatype]
    if len(buf) != element_count(shape) * dtype.itemsize:
        raise ValueError(f"{len(buf)} bytes cannot hold a {datatype} tensor of shape {list(shape)}")
    return np.ndarray(shape, dtype, buf)  # a third of frombuffer + reshape
