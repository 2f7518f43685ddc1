"""Triton's ``--http-header-forward-pattern`` and ``--grpc-header-forward-pattern``: request
headers (gRPC metadata) whose names match a regular expression reach the model as string
request parameters, named as the header (``request.parameters()`` in the Python backend).

The rules are Triton's (http_server.cc ``ForwardHeaders``, grpc/infer_handler.h
``ForwardHeadersAsParameters``): the pattern is searched for anywhere in the name (RE2's
PartialMatch) and ignores case (Triton puts ``(?i)`` before it); an empty pattern matches every
header. Forwarded headers are added after the body's parameters, so a header wins over a body
parameter of the same name, and of a header sent twice the last value wins (Triton adds each
one, and the Python backend's JSON keeps the last). A forwarded parameter never steers the
server: the sequence, priority and timeout parameters are read from the body alone.
"""
from __future__ import annotations

import re
from typing import Iterable

from shmserve.shm.descriptor import InferRequest

HTTP_FLAG = "--http-header-forward-pattern"
GRPC_FLAG = "--grpc-header-forward-pattern"
# ASGI scope key: the request's header names as the client sent them, in the order of
# scope["headers"] (protocol.py keeps them while a pattern is set; uvicorn lowers them).
RAW_HEADER_NAMES = "shmserve.raw_header_names"


def compile_pattern(pattern: str | None, flag: str) -> re.Pattern[str] | None:
    """The flag's pattern, case-insensitive as Triton's (None: the flag was not given);
    ValueError names a pattern that is not a regular expression, at start rather than never
    matching as Triton's does."""
    if pattern is None:
        return None
    try:
        return re.compile(pattern, re.IGNORECASE)
    except re.error as e:
        raise ValueError(f"{flag} '{pattern}' is not a regular expression: {e}") from None


def forwarded_params(pattern: re.Pattern[str] | None, headers: Iterable[tuple[str, str | bytes]]) -> dict[str, str]:
    """Parameter name -> value for each of ``headers`` (name, value) whose name matches; bytes
    values (HTTP's, gRPC's ``-bin`` metadata) are read as UTF-8, as Triton passes them on."""
    if pattern is None:
        return {}
    out: dict[str, str] = {}
    for name, value in headers:
        if pattern.search(name):
            out[name] = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return out


def http_headers(scope: dict) -> Iterable[tuple[str, bytes]]:
    """An HTTP request's (name as sent, value) pairs (names in lower case where the protocol did
    not keep them)."""
    pairs = scope["headers"]
    names = scope.get(RAW_HEADER_NAMES)
    if names is None or len(names) != len(pairs):
        names = [name for name, _ in pairs]
    return [(name.decode("latin-1"), value) for name, (_, value) in zip(names, pairs)]


def add_to_request(req: InferRequest, params: dict[str, str] | None) -> None:
    """Add forwarded ``params`` to ``req``'s model parameters (over the body's)."""
    if params:
        req.parameters = {**(req.parameters or {}), **params}
