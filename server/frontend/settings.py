"""Run-time settings endpoints (Triton's logging and trace extensions): GET answers the current
settings, POST changes them and answers the new ones.

The broker owns the settings (it validates and publishes them), so these endpoints only forward.
The frontend that answered a POST applies the new settings at once; the other processes pick
them up from the broker's published copy.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response

from shmserve.shm import logs

from shmserve.server.edge.link import BrokerError, BrokerLink
from shmserve.server.edge.tracing import Tracer

Endpoint = Callable[[Request], Awaitable[Response]]


def settings_endpoint(link: BrokerLink, op: str, applied: Callable[[Any], None], per_model: bool = False) -> Endpoint:
    """Forward GET/POST to the broker's ``op``; ``applied`` follows a change in this process."""

    async def endpoint(request: Request) -> Response:
        doc: dict[str, Any] = {"op": op}
        if per_model:
            doc["model"] = request.path_params.get("model", "")
        if request.method == "POST":
            body = await request.body()
            try:
                doc["update"] = orjson.loads(body) if body else {}
            except orjson.JSONDecodeError as e:
                return _json(400, {"error": f"failed to parse the request JSON buffer: {e}"})
        try:
            status, answer = await link.control(doc)
        except BrokerError as e:
            return _json(e.status, {"error": str(e)})
        if status == 200 and "update" in doc:
            applied(answer)
        return _json(status, answer)

    return endpoint


def logging_endpoint(link: BrokerLink) -> Endpoint:
    """``GET/POST /v2/logging`` (shm/logs.py holds the settings' meaning)."""
    return settings_endpoint(link, "log_settings", logs.configure)


def trace_endpoint(link: BrokerLink, tracer: Tracer) -> Endpoint:
    """GET/POST ``v2[/models/<model>]/trace/setting``: forwarded to the broker, which owns them;
    this frontend follows a change at once, the others within their next tick (0.5 s)."""
    return settings_endpoint(link, "trace_settings", lambda _: tracer.refresh(), per_model=True)


def _json(status: int, doc: object) -> Response:
    return Response(orjson.dumps(doc), status_code=status, media_type="application/json")
