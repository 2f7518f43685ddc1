"""The HTTP status of an error answer, as Triton's HTTP frontend chooses it.

A model's own error (an error response, ``pb_utils.TritonError``) comes with its code, and Triton
answers ``infer`` by that code, folding four of them into 400; ``generate`` answers every error of
the model's run with 400. The server's own errors (refusals, overload, a worker that died) carry
their status already.
"""
from __future__ import annotations

from shmserve.shm.answer import ErrorCode
from shmserve.shm.completion import Completion

# Triton 2.51's HTTP status of each code (its HttpCodeFromError).
INFER_STATUS = {
    ErrorCode.UNKNOWN: 400,
    ErrorCode.INTERNAL: 500,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.INVALID_ARG: 400,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.UNSUPPORTED: 501,
    ErrorCode.ALREADY_EXISTS: 400,
    ErrorCode.CANCELLED: 400,
}


def infer_error_status(completion: Completion) -> int:
    """The status of an ``infer`` answer that is an error."""
    code = completion.answer.code
    return completion.status if code is None else INFER_STATUS[code]


def generate_error_status(completion: Completion) -> int:
    """The status of a generate answer that is an error. An error from the model's run (its error
    response, whatever code it carries, an exception in ``execute``, its instance dying) is
    Triton's 400 on both generate endpoints, not what ``infer`` says; a refusal from before the
    model ran, and shmserve's own 503s (no room, overload), keep theirs."""
    answer = completion.answer
    if answer.code is not None:
        return 400
    return completion.status if answer.refused or completion.status == 503 else 400
