"""Triton's ``--http-restricted-api``: groups of endpoints that answer only requests carrying a
given header and value (e.g. the model repository API behind an operator's key).

``--http-restricted-api=model-repository,shared-memory:admin-key=s3cret`` restricts two groups
to requests with ``admin-key: s3cret``. Others get 403 with Triton's message. The check wraps the
whole ASGI app, so it is not installed at all (and costs nothing) when no group is restricted.
"""
from __future__ import annotations

import re
from typing import Any, Awaitable, Callable

import orjson

from .openai_errors import error_body, is_openai_path

_MODEL = r"/v2/models/[^/]+(?:/versions/[^/]+)?"
_RULES = [
    (re.compile(r"^/v2/health/"), "health"),
    (re.compile(r"^/v2/repository/"), "model-repository"),
    (re.compile(r"^/v2/(?:system|cuda)sharedmemory(?:/|$)"), "shared-memory"),
    (re.compile(r"^/v2/logging/?$"), "logging"),
    (re.compile(rf"^(?:/v2|{_MODEL})/trace/setting/?$"), "trace"),
    (re.compile(rf"^(?:/v2/models|{_MODEL})/stats/?$"), "statistics"),
    (re.compile(rf"^{_MODEL}/config/?$"), "model-config"),
    (re.compile(rf"^{_MODEL}/ready/?$"), "health"),
    (re.compile(rf"^{_MODEL}/(?:infer|generate|generate_stream)/?$"), "inference"),
    (re.compile(rf"^(?:/v2|/v2/openapi\.json|{_MODEL})/?$"), "metadata"),
    (re.compile(r"^/v1/(?:completions|chat/completions|embeddings)/?$"), "inference"),  # openai.py
    (re.compile(r"^/v1/models(?:/[^/]+)?/?$"), "metadata"),
]


def category_of(path: str) -> str | None:
    for pattern, category in _RULES:
        if pattern.match(path):
            return category
    return None


ASGIApp = Callable[[dict, Any, Any], Awaitable[None]]
PASSED = "shmserve.restricted_group"  # scope key: the restricted group whose key the request carried


def passed_group(scope: dict) -> str | None:
    """The restricted group whose key this request carried (None: no key was needed, or none is
    restricted): how a shared-memory handler knows it serves an admin, and a load with 'file:'
    contents that the model-repository key allows it (unless --allow-model-file-uploads)."""
    return scope.get(PASSED)


def restrict(app: ASGIApp, restrictions: dict[str, Any]) -> ASGIApp:
    """``app`` behind the header checks (``app`` itself when nothing is restricted)."""
    if not restrictions:
        return app
    rules = {category: (key.encode("latin-1"), value.encode("latin-1"))
             for category, (key, value) in restrictions.items()}

    async def guarded(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            category = category_of(scope["path"]) or ""
            rule = rules.get(category)
            if rule is not None:
                key, expected = rule
                if dict(scope["headers"]).get(key) != expected:
                    message = f"This API is restricted, expecting header '{key.decode()}'"
                    body = error_body(403, message) if is_openai_path(scope["path"]) else \
                        orjson.dumps({"error": message})
                    await send({"type": "http.response.start", "status": 403,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode())]})
                    await send({"type": "http.response.body", "body": body})
                    return
                scope[PASSED] = category
        await app(scope, receive, send)

    return guarded
