"""The two ways a model reports failure: raise ``TritonModelException``, or answer one request
with ``InferenceResponse(error=TritonError(...))`` and let the rest of the batch succeed."""
from __future__ import annotations

from shmserve.shm.answer import ErrorCode


class TritonModelException(Exception):
    """Raised by the API (and by models) for failures in initialize/execute/
    finalize.  In Triton this is a plain Exception subclass; ``message()`` is
    there because models written for Triton's earlier releases call it."""

    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


# TRITONSERVER_Error_Code values, exposed as ``TritonError.<NAME>``: the codes an answer carries.
_ErrorCode = ErrorCode


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


def not_supported(feature: str) -> TritonModelException:
    """Uniform error for API surface shmserve does not implement, so a
    model fails loudly instead of silently misbehaving."""
    return TritonModelException(f"{feature} is not supported yet by shmserve")
