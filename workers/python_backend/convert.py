"""Between the worker's numpy arrays and pb_utils objects, both ways: inputs wrapped as
``pb_utils.Tensor``, a model's ``InferenceResponse`` read back as the worker's ``Response``, and
Triton's error codes as the HTTP statuses they answer with (and back, for BLS).

The backend (requests into the model, responses out) and BLS (a model's calls out, their
responses in) both cross this border.
"""
from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np

from shmserve.shm.answer import ErrorCode
from shmserve.shm.tensors import DTYPES

from .. import device_tensors
from ..backend import ModelErrorResponse, Response
from .pb_utils.datatypes import TYPE_BF16, numpy_to_triton_type
from .pb_utils.dlpack import torch_dtype_to_triton
from .pb_utils.errors import TritonError
from .pb_utils.tensor import Tensor

# TritonError codes -> the status of the completion (what statistics and local clients see); the
# frontends answer with the code itself, as Triton's do (server/edge/model_errors.py).
ERROR_STATUS = {
    TritonError.INVALID_ARG: 400,
    TritonError.NOT_FOUND: 404,
    TritonError.ALREADY_EXISTS: 409,
    TritonError.UNAVAILABLE: 503,
    TritonError.UNSUPPORTED: 501,
    TritonError.CANCELLED: 499,
    TritonError.INTERNAL: 500,
    TritonError.UNKNOWN: 500,
}
# status -> TritonError code (500 is INTERNAL), for the server's errors of a model called through BLS
# (a model's own error comes with its code).
ERROR_CODE = {status: code for code, status in ERROR_STATUS.items() if code != TritonError.UNKNOWN}
_KNOWN_CODES = frozenset(ErrorCode)

# numpy dtype -> Triton type code of the inputs that need no conversion (BF16 is torch-backed).
_PLAIN_INPUT_TYPES = {dt: numpy_to_triton_type(dt) for k, dt in DTYPES.items() if k != "BF16"}


def _tensor(name: str, arr: np.ndarray) -> Tensor:
    """A pb_utils.Tensor; BF16 (no numpy type in Triton's API) is torch-backed, as in Triton,
    and reachable through DLPack."""
    if arr.dtype == DTYPES["BF16"] and arr.dtype != np.uint16:
        import torch

        t = torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16)
        return Tensor._from_torch(name, t, TYPE_BF16)
    return Tensor(name, arr)


def input_tensor(name: str, arr: Any, copy: bool = True, own: bool = False) -> Tensor:
    """An input tensor. Host arrays are views over the client's shared memory: with ``copy`` the
    model gets its own writable copy (as in Triton, whose stub holds copies: a model may write
    into its inputs without touching the client's memory), else the view itself, made read-only
    (zero copy; a write raises ValueError). An ``own`` array is already the worker's own (a
    copy read from a client's region, or a private copy-on-write view, workers/input_views.py): it
    is not copied again. BYTES inputs are decoded arrays of their own
    either way. Device tensors over a client's CUDA region are given as they are, as in Triton."""
    if device_tensors.is_tensor(arr):
        return Tensor._from_torch(name, arr, torch_dtype_to_triton(sys.modules["torch"], arr.dtype))
    if arr.dtype != np.object_:
        if not copy:
            arr.flags.writeable = False  # as promised to a READ_ONLY_INPUTS model, copy or not
        elif not own:
            arr = arr.copy()
    code = _PLAIN_INPUT_TYPES.get(arr.dtype)
    if code is not None and arr.flags.c_contiguous:
        return Tensor._wrap(name, arr, code)
    return _tensor(name, arr)


def array_of(t: Any) -> np.ndarray:
    """The bytes of a tensor as numpy on the host, whatever backs it (numpy, or torch for BF16/GPU)."""
    arr = getattr(t, "_array", None)
    if arr is not None:
        return np.asarray(arr)
    return device_tensors.host_array(t._torch)


def _output_value(t: Any) -> Any:
    """An output as the worker takes it: a GPU tensor stays on its device (the worker copies it
    into the client's CUDA region, or to the host), anything else as a numpy array."""
    torch_tensor = getattr(t, "_torch", None)
    if torch_tensor is not None and torch_tensor.is_cuda:
        return torch_tensor.detach()
    return array_of(t)


def to_response(resp: Any) -> Response:
    """A model's InferenceResponse as the worker's Response (its outputs' arrays, not copies)."""
    params = resp.parameters() if hasattr(resp, "parameters") else None
    params = json.loads(params) if isinstance(params, str) and params not in ("", "{}") else None
    if resp.has_error():
        err = resp.error()
        code = err.code() if hasattr(err, "code") else TritonError.INTERNAL
        code = ErrorCode(code) if code in _KNOWN_CODES else ErrorCode.INTERNAL
        return ModelErrorResponse(error=err.message() if hasattr(err, "message") else str(err),
                                  status=ERROR_STATUS[code], parameters=params, code=code)
    outputs: dict[str, np.ndarray] = {}
    for t in resp.output_tensors():
        arr = getattr(t, "_array", None)
        outputs[t.name()] = arr if type(arr) is np.ndarray else _output_value(t)
    return Response(outputs, None, params)  # (by position: half the time of a dataclass by name)
