"""``pb_utils.InferenceResponse``: what ``execute`` answers for one request (or a decoupled model
sends), and what a BLS call answers the model that made it."""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from .errors import TritonError
from .parameters import parameters_to_json
from .tensor import Tensor


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
        self._parameters = parameters_to_json(parameters)

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


def get_output_tensor_by_name(inference_response: Any, name: str) -> Optional[Tensor]:
    """Output Tensor called ``name``, or None."""
    for t in inference_response.output_tensors():
        if t.name() == name:
            return t
    return None
