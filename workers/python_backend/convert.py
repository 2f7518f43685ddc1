"""Between the worker's numpy arrays and pb_utils objects, both ways: inputs wrapped as
``pb_utils.Tensor``, a model's ``InferenceResponse`` read back as the worker's ``Response``, and
Triton's error codes as the HTTP statuses they answer with (and back, for BLS).

The backend (requests into the model, responses out) and BLS (a model's calls out, their
responses in) both cross this border.
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from shmserve.shm.tensors import DTYPES

from ..backend import Response
from .pb_utils.datatypes import TYPE_BF16, numpy_to_triton_type
from .pb_utils.errors import TritonError
from .pb_utils.tensor import Tensor

# TritonError codes -> HTTP status, as Triton's HTTP frontend answers them.
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
# HTTP status -> TritonError code (500 is INTERNAL), for the errors of a model called through BLS.
ERROR_CODE = {status: code for code, status in ERROR_STATUS.items() if code != TritonError.UNKNOWN}

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


def input_tensor(name: str, arr: np.ndarray) -> Tensor:
    """An input tensor: wrapped as it is in the common case (the worker's arrays are already
    checked views), else through ``_tensor``."""
    code = _PLAIN_INPUT_TYPES.get(arr.dtype)
    if code is not None and arr.flags.c_contiguous:
        return Tensor._wrap(name, arr, code)
    return _tensor(name, arr)


def array_of(t: Any) -> np.ndarray:
    """The bytes of an output tensor as numpy, whatever backs it (numpy, or torch for BF16/GPU)."""
    arr = getattr(t, "_array", None)
    if arr is not None:
        return np.asarray(arr)
    torch_tensor = t._torch.detach().cpu().contiguous()
    import torch

    if torch_tensor.dtype == torch.bfloat16:
        return torch_tensor.view(torch.int16).numpy().view(DTYPES["BF16"])
    return torch_tensor.numpy()


def to_response(resp: Any) -> Response:
    """A model's InferenceResponse as the worker's Response (its outputs' arrays, not copies)."""
    params = resp.parameters() if hasattr(resp, "parameters") else None
    params = json.loads(params) if isinstance(params, str) and params not in ("", "{}") else None
    if resp.has_error():
        err = resp.error()
        code = err.code() if hasattr(err, "code") else TritonError.INTERNAL
        return Response(error=err.message() if hasattr(err, "message") else str(err),
                        status=ERROR_STATUS.get(code, 500), parameters=params)
    outputs: dict[str, np.ndarray] = {}
    for t in resp.output_tensors():
        arr = getattr(t, "_array", None)
        outputs[t.name()] = arr if type(arr) is np.ndarray else array_of(t)
    return Response(outputs, None, params)  # (by position: half the time of a dataclass by name)
