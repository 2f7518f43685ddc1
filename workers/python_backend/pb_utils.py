"""Clean-room implementation of Triton's ``triton_python_backend_utils`` API.

The shmserve Python-backend worker installs this module as
``sys.modules["triton_python_backend_utils"]`` so that a ``model.py`` written
for NVIDIA Triton's Python backend runs unchanged.  Only the public API is
reproduced (names, signatures, observable behaviour); the implementation is
our own and is pure Python on top of numpy (torch is optional and imported
lazily, only for DLPack cases numpy cannot handle: GPU and bfloat16 tensors).

Not supported yet (raise ``TritonModelException`` with "not supported yet"):
BLS to decoupled models (``exec(decoupled=True)``)
(``InferenceRequest.get_response_sender``), request rescheduling, the model
loading API and custom metrics.  See docs/python_backend.md.

Worker-only hooks (not part of Triton's API, underscore-prefixed):
``_set_model_dir(path)`` and ``InferenceRequest._set_cancelled(flag)``.
"""

from __future__ import annotations

import base64
import copy
import ctypes
import enum
import json
import logging
import numbers
import struct
import sys
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

__all__ = [
    # classes
    "Tensor",
    "InferenceRequest",
    "InferenceResponse",
    "InferenceTrace",
    "PreferredMemory",
    "MemoryType",
    "TritonError",
    "TritonModelException",
    "Logger",
    "ModelConfig",
    "MetricFamily",
    # functions
    "get_input_tensor_by_name",
    "get_output_tensor_by_name",
    "get_input_config_by_name",
    "get_output_config_by_name",
    "using_decoupled_model_transaction_policy",
    "triton_to_numpy_type",
    "numpy_to_triton_type",
    "triton_string_to_numpy",
    "serialize_byte_tensor",
    "deserialize_bytes_tensor",
    "get_model_dir",
    "load_model",
    "unload_model",
    "is_model_ready",
    # constants
    "TRITON_STRING_TO_NUMPY",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL",
    "TRITONSERVER_REQUEST_RELEASE_ALL",
    "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE",
    "TRITONSERVER_MEMORY_GPU",
    "TRITONSERVER_MEMORY_CPU",
]

# ---------------------------------------------------------------------------
# Module-level constants (values as in Triton's tritonserver.h / pb utils)
# ---------------------------------------------------------------------------

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START: int = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END: int = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL: int = 1
TRITONSERVER_REQUEST_RELEASE_ALL: int = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE: int = 2

# TRITONSERVER_DataType numeric codes; Tensor.triton_dtype() returns these.
_TYPE_INVALID = 0
_TYPE_BOOL = 1
_TYPE_UINT8 = 2
_TYPE_UINT16 = 3
_TYPE_UINT32 = 4
_TYPE_UINT64 = 5
_TYPE_INT8 = 6
_TYPE_INT16 = 7
_TYPE_INT32 = 8
_TYPE_INT64 = 9
_TYPE_FP16 = 10
_TYPE_FP32 = 11
_TYPE_FP64 = 12
_TYPE_BYTES = 13
_TYPE_BF16 = 14

# Config-file type strings -> numpy type.  Same table as Triton (note BOOL
# maps to Python's ``bool`` there, which numpy treats as np.bool_).
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

_TRITON_TO_NUMPY: dict[int, Any] = {
    _TYPE_BOOL: np.bool_,
    _TYPE_UINT8: np.uint8,
    _TYPE_UINT16: np.uint16,
    _TYPE_UINT32: np.uint32,
    _TYPE_UINT64: np.uint64,
    _TYPE_INT8: np.int8,
    _TYPE_INT16: np.int16,
    _TYPE_INT32: np.int32,
    _TYPE_INT64: np.int64,
    _TYPE_FP16: np.float16,
    _TYPE_FP32: np.float32,
    _TYPE_FP64: np.float64,
    _TYPE_BYTES: np.object_,
}

# Keyed by native-endian np.dtype so lookups from arr.dtype are one hash.
_NUMPY_TO_TRITON: dict[np.dtype, int] = {
    np.dtype(t): code for code, t in _TRITON_TO_NUMPY.items() if t is not np.object_
}


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


class TritonModelException(Exception):
    """Raised by the API (and by models) for failures in initialize/execute/
    finalize.  In Triton this is a plain Exception subclass; ``message()`` is
    kept for code written against older python_backend releases."""

    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class _ErrorCode(enum.IntEnum):
    """TRITONSERVER_Error_Code values, exposed as ``TritonError.<NAME>``."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7


class TritonError:
    """Per-response error (not an exception): put it in
    ``InferenceResponse(error=...)`` to fail one request of a batch."""

    UNKNOWN = _ErrorCode.UNKNOWN
    INTERNAL = _ErrorCode.INTERNAL
    NOT_FOUND = _ErrorCode.NOT_FOUND
    INVALID_ARG = _ErrorCode.INVALID_ARG
    UNAVAILABLE = _ErrorCode.UNAVAILABLE
    UNSUPPORTED = _ErrorCode.UNSUPPORTED
    ALREADY_EXISTS = _ErrorCode.ALREADY_EXISTS
    CANCELLED = _ErrorCode.CANCELLED

    def __init__(self, message: str, code: int = _ErrorCode.INTERNAL) -> None:
        if not isinstance(message, str):
            raise TypeError(
                f"TritonError message must be a str, got {type(message).__name__}"
            )
        try:
            self._code = _ErrorCode(code)
        except (ValueError, TypeError):
            raise TypeError(f"invalid TritonError code: {code!r}") from None
        self._message = message

    def message(self) -> str:
        return self._message

    def code(self) -> _ErrorCode:
        return self._code

    def __str__(self) -> str:
        return self._message

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, TritonError.{self._code.name})"


def _not_supported(feature: str) -> TritonModelException:
    """Uniform error for API surface shmserve does not implement yet, so a
    model fails loudly instead of silently misbehaving."""
    return TritonModelException(f"{feature} is not supported yet by shmserve")


# ---------------------------------------------------------------------------
# Type helpers
# ---------------------------------------------------------------------------


def triton_to_numpy_type(data_type: int) -> Any:
    """TRITONSERVER_DataType code (e.g. 11) -> numpy type (np.float32).
    Returns None for codes numpy cannot represent (INVALID, BF16)."""
    return _TRITON_TO_NUMPY.get(data_type)


def numpy_to_triton_type(data_type: Any) -> Optional[int]:
    """numpy dtype/type -> TRITONSERVER_DataType code, or None if Triton has
    no equivalent.  Object and fixed-width bytes (``S``) dtypes are BYTES."""
    if isinstance(data_type, np.dtype):  # the common case, without np.dtype() again
        code = _NUMPY_TO_TRITON.get(data_type)
        if code is not None:
            return code
    if data_type is None:
        return None
    try:
        dt = np.dtype(data_type)
    except TypeError:
        return None
    if dt.kind in ("O", "S"):
        return _TYPE_BYTES
    return _NUMPY_TO_TRITON.get(dt)


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
            raise ValueError("truncated BYTES tensor: incomplete length prefix")
        (n,) = unpack(mv, offset)
        offset += 4
        end = offset + n
        if end > total:
            raise ValueError("truncated BYTES tensor: element exceeds buffer")
        out.append(mv[offset:end].tobytes())
        offset = end
    arr = np.empty(len(out), dtype=np.object_)
    arr[:] = out
    return arr


# ---------------------------------------------------------------------------
# DLPack plumbing (numpy first, torch lazily for GPU / bfloat16)
# ---------------------------------------------------------------------------

_DL_CPU = 1
_DL_CUDA = 2
_DL_CUDA_HOST = 3


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


def _is_capsule(obj: Any) -> bool:
    return type(obj).__name__ == "PyCapsule"


def _peek_capsule(capsule: Any) -> tuple[bool, int, int, int, int]:
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


class _CapsuleProducer:
    """Adapts a raw capsule to the ``__dlpack__`` protocol numpy consumes."""

    def __init__(self, capsule: Any, device: tuple[int, int]) -> None:
        self._capsule = capsule
        self._device = device

    def __dlpack__(self, stream: Any = None, **_: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device


# DLPack dtype codes numpy can import: int(0), uint(1), float(2), bool(6).
_NUMPY_DL_DTYPES = {(0, 8), (0, 16), (0, 32), (0, 64), (1, 8), (1, 16), (1, 32),
                    (1, 64), (2, 16), (2, 32), (2, 64), (6, 8)}


def _import_torch(why: str) -> Any:
    try:
        import torch  # noqa: PLC0415 - optional dependency, imported lazily
    except ImportError:
        raise TritonModelException(f"{why} requires PyTorch, which is not installed") from None
    return torch


_TORCH_TO_TRITON: Optional[dict[Any, int]] = None


def _torch_dtype_to_triton(torch: Any, dtype: Any) -> int:
    global _TORCH_TO_TRITON
    if _TORCH_TO_TRITON is None:
        _TORCH_TO_TRITON = {
            torch.bool: _TYPE_BOOL, torch.uint8: _TYPE_UINT8, torch.int8: _TYPE_INT8,
            torch.int16: _TYPE_INT16, torch.int32: _TYPE_INT32, torch.int64: _TYPE_INT64,
            torch.float16: _TYPE_FP16, torch.float32: _TYPE_FP32,
            torch.float64: _TYPE_FP64, torch.bfloat16: _TYPE_BF16,
        }
        for name, code in (("uint16", _TYPE_UINT16), ("uint32", _TYPE_UINT32),
                           ("uint64", _TYPE_UINT64)):
            if hasattr(torch, name):
                _TORCH_TO_TRITON[getattr(torch, name)] = code
    code = _TORCH_TO_TRITON.get(dtype)
    if code is None:
        raise TritonModelException(f"DLPack dtype {dtype} is not supported")
    return code


# ---------------------------------------------------------------------------
# Tensor
# ---------------------------------------------------------------------------


class Tensor:
    """Named tensor for request inputs and response outputs.

    The numpy array is kept exactly as given (no copy), so an input that is a
    view over shared memory stays a view.  Like Triton, a non C-contiguous
    array is made contiguous (that one case copies).  BYTES tensors are numpy
    object arrays of ``bytes``.
    """

    _torch: Any = None  # set only for GPU / bfloat16 DLPack imports

    def __init__(self, name: str, numpy_array: Any) -> None:
        if not isinstance(name, str):
            raise TypeError(f"Tensor name must be a str, got {type(name).__name__}")
        if name == "":
            raise TritonModelException("Tensor name cannot be an empty string.")
        arr = numpy_array if isinstance(numpy_array, np.ndarray) else np.asarray(numpy_array)
        dtype = numpy_to_triton_type(arr.dtype)
        if dtype is None:
            raise TritonModelException(
                f"NumPy dtype {arr.dtype} is not supported (use np.object_ "
                "arrays of bytes for string tensors)."
            )
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        self._name = name
        self._array: Optional[np.ndarray] = arr
        self._torch: Any = None  # set only for GPU / bfloat16 DLPack imports
        self._dtype = dtype

    @classmethod
    def _wrap(cls, name: str, arr: np.ndarray, dtype: int) -> "Tensor":
        """Worker hook: an input whose array is known C-contiguous and of Triton type ``dtype``
        (skips the checks of ``__init__``, which cost more than the model's own work on small
        requests)."""
        self = cls.__new__(cls)
        self._name = name
        self._array = arr
        self._dtype = dtype  # (``_torch``: None, from the class)
        return self

    @classmethod
    def _from_torch(cls, name: str, t: Any, dtype: int) -> "Tensor":
        self = cls.__new__(cls)
        self._name = name
        self._array = None
        self._torch = t
        self._dtype = dtype
        return self

    def name(self) -> str:
        return self._name

    def triton_dtype(self) -> int:
        """TRITONSERVER_DataType code (e.g. 11 for FP32, 13 for BYTES)."""
        return self._dtype

    def shape(self) -> list[int]:
        if self._array is not None:
            return list(self._array.shape)
        return [int(d) for d in self._torch.shape]

    def is_cpu(self) -> bool:
        return self._array is not None or self._torch.device.type == "cpu"

    def as_numpy(self) -> np.ndarray:
        """The underlying array itself (not a copy)."""
        if self._array is not None:
            return self._array
        if self._torch.device.type != "cpu":
            raise TritonModelException(
                "Tensor is stored in GPU and cannot be converted to NumPy."
            )
        raise TritonModelException(
            "as_numpy() is not supported for BF16 tensors; use to_dlpack() instead."
        )

    def to_dlpack(self) -> Any:
        """Zero-copy DLPack capsule (e.g. for ``torch.from_dlpack``)."""
        if self._dtype == _TYPE_BYTES:
            raise TritonModelException("DLPack does not have support for string tensors.")
        if self._array is None:
            return self._torch.__dlpack__()
        try:
            return self._array.__dlpack__()
        except BufferError:
            if self._array.flags.writeable:
                raise
        # Read-only arrays (e.g. views of read-only shared memory) can only be
        # exported with the versioned DLPack protocol, which carries the flag.
        try:
            return self._array.__dlpack__(max_version=(1, 0))
        except (TypeError, BufferError) as exc:
            raise TritonModelException(
                f"cannot export read-only tensor '{self._name}' via DLPack: {exc}"
            ) from exc

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        """DLPack protocol, so ``torch.from_dlpack(pb_tensor)`` works."""
        if self._dtype == _TYPE_BYTES:
            raise TritonModelException("DLPack does not have support for string tensors.")
        src = self._array if self._array is not None else self._torch
        return src.__dlpack__(stream=stream, **kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        if self._array is not None:
            return (_DL_CPU, 0)
        return self._torch.__dlpack_device__()

    @staticmethod
    def from_dlpack(name: str, dlpack_tensor: Any) -> "Tensor":
        """Wrap a DLPack capsule or any object with ``__dlpack__`` (torch
        tensor, numpy array, ...) without copying.  CPU tensors of numpy
        dtypes become numpy-backed; GPU and bfloat16 tensors need torch."""
        if not isinstance(name, str):
            raise TypeError(f"Tensor name must be a str, got {type(name).__name__}")
        if name == "":
            raise TritonModelException("Tensor name cannot be an empty string.")

        producer: Any
        if _is_capsule(dlpack_tensor):
            versioned, dev_type, dev_id, code, bits = _peek_capsule(dlpack_tensor)
            numpy_ok = dev_type == _DL_CPU and (code, bits) in _NUMPY_DL_DTYPES
            # numpy imports legacy (unversioned) capsules read-only, Triton's
            # array is writable; torch keeps it writable and zero-copy, so
            # prefer it when the model has it loaded (it made the capsule).
            if numpy_ok and not versioned and "torch" in sys.modules:
                numpy_ok = False
            producer = _CapsuleProducer(dlpack_tensor, (dev_type, dev_id))
        elif hasattr(dlpack_tensor, "__dlpack__"):
            dev_type = int(dlpack_tensor.__dlpack_device__()[0])
            numpy_ok = dev_type == _DL_CPU
            producer = dlpack_tensor
        else:
            raise TritonModelException(
                "Provided tensor is not supported. Tensor must be a DLPack "
                "capsule or have a `__dlpack__` attribute"
            )

        if numpy_ok:
            try:
                arr = np.from_dlpack(producer)
            except (RuntimeError, BufferError, TypeError, ValueError) as exc:
                if _is_capsule(dlpack_tensor):  # capsule may be consumed: no retry
                    raise TritonModelException(f"cannot import DLPack tensor: {exc}") from exc
            else:
                if not arr.flags.c_contiguous:
                    raise TritonModelException(
                        "DLPack tensor is not contiguous. Only contiguous DLPack "
                        "tensors that are stored in C-Order are supported."
                    )
                return Tensor(name, arr)

        torch = _import_torch("importing a GPU or bfloat16 DLPack tensor")
        try:
            t = torch.from_dlpack(dlpack_tensor)
        except Exception as exc:  # torch raises several types here
            raise TritonModelException(f"cannot import DLPack tensor: {exc}") from exc
        if not t.is_contiguous():
            raise TritonModelException(
                "DLPack tensor is not contiguous. Only contiguous DLPack "
                "tensors that are stored in C-Order are supported."
            )
        dtype = _torch_dtype_to_triton(torch, t.dtype)
        if t.device.type == "cpu" and dtype != _TYPE_BF16:
            return Tensor(name, t.numpy())
        return Tensor._from_torch(name, t, dtype)

    def __repr__(self) -> str:
        return f"Tensor(name={self._name!r}, dtype={self._dtype}, shape={self.shape()})"


# ---------------------------------------------------------------------------
# Request / response
# ---------------------------------------------------------------------------


class MemoryType(enum.IntEnum):
    """Preferred memory for BLS outputs (BLS itself is not supported yet)."""

    TRITONSERVER_MEMORY_GPU = 0
    TRITONSERVER_MEMORY_CPU = 1


TRITONSERVER_MEMORY_GPU = MemoryType.TRITONSERVER_MEMORY_GPU
TRITONSERVER_MEMORY_CPU = MemoryType.TRITONSERVER_MEMORY_CPU


class PreferredMemory:
    """Where BLS output tensors should be placed; accepted and recorded so
    Triton model code constructs fine, but only matters once BLS exists."""

    def __init__(self, preferred_memory_type: MemoryType, preferred_device_id: int = 0) -> None:
        self.preferred_memory_type = MemoryType(preferred_memory_type)
        self.preferred_device_id = int(preferred_device_id)

    def __repr__(self) -> str:
        return (f"PreferredMemory({self.preferred_memory_type.name}, "
                f"{self.preferred_device_id})")


class InferenceTrace:
    """Trace handle; shmserve has no OpenTelemetry context to propagate, so
    ``get_context()`` returns None (what Triton returns when tracing is off)."""

    def __init__(self, context: Optional[str] = None) -> None:
        self._context = context or None

    def get_context(self) -> Optional[str]:
        return self._context


_PARAM_VALUE_TYPES = (bool, int, float, str)


def _parameters_to_json(parameters: Optional[Mapping[str, Any]]) -> str:
    """Validate request/response parameters and encode them the way Triton
    exposes them: a JSON object string.  Triton allows bool/int/str values;
    float is also accepted because the KServe protocol has double params."""
    if not parameters:
        return "{}"
    if isinstance(parameters, str):
        return parameters
    if not isinstance(parameters, Mapping):
        raise TypeError(f"parameters must be a dict, got {type(parameters).__name__}")
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(
                f"Expect parameters keys to have type str, found type {type(key).__name__}"
            )
        if not isinstance(value, _PARAM_VALUE_TYPES):
            raise TritonModelException(
                "Expect parameters values to have type bool/int/str, found type "
                f"{type(value).__name__}"
            )
    return json.dumps(dict(parameters))


_REQUIRED: Any = object()


def _text(value: Any) -> Any:
    """``bytes`` as the str it encodes (UTF-8); anything else unchanged, for the type checks."""
    return value.decode("utf-8") if isinstance(value, (bytes, bytearray)) else value


class InferenceRequest:
    """One inference request handed to ``execute``.  Also the BLS request
    type in Triton; BLS execution is not supported yet (exec/async_exec
    raise).  The worker builds incoming requests with this same constructor.
    """

    _response_sender: Any = None  # set by the worker for a decoupled model's requests
    # Fields alike for every request the worker builds (``_incoming``); ``__init__`` and
    # ``_set_cancelled`` set the instance's own, and ``trace()`` makes a request's trace handle
    # when it is first asked for.
    _model_version = -1
    _timeout = 0
    _preferred_memory: Optional[PreferredMemory] = None
    _trace: Optional[InferenceTrace] = None
    _cancelled = False

    def __init__(
        self,
        request_id: str = "",
        correlation_id: int | str = 0,
        inputs: Sequence[Tensor] = _REQUIRED,
        requested_output_names: Iterable[str] = _REQUIRED,
        model_name: str = _REQUIRED,
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        preferred_memory: Optional[PreferredMemory] = None,
        trace: Optional[InferenceTrace] = None,
        parameters: Optional[Mapping[str, Any]] = None,
    ) -> None:
        for arg_name, value in (("inputs", inputs),
                                ("requested_output_names", requested_output_names),
                                ("model_name", model_name)):
            if value is _REQUIRED:
                raise TypeError(f"InferenceRequest() missing required argument '{arg_name}'")
            if value is None:
                raise TypeError(f"InferenceRequest() argument '{arg_name}' must not be None")
        # Strings may come as bytes (e.g. a BYTES input's as_numpy()[0]), as Triton's binding takes them.
        request_id, model_name = _text(request_id), _text(model_name)
        if not isinstance(request_id, str):
            raise TypeError("request_id must be a str")
        if isinstance(correlation_id, bool) or not isinstance(correlation_id, (int, str)):
            raise TritonModelException("Correlation ID must be integer or string")
        if isinstance(correlation_id, int) and correlation_id < 0:
            raise TritonModelException("Correlation ID must be an unsigned integer or string")
        if not isinstance(model_name, str):
            raise TypeError("model_name must be a str")

        input_list = list(inputs)
        by_name: dict[str, Tensor] = {}
        for t in input_list:
            if not isinstance(t, Tensor):
                raise TypeError(f"inputs must be Tensor objects, got {type(t).__name__}")
            by_name.setdefault(t.name(), t)
        names: list[str] = []
        for n in map(_text, requested_output_names):
            if not isinstance(n, str):
                raise TypeError("requested_output_names must be strings")
            if n not in names:
                names.append(n)

        self._request_id = request_id
        self._correlation_id = correlation_id
        self._inputs = input_list
        self._inputs_by_name = by_name
        self._requested_output_names = names
        self._model_name = model_name
        self._model_version = int(model_version)
        self._flags = int(flags)
        self._timeout = int(timeout)
        self._preferred_memory = preferred_memory
        self._trace = trace if trace is not None else InferenceTrace()
        self._parameters = _parameters_to_json(parameters)
        self._cancelled = False

    @classmethod
    def _incoming(cls, model_name: str, inputs: list[Tensor], requested_output_names: list[str],
                  request_id: str, correlation_id: int | str, flags: int,
                  parameters: Optional[Mapping[str, Any]]) -> "InferenceRequest":
        """Worker hook: a request the server already validated (its inputs' names are distinct),
        built without ``__init__``'s argument checks: the same fields, the same values (those that
        are alike for every such request are the class's)."""
        self = cls.__new__(cls)
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._inputs = inputs
        self._inputs_by_name = {t._name: t for t in inputs}
        self._requested_output_names = list(dict.fromkeys(requested_output_names))
        self._model_name = model_name
        self._flags = int(flags)
        self._parameters = _parameters_to_json(parameters) if parameters else "{}"
        return self

    def inputs(self) -> list[Tensor]:
        return list(self._inputs)

    def requested_output_names(self) -> set[str]:
        """A set, as in Triton (order carries no meaning)."""
        return set(self._requested_output_names)

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def set_flags(self, flags: int) -> None:
        self._flags = int(flags)

    def timeout(self) -> int:
        """Timeout in microseconds; 0 means none."""
        return self._timeout

    def parameters(self) -> str:
        """Request parameters as a JSON object string (use json.loads)."""
        return self._parameters

    def trace(self) -> InferenceTrace:
        if self._trace is None:
            self._trace = InferenceTrace()  # each request its own, as in Triton
        return self._trace

    def is_cancelled(self) -> bool:
        return self._cancelled

    def _set_cancelled(self, cancelled: bool = True) -> None:
        """Worker hook: mark the request cancelled by the client."""
        self._cancelled = bool(cancelled)

    def set_release_flags(self, flags: int) -> None:
        """RELEASE_ALL is the default and accepted; rescheduling is not."""
        if int(flags) & TRITONSERVER_REQUEST_RELEASE_RESCHEDULE:
            raise _not_supported("Request rescheduling (TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)")

    def exec(self, decoupled: bool = False) -> Any:
        """Run this request on another model (BLS) and wait for its response; with
        ``decoupled=True``, an iterator over the (zero or more) responses of a decoupled model."""
        if _bls is None:
            raise TritonModelException("BLS is only available inside a model's execute()")
        return _bls.stream(self) if decoupled else _bls.execute(self)

    def async_exec(self, decoupled: bool = False) -> Any:
        """The awaitable form of ``exec`` (for ``async def execute``); with ``decoupled=True`` it
        resolves to the list of the decoupled model's responses."""
        if _bls is None:
            raise TritonModelException("BLS is only available inside a model's execute()")
        return _bls.stream_async(self) if decoupled else _bls.execute_async(self)

    def get_response_sender(self) -> Any:
        """The sender of a decoupled model's responses (``send(response, flags)``)."""
        sender = getattr(self, "_response_sender", None)
        if sender is None:
            raise TritonModelException("get_response_sender() is only available to decoupled models "
                                       "(model_transaction_policy { decoupled: true })")
        return sender

    def __repr__(self) -> str:
        return (f"InferenceRequest(model_name={self._model_name!r}, "
                f"request_id={self._request_id!r}, inputs={[t.name() for t in self._inputs]})")


class InferenceResponse:
    """Response for one request: output tensors, or an error."""

    def __init__(
        self,
        output_tensors: Optional[Sequence[Tensor]] = None,
        error: Optional[TritonError] = None,
        parameters: Optional[Mapping[str, Any]] = None,
    ) -> None:
        tensors = [] if output_tensors is None else list(output_tensors)
        for t in tensors:
            if not isinstance(t, Tensor):
                raise TypeError(f"output_tensors must be Tensor objects, got {type(t).__name__}")
        if error is not None and not isinstance(error, TritonError):
            raise TypeError(f"error must be a TritonError, got {type(error).__name__}")
        self._output_tensors = tensors
        self._error = error
        self._parameters = _parameters_to_json(parameters)

    def output_tensors(self) -> list[Tensor]:
        return self._output_tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> Optional[TritonError]:
        return self._error

    def parameters(self) -> str:
        """Response parameters as a JSON object string."""
        return self._parameters

    def __repr__(self) -> str:
        if self._error is not None:
            return f"InferenceResponse(error={self._error!r})"
        return f"InferenceResponse(outputs={[t.name() for t in self._output_tensors]})"


# ---------------------------------------------------------------------------
# Lookup helpers
# ---------------------------------------------------------------------------


def get_input_tensor_by_name(inference_request: Any, name: str) -> Optional[Tensor]:
    """Input Tensor called ``name``, or None when the request lacks it."""
    by_name = getattr(inference_request, "_inputs_by_name", None)
    if by_name is not None:
        return by_name.get(name)
    for t in inference_request.inputs():
        if t.name() == name:
            return t
    return None


def get_output_tensor_by_name(inference_response: Any, name: str) -> Optional[Tensor]:
    """Output Tensor called ``name``, or None."""
    for t in inference_response.output_tensors():
        if t.name() == name:
            return t
    return None


def get_input_config_by_name(model_config: Mapping[str, Any], name: str) -> Optional[dict]:
    """The ``input`` entry of a model config dict with this name, or None."""
    for entry in model_config.get("input", ()) or ():
        if entry.get("name") == name:
            return entry
    return None


def get_output_config_by_name(model_config: Mapping[str, Any], name: str) -> Optional[dict]:
    """The ``output`` entry of a model config dict with this name, or None."""
    for entry in model_config.get("output", ()) or ():
        if entry.get("name") == name:
            return entry
    return None


def using_decoupled_model_transaction_policy(model_config: Mapping[str, Any]) -> bool:
    """True when the config sets model_transaction_policy.decoupled."""
    policy = model_config.get("model_transaction_policy") or {}
    return bool(policy.get("decoupled", False))


# ---------------------------------------------------------------------------
# Logger
# ---------------------------------------------------------------------------

_MODEL_LOGGER = logging.getLogger("shmserve.model")


class _LogLevel(enum.IntEnum):
    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3


_PY_LEVELS = {
    _LogLevel.INFO: logging.INFO,
    _LogLevel.WARNING: logging.WARNING,
    _LogLevel.ERROR: logging.ERROR,
    _LogLevel.VERBOSE: logging.DEBUG,
}


def _emit(message: str, level: _LogLevel) -> None:
    # stacklevel=3: _emit <- Logger.<method> <- model code, so the record's
    # file/line are the model's, like Triton's log lines.
    _MODEL_LOGGER.log(_PY_LEVELS[level], "%s", message, stacklevel=3)


class Logger:
    """Model logging (``pb_utils.Logger.log_info(...)``), routed to the
    Python logger "shmserve.model", so its lines share the server's log, format
    and level switches (shm/logs.py); VERBOSE maps to DEBUG, verbose level 1."""

    LogLevel = _LogLevel
    INFO = _LogLevel.INFO
    WARNING = _LogLevel.WARNING
    ERROR = _LogLevel.ERROR
    VERBOSE = _LogLevel.VERBOSE

    @staticmethod
    def log(message: str, level: _LogLevel = _LogLevel.INFO) -> None:
        try:
            lvl = _LogLevel(level)
        except (ValueError, TypeError):
            raise TypeError(f"invalid log level: {level!r}") from None
        _emit(str(message), lvl)

    @staticmethod
    def log_info(message: str) -> None:
        _emit(str(message), _LogLevel.INFO)

    @staticmethod
    def log_warn(message: str) -> None:
        _emit(str(message), _LogLevel.WARNING)

    @staticmethod
    def log_error(message: str) -> None:
        _emit(str(message), _LogLevel.ERROR)

    @staticmethod
    def log_verbose(message: str) -> None:
        _emit(str(message), _LogLevel.VERBOSE)


# ---------------------------------------------------------------------------
# ModelConfig (auto_complete_config)
# ---------------------------------------------------------------------------


def _dims_key(dims: Any) -> tuple[int, ...]:
    """Dims as ints, so [4] and ["4"] (protobuf JSON int64) compare equal."""
    return tuple(int(d) for d in (dims or ()))


class ModelConfig:
    """Model configuration handed to ``TritonPythonModel.auto_complete_config``.

    Built by the worker from the config dict (protobuf JSON field names); a
    JSON string is accepted too, as Triton passes one.  The setters follow
    Triton's merge rules: the model may fill in what the config file left
    unspecified, and a conflicting value raises ValueError.
    """

    def __init__(self, model_config: Mapping[str, Any] | str) -> None:
        if isinstance(model_config, (str, bytes)):
            cfg = json.loads(model_config)
        elif isinstance(model_config, Mapping):
            cfg = copy.deepcopy(dict(model_config))
        else:
            raise TypeError("model_config must be a dict or a JSON string")
        # Triton's JSON always carries these (protobuf defaults); the setters
        # rely on them.
        cfg.setdefault("name", "")
        cfg.setdefault("max_batch_size", 0)
        cfg.setdefault("input", [])
        cfg.setdefault("output", [])
        self._model_config: dict[str, Any] = cfg

    @property
    def _name(self) -> str:
        return str(self._model_config.get("name", ""))

    def as_dict(self) -> dict[str, Any]:
        """The configuration dict (the live object, as in Triton)."""
        return self._model_config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        """Set max_batch_size; refuses to go below a non-zero value the
        config file already specified."""
        if not isinstance(max_batch_size, numbers.Integral) or isinstance(max_batch_size, bool):
            raise TypeError("max_batch_size must be an int")
        current = int(self._model_config.get("max_batch_size", 0) or 0)
        if current > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {current}, but "
                f"auto-complete-config function for model '{self._name}' "
                f"specified max_batch_size {int(max_batch_size)}"
            )
        self._model_config["max_batch_size"] = int(max_batch_size)

    def set_dynamic_batching(self) -> None:
        """Use the dynamic batcher unless another scheduler is configured."""
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._model_config:
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{other}', but "
                    f"auto-complete-config function for model '{self._name}' tries "
                    "to set scheduling_choice as 'dynamic_batching'"
                )
        self._model_config.setdefault("dynamic_batching", {})

    def _add_tensor(self, kind: str, tensor: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
        if not isinstance(tensor, Mapping):
            raise TypeError(f"{kind} must be a dict")
        label = f"{kind} '{tensor['name']}'" if "name" in tensor else kind
        extra = [k for k in tensor if k not in allowed]
        if extra:
            raise ValueError(
                f"{label} in auto-complete-config function for model '{self._name}' "
                f"contains property other than {', '.join(repr(a) for a in allowed)}: "
                f"{extra}"
            )
        for prop in ("name", "data_type", "dims"):
            if prop not in tensor:
                raise ValueError(
                    f"{label} in auto-complete-config function for model "
                    f"'{self._name}' is missing '{prop}' property."
                )

        entries = self._model_config.setdefault(kind, [])
        for current in entries:
            if current.get("name") != tensor["name"]:
                continue
            cur_type = current.get("data_type", "TYPE_INVALID")
            if cur_type != "TYPE_INVALID" and cur_type != tensor["data_type"]:
                raise ValueError(
                    f"unable to load model '{self._name}', configuration expects "
                    f"datatype {cur_type} for {kind} '{tensor['name']}', model "
                    f"provides {tensor['data_type']}"
                )
            if current.get("dims") and _dims_key(current["dims"]) != _dims_key(tensor["dims"]):
                raise ValueError(
                    f"model '{self._name}', tensor '{tensor['name']}': the model "
                    f"expects dims {list(tensor['dims'])} but the model configuration "
                    f"specifies dims {list(current['dims'])}"
                )
            if ("optional" in current and "optional" in tensor
                    and bool(current["optional"]) != bool(tensor["optional"])):
                raise ValueError(
                    f"model '{self._name}', tensor '{tensor['name']}': the model "
                    f"expects optional {tensor['optional']} but the model "
                    f"configuration specifies optional {current['optional']}"
                )
            current["data_type"] = tensor["data_type"]
            current["dims"] = list(tensor["dims"])
            if "optional" in tensor:
                current["optional"] = tensor["optional"]
            return
        new_entry = dict(tensor)
        new_entry["dims"] = list(tensor["dims"])
        entries.append(new_entry)

    def add_input(self, input: Mapping[str, Any]) -> None:  # noqa: A002 - Triton's name
        """Add (or complete) an input: keys name, data_type ("TYPE_FP32"),
        dims (list) and optionally optional.  An input of the same name that
        the config already has is merged; differing data_type, non-empty
        differing dims, or differing optional raise ValueError."""
        self._add_tensor("input", input, ("name", "data_type", "dims", "optional"))

    def add_output(self, output: Mapping[str, Any]) -> None:
        """Add (or complete) an output: keys name, data_type, dims; same merge
        rules as add_input."""
        self._add_tensor("output", output, ("name", "data_type", "dims"))

    def set_model_transaction_policy(self, transaction_policy_dict: Mapping[str, Any]) -> None:
        """Set model_transaction_policy (only 'decoupled'); cannot flip a
        value the config already set."""
        extra = [k for k in transaction_policy_dict if k != "decoupled"]
        if extra:
            raise ValueError(
                "model transaction property in auto-complete-config function for "
                f"model '{self._name}' contains property other than 'decoupled'."
            )
        policy = self._model_config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            new = transaction_policy_dict["decoupled"]
            if "decoupled" in policy and policy["decoupled"] != new:
                raise ValueError(
                    "trying to change decoupled property in auto-complete-config "
                    f"for model '{self._name}', which is already set to "
                    f"'{policy['decoupled']}'."
                )
            policy["decoupled"] = new

    def __repr__(self) -> str:
        return f"ModelConfig({self._model_config!r})"


# ---------------------------------------------------------------------------
# Model directory, model loading API, custom metrics
# ---------------------------------------------------------------------------

_model_dir: Optional[str] = None
_bls: Any = None  # set by the worker: runs InferenceRequest.exec()


def _set_bls(executor: Any) -> None:
    """Worker hook: the object that carries BLS requests to other models."""
    global _bls
    _bls = executor


def _set_model_dir(path: str) -> None:
    """Worker hook: record the model's directory for get_model_dir()."""
    global _model_dir
    _model_dir = str(path)


def get_model_dir() -> str:
    """Directory holding the model (set by the worker before loading)."""
    if _model_dir is None:
        raise TritonModelException("model directory is not known yet")
    return _model_dir


def _control(doc: dict) -> Any:
    if _bls is None:
        raise TritonModelException("the model loading API is only available inside a running model")
    return _bls.control(doc)


def load_model(model_name: str, config: str = "", files: Optional[dict] = None) -> None:
    """Load (or reload) a model, as the repository API does: ``config`` a JSON model config
    overriding the repository's, ``files`` {"file:<path>": bytes} a model's own files. The server
    must run with --model-control-mode=explicit; raises TritonModelException if the load fails."""
    params: dict[str, Any] = {}
    if config:
        params["config"] = config
    for key, content in (files or {}).items():
        if not isinstance(content, (bytes, bytearray)):
            raise TritonModelException(f"load_model: the content of '{key}' must be bytes")
        params[key] = base64.b64encode(bytes(content)).decode("ascii")
    _control({"op": "load", "model": model_name, "parameters": params})


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    """Unload a model (explicit model control mode); raises TritonModelException on refusal."""
    _control({"op": "unload", "model": model_name, "parameters": {"unload_dependents": unload_dependents}})


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    return bool(_control({"op": "model_ready", "model": model_name, "version": str(model_version or "")})["ready"])


class MetricKind(enum.IntEnum):
    """Kinds of custom metric families; also ``pb_utils.COUNTER`` etc. and ``MetricFamily.COUNTER``."""

    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2


COUNTER, GAUGE, HISTOGRAM = MetricKind.COUNTER, MetricKind.GAUGE, MetricKind.HISTOGRAM


def _metrics() -> Any:
    from shmserve.workers import custom_metrics

    return custom_metrics


class MetricFamily:
    """A family of the model's own Prometheus metrics, served with the server's on the metrics
    port. Families of the same name (in any instance) are one family; so are metrics with the
    same labels."""

    COUNTER = MetricKind.COUNTER
    GAUGE = MetricKind.GAUGE
    HISTOGRAM = MetricKind.HISTOGRAM

    def __init__(self, name: str, description: str, kind: int) -> None:
        m = _metrics()
        try:
            self._family = m.REGISTRY.family(name, description, kind)
        except m.MetricError as e:
            raise TritonModelException(str(e)) from None

    def Metric(self, labels: Optional[Mapping[str, str]] = None, buckets: Optional[Sequence[float]] = None) -> "Metric":  # noqa: N802 - Triton's name
        return Metric(self, labels, buckets)


class Metric:
    """One labelled metric of a family: ``increment`` (counter, gauge), ``set`` (gauge),
    ``observe`` (histogram), ``value`` (counter, gauge)."""

    def __init__(self, family: MetricFamily, labels: Optional[Mapping[str, str]] = None,
                 buckets: Optional[Sequence[float]] = None) -> None:
        m = _metrics()
        try:
            self._cell = m.REGISTRY.cell(family._family, dict(labels) if labels is not None else None,
                                         list(buckets) if buckets is not None else None)
        except m.MetricError as e:
            raise TritonModelException(str(e)) from None
        self._kind = family._family.kind
        self._m = m  # per update: no import lookup

    def _update(self, op: str, value: float, kinds: tuple[int, ...]) -> None:
        m = self._m
        if self._kind not in kinds:
            raise TritonModelException(f"{op}() is not supported by a {m.KINDS[self._kind]} metric")
        if op == "increment" and self._kind == MetricFamily.COUNTER and isinstance(value, (int, float)) \
                and value < 0:
            raise TritonModelException("a counter can only be incremented by a non-negative value")
        try:
            m.REGISTRY.update(self._cell, op, value)
        except m.MetricError as e:
            raise TritonModelException(str(e)) from None

    def increment(self, value: float) -> None:
        self._update("increment", value, (MetricFamily.COUNTER, MetricFamily.GAUGE))

    def set(self, value: float) -> None:
        self._update("set", value, (MetricFamily.GAUGE,))

    def observe(self, value: float) -> None:
        self._update("observe", value, (MetricFamily.HISTOGRAM,))

    def value(self) -> float:
        if self._kind == MetricFamily.HISTOGRAM:
            raise TritonModelException("value() is not supported by a histogram metric")
        return self._cell.value
