"""Errors in OpenAI's form, ``{"error": {"message", "type", "param", "code"}}``, which the
``openai`` package parses into its ``APIStatusError`` subclasses (``e.body`` is the inner object).
Every answer under ``/v1/`` uses it, from the routes (openai.py) and from the layers in front of
them: 404/405 of the router (app.py), 403 of ``--http-restricted-api`` (restricted.py), a body
over ``--http-max-input-size`` (asgi.py). A 503 or 429 carries ``Retry-After`` as every 503 of the
server does (inference.py): the ``openai`` package waits that long before it retries."""
from __future__ import annotations

import orjson
from starlette.responses import Response

from .inference import RETRY_AFTER_S

JSON = "application/json"
PREFIX = "/v1/"
MODEL_NOT_FOUND = "model_not_found"  # OpenAI's code for an unknown model
RETRIED = (429, 503)  # statuses a client should retry later: they carry Retry-After


def is_openai_path(path: str) -> bool:
    return path.startswith(PREFIX) or path == PREFIX[:-1]


class OpenAIError(Exception):
    """A refused request: its status, and the request field at fault (``param``) where one is."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> bytes:
    """OpenAI's error object: ``invalid_request_error`` for a 4xx, ``server_error`` for the rest."""
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


def error_response(e: OpenAIError, headers: dict[str, str] | None = None) -> Response:
    if e.status in RETRIED:
        headers = {**(headers or {}), "retry-after": str(RETRY_AFTER_S)}
    return Response(error_body(e.status, str(e), e.param, e.code), status_code=e.status, headers=headers,
                    media_type=JSON)
