"""Request and response parameters, held the way Triton exposes them: a JSON object string."""
from __future__ import annotations

import json
from typing import Any, Mapping, Optional

from .errors import TritonModelException

_PARAM_VALUE_TYPES = (bool, int, float, str)


def parameters_to_json(parameters: Optional[Mapping[str, Any]], compact: bool = False) -> str:
    """Validate request/response parameters and encode them as a JSON object string.  Triton
    allows bool/int/str values; float is also accepted because the KServe protocol has double
    params.  A string is taken as already encoded. What a model builds reads as Triton's stub
    writes it, ``json.dumps(parameters)`` (``{"a": 1}``); a request the server hands to
    ``execute`` reads ``compact``, as Triton's core writes it (``{"a":1}``)."""
    if not parameters:
        return "{}"
    if isinstance(parameters, str):
        return parameters
    if not isinstance(parameters, Mapping):
        raise TypeError(f"parameters must be a dict, got {type(parameters).__name__}")
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(
                f"Expect parameters keys to have type str, found type {type(key)}"
            )
        if not isinstance(value, _PARAM_VALUE_TYPES):
            raise TritonModelException(
                f"Expect parameters values to have type bool/int/str, found type {type(value)}"
            )
    if compact:
        return json.dumps(dict(parameters), separators=(",", ":"))
    return json.dumps(dict(parameters))
