"""``pb_utils.Tensor``: a named array, the unit of every input and output.

A Tensor holds its array as given, with no copy: the inputs the worker hands to a model are
its own (copies of the client's data, or private copy-on-write views of it from 2 MiB; read-only
views with READ_ONLY_INPUTS: see convert.input_tensor), and
an output's array goes back to the worker as it is. torch backs only what numpy cannot hold
(GPU and bfloat16 tensors imported through DLPack).
"""
from __future__ import annotations

import sys
from typing import Any, Optional

import numpy as np

from . import dlpack
from .datatypes import TYPE_BF16, TYPE_BYTES, numpy_to_triton_type
from .errors import TritonModelException

_NOT_CONTIGUOUS = ("DLPack tensor is not contiguous. Only contiguous DLPack "
                   "tensors that are stored in C-Order are supported.")


def _checked_name(name: Any) -> str:
    """A tensor's name: a str, or bytes (UTF-8), as Triton's binding takes a std::string."""
    if isinstance(name, bytes):
        name = name.decode("utf-8")
    if not isinstance(name, str):
        raise TypeError(f"Tensor name must be a str, got {type(name).__name__}")
    if name == "":
        raise TritonModelException("Tensor name cannot be an empty string.")
    return name


class Tensor:
    """Named tensor for request inputs and response outputs.

    The numpy array is kept exactly as given (no copy).  Like Triton, a non
    C-contiguous array is made contiguous (that one case copies).  BYTES
    tensors are numpy object arrays of ``bytes``.
    """

    _torch: Any = None  # set only for GPU / bfloat16 DLPack imports

    def __init__(self, name: str, numpy_array: Any) -> None:
        name = _checked_name(name)
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
        self._torch: Any = None
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
        """A torch-backed tensor (GPU, or bfloat16, which numpy has no type for)."""
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
        """The tensor's array itself (not a copy): writes to an input's array change only the
        model's own bytes, as in Triton."""
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
        if self._dtype == TYPE_BYTES:
            raise TritonModelException("DLPack does not have support for string tensors.")
        if self._array is None:
            return self._torch.__dlpack__()
        try:
            return self._array.__dlpack__()
        except BufferError:
            if self._array.flags.writeable:
                raise
        # Read-only arrays (e.g. inputs of a model with READ_ONLY_INPUTS) can only be
        # exported with the versioned DLPack protocol, which carries the flag.
        try:
            return self._array.__dlpack__(max_version=(1, 0))
        except (TypeError, BufferError) as exc:
            raise TritonModelException(
                f"cannot export read-only tensor '{self._name}' via DLPack: {exc}"
            ) from exc

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        """DLPack protocol, so ``torch.from_dlpack(pb_tensor)`` works."""
        if self._dtype == TYPE_BYTES:
            raise TritonModelException("DLPack does not have support for string tensors.")
        src = self._array if self._array is not None else self._torch
        return src.__dlpack__(stream=stream, **kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        if self._array is not None:
            return (dlpack.DL_CPU, 0)
        return self._torch.__dlpack_device__()

    @staticmethod
    def from_dlpack(name: str, dlpack_tensor: Any) -> "Tensor":
        """Wrap a DLPack capsule or any object with ``__dlpack__`` (torch
        tensor, numpy array, ...) without copying.  CPU tensors of numpy
        dtypes become numpy-backed; GPU and bfloat16 tensors need torch."""
        name = _checked_name(name)
        producer, numpy_ok = _producer(dlpack_tensor)
        if numpy_ok:
            arr = _numpy_import(producer, dlpack.is_capsule(dlpack_tensor))
            if arr is not None:
                return Tensor(name, arr)
        return _torch_import(name, dlpack_tensor)

    def __repr__(self) -> str:
        return f"Tensor(name={self._name!r}, dtype={self._dtype}, shape={self.shape()})"


def _producer(dlpack_tensor: Any) -> tuple[Any, bool]:
    """What numpy would import from (a capsule wrapped in the protocol), and whether numpy can."""
    if dlpack.is_capsule(dlpack_tensor):
        versioned, dev_type, dev_id, code, bits = dlpack.peek_capsule(dlpack_tensor)
        numpy_ok = dev_type == dlpack.DL_CPU and (code, bits) in dlpack.NUMPY_DL_DTYPES
        # numpy imports legacy (unversioned) capsules read-only, Triton's
        # array is writable; torch keeps it writable and zero-copy, so
        # prefer it when the model has it loaded (it made the capsule).
        if numpy_ok and not versioned and "torch" in sys.modules:
            numpy_ok = False
        return dlpack.CapsuleProducer(dlpack_tensor, (dev_type, dev_id)), numpy_ok
    if hasattr(dlpack_tensor, "__dlpack__"):
        dev_type = int(dlpack_tensor.__dlpack_device__()[0])
        return dlpack_tensor, dev_type == dlpack.DL_CPU
    raise TritonModelException(
        "Provided tensor is not supported. Tensor must be a DLPack "
        "capsule or have a `__dlpack__` attribute"
    )


def _numpy_import(producer: Any, is_capsule: bool) -> Optional[np.ndarray]:
    """The array numpy imports, or None when numpy refused an object torch may still take (a
    refused capsule may be consumed already, so that raises instead)."""
    try:
        arr = np.from_dlpack(producer)
    except (RuntimeError, BufferError, TypeError, ValueError) as exc:
        if is_capsule:
            raise TritonModelException(f"cannot import DLPack tensor: {exc}") from exc
        return None
    if not arr.flags.c_contiguous:
        raise TritonModelException(_NOT_CONTIGUOUS)
    return arr


def _torch_import(name: str, dlpack_tensor: Any) -> Tensor:
    torch = dlpack.import_torch("importing a GPU or bfloat16 DLPack tensor")
    try:
        t = torch.from_dlpack(dlpack_tensor)
    except Exception as exc:  # torch raises several types here
        raise TritonModelException(f"cannot import DLPack tensor: {exc}") from exc
    if not t.is_contiguous():
        raise TritonModelException(_NOT_CONTIGUOUS)
    dtype = dlpack.torch_dtype_to_triton(torch, t.dtype)
    if t.device.type == "cpu" and dtype != TYPE_BF16:
        return Tensor(name, t.numpy())
    return Tensor._from_torch(name, t, dtype)
