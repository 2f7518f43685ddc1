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
from shmserve.shm.control_messages import ControlMessage, LogSettings, TraceSettings

from shmserve.server.edge.link import BrokerError, BrokerLink
from shmserve.server.edge.tracing import Tracer

Endpoint = Callable[[Request], Awaitable[Response]]


def settings_endpoint(link: BrokerLink, message: Callable[[Request, dict[str, Any] | None], ControlMessage],
                      what: str, applied: Callable[[Any], None]) -> Endpoint:
    """Forward GET/POST to the broker as ``message(request, update)`` (update None: GET);
    ``applied`` follows a change in this process."""

    async def endpoint(request: Request) -> Response:
        update = None
        if request.method == "POST":
            body = await request.body()
            try:
                update = orjson.loads(body) if body else {}
            except orjson.JSONDecodeError as e:
                return _json(400, {"error": f"failed to parse the request JSON buffer: {e}"})
            if not isinstance(update, dict):
                return _json(400, {"error": f"the {what} request must be a JSON object"})
        try:
            status, answer = await link.control(message(request, update))
        except BrokerError as e:
            return _json(e.status, {"error": str(e)})
        if status == 200 and update is not None:
            applied(answer)
        return _json(status, answer)

    return endpoint


def logging_endpoint(link: BrokerLink) -> Endpoint:
    """``GET/POST /v2/logging`` (shm/logs.py holds the settings' meaning)."""
    return settings_endpoint(link, lambda request, update: LogSettings(update), "log settings", logs.follow)


def trace_endpoint(link: BrokerLink, tracer: Tracer) -> Endpoint:
    """GET/POST ``v2[/models/<model>]/trace/setting``: forwarded to the broker, which owns them;
    this frontend follows a change at once, the others within their next tick (0.5 s)."""
    return settings_endpoint(link, lambda request, update: TraceSettings(request.path_params.get("model", ""), update),
                             "trace setting", lambda _: tracer.refresh())


def _json(status: int, doc: object) -> Response:
    return Response(orjson.dumps(doc), status_code=status, media_type="application/json")
