"""The broker's HTTP-equivalent statuses as gRPC status codes, as Triton maps its errors: the
same condition gets the same message on both protocols, and the code its protocol uses."""
from __future__ import annotations

from typing import Any

import grpc

from shmserve.shm.answer import ErrorCode
from shmserve.shm.completion import Completion

CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ALREADY_EXISTS,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

# A model's own error code as Triton's gRPC frontend answers it: each keeps its own.
MODEL_CODES = {
    ErrorCode.UNKNOWN: grpc.StatusCode.UNKNOWN,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.INVALID_ARG: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.UNSUPPORTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.CANCELLED: grpc.StatusCode.CANCELLED,
}


class Aborted(Exception):
    """A call or a stream's request answered with an error status: (gRPC code, message). Raised
    by a handler, it ends the call with that status (handlers.py), with no exception left in the
    call's state to keep the request's memory."""

    def __init__(self, code: grpc.StatusCode, message: str, head: Any = None) -> None:
        super().__init__(message)
        self.code = code
        # On a stream: the ModelInferResponse sent beside the error_message (responses.error_head),
        # which tells the client whose request failed. A call's status has no such part.
        self.head = head


def code_of(status: int) -> grpc.StatusCode:
    return CODES.get(status, grpc.StatusCode.INTERNAL if status >= 500 else grpc.StatusCode.INVALID_ARGUMENT)


def answer_code(completion: Completion) -> grpc.StatusCode:
    """The status of an error answer: the model's own code, or the one the server's status maps to."""
    code = completion.answer.code
    return code_of(completion.status) if code is None else MODEL_CODES[code]
