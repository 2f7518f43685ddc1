"""Triton's logging extension: ``GET /v2/logging`` and ``POST /v2/logging``.

The broker owns the settings (it validates and publishes them; see shm/logs.py), so this
endpoint only forwards. The frontend that answered a POST applies the new settings at once; the
other processes pick them up from the broker's published copy.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Awaitable, Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response

from shm import logs

from .link import BrokerError

if TYPE_CHECKING:
    from .app import Frontend


def logging_endpoint(fe: "Frontend") -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        doc: dict = {"op": "log_settings"}
        if request.method == "POST":
            body = await request.body()
            try:
                doc["update"] = orjson.loads(body) if body else {}
            except orjson.JSONDecodeError as e:
                return _json(400, {"error": f"failed to parse the request JSON buffer: {e}"})
        try:
            status, answer = await fe.link.control(doc)
        except BrokerError as e:
            return _json(e.status, {"error": str(e)})
        if status == 200 and "update" in doc:
            logs.configure(answer)
        return _json(status, answer)

    return endpoint


def _json(status: int, doc: object) -> Response:
    return Response(orjson.dumps(doc), status_code=status, media_type="application/json")
