"""Clean-room implementation of Triton's ``triton_python_backend_utils`` API.

The Python backend (``..backend``) installs this package as
``sys.modules["triton_python_backend_utils"]``, so that a ``model.py`` written for NVIDIA
Triton's Python backend runs unchanged with ``import triton_python_backend_utils as pb_utils``.
Only the public API is reproduced (names, signatures, observable behaviour); the implementation
is our own, pure Python on top of numpy (torch is optional and imported lazily, only for DLPack
tensors numpy cannot hold: GPU and bfloat16). Request rescheduling is the one call that raises
``TritonModelException("... is not supported yet")``; see docs/python_backend.md.

Where things are: ``tensor`` (Tensor, with ``dlpack`` for imports and ``datatypes`` for type codes
and the BYTES format), ``request`` (InferenceRequest, BLS options), ``response``
(InferenceResponse), ``errors``, ``flags``, ``model_config`` (config lookups, ModelConfig),
``logger``, ``metrics`` (custom metrics), ``model_control`` (load_model and friends) and
``runtime`` (what the worker sets before the model starts).

Worker hooks, not part of Triton's API: ``runtime.set_model_dir`` and ``runtime.set_executor``,
``Tensor._wrap`` and ``Tensor._from_torch``, ``InferenceRequest._incoming`` and
``InferenceRequest._set_cancelled``.
"""
from __future__ import annotations

# Triton's module imports these at its top, and models reach them through it (``pb_utils.np``).
import json  # noqa: F401
import struct  # noqa: F401

import numpy as np  # noqa: F401

from .datatypes import (
    TRITON_STRING_TO_NUMPY,
    deserialize_bytes_tensor,
    numpy_to_triton_type,
    serialize_byte_tensor,
    triton_string_to_numpy,
    triton_to_numpy_type,
)
from .errors import TritonError, TritonModelException
from .flags import (
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_END,
    TRITONSERVER_REQUEST_FLAG_SEQUENCE_START,
    TRITONSERVER_REQUEST_RELEASE_ALL,
    TRITONSERVER_REQUEST_RELEASE_RESCHEDULE,
    TRITONSERVER_RESPONSE_COMPLETE_FINAL,
)
from .logger import Logger
from .metrics import Metric, MetricFamily
from .model_config import (
    ModelConfig,
    get_input_config_by_name,
    get_output_config_by_name,
    using_decoupled_model_transaction_policy,
)
from .model_control import is_model_ready, load_model, unload_model
from .request import (
    TRITONSERVER_MEMORY_CPU,
    TRITONSERVER_MEMORY_GPU,
    InferenceRequest,
    InferenceTrace,
    MemoryType,
    PreferredMemory,
    get_input_tensor_by_name,
)
from .response import InferenceResponse, get_output_tensor_by_name
from .runtime import get_model_dir
from .tensor import Tensor

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
    "Metric",
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
