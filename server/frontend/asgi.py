"""The frontend's ASGI application as uvicorn runs it: POST .../infer straight to ``Inference``,
every other request to the Starlette routes of app.py.

An infer request skips Starlette's routing, middleware and request objects: its body is read
from ``receive`` under the size limit (a large binary body is copied into its shared-memory block
as it arrives, ingest.py), ``Inference.start`` submits it, and the answer goes out as one
``http.response.start`` and one ``http.response.body``, written in one send (``ONE_WRITE``).
While tracing is on, the sampled requests carry their HTTP timestamps too. A client that
disconnects while its request is in flight cancels it (``BrokerLink.cancel``): a queued request
never runs, a running model sees ``is_cancelled()``, and the answer that still comes is freed
unsent.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import orjson
from starlette.applications import Starlette

from shmserve.server.edge.requests import BadRequest
from shmserve.server.edge.tracing import RECEIVED, RECV_END, RECV_START, REQUEST_START, SEND_END, SEND_START, Trace, Tracer

from .inference import JSON_HEADER, RETRY_AFTER_HEADER, Headers, Inference, too_large
from .ingest import BodyIngest, header_length
from .raw_binary import is_raw
from .version_path import is_version, path_version_error, version_error
from .openai_errors import error_body, is_openai_path
from .protocol import BODY_SINK, ONE_WRITE, BodySink


def infer_target(path: str) -> tuple[str, str] | None:
    """(model, version) when ``path`` is an infer endpoint. An empty model name
    (``/v2/models//infer``) is none: Triton's route wants one character at least (``[^/]+``) and
    answers its plain 404 "Not Found", as Starlette does here, not an unknown model ''."""
    parts = path.split("/")
    n = len(parts)
    if n < 5 or not parts[3]:
        return None
    if n == 5 and parts[1] == "v2" and parts[2] == "models" and parts[4] == "infer":
        return parts[3], ""
    if n == 7 and parts[1] == "v2" and parts[2] == "models" and parts[4] == "versions" and parts[6] == "infer" \
            and is_version(parts[5]):
        return parts[3], parts[5]
    return None


# How long an answer may take before the connection is watched for the client leaving.
WATCH_AFTER_S = 0.01


class FrontendApp:
    """Plain ASGI in front of Starlette (see the module's docstring)."""

    def __init__(self, inference: Inference, tracer: Tracer, app: Starlette) -> None:
        self.inference = inference
        self.tracer = tracer
        self.app = app
        self.state = app.state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            target = infer_target(scope["path"])
            if target is not None:
                bad_version = version_error(target[1]) if target[1] else None
                if bad_version:  # (its body is not read)
                    await send_error(send, BadRequest(bad_version), close=True)
                    return
                await self.infer(target[0], target[1], scope, receive, send)
                return
        if scope["type"] == "http" and "/versions/" in scope["path"]:
            bad_version = path_version_error(scope["path"])
            if bad_version:
                await send_error(send, BadRequest(bad_version), close=scope["method"] not in ("GET", "HEAD"))
                return
        if scope["type"] == "http" and scope["method"] not in ("GET", "HEAD"):
            # Every other body (control requests, generate) is read here under the same limit,
            # then replayed to Starlette; later receives (disconnects) go to the server's own.
            recv_start = time.monotonic_ns() if self.tracer.on else 0
            body = await read_or_refuse(scope, receive, send, self.inference.max_input_bytes)
            if body is None:
                return
            if recv_start:  # a traced generate request's HTTP_RECV_START and _END (app.py)
                scope[RECEIVED] = (recv_start, time.monotonic_ns())
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    async def infer(self, model: str, version: str, scope: dict, receive: Any, send: Any) -> None:
        trace = self.tracer.sample(model) if self.tracer.on else None
        recv_start = time.monotonic_ns()
        headers = dict(scope["headers"])
        inference = self.inference
        forwarded = inference.header_params(scope)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def reply(status: int, out: bytes | memoryview, out_headers: Headers) -> None:
            if not fut.done():
                fut.set_result((status, out, out_headers))

        try:
            body = await read_infer_body(inference, model, version, headers, receive, None if trace else loop,
                                         forwarded, scope.get(BODY_SINK))
        except BadRequest as e:  # too large: the rest of the body is not read (protocol.py)
            await send_error(send, e, close=True)
            return
        if body is None:
            return  # the client went away
        recv_end = time.monotonic_ns()
        if isinstance(body, BodyIngest):
            sent = inference.finish_ingest(model, version, headers, body, reply)
        else:
            sent = await inference.start_when_room(model, version, headers, body, reply, trace, forwarded)
        if sent is not None and not fut.done() and not await answered_or_gone(fut, receive, loop):
            inference.link.cancel(sent)  # the client went away; the answer is freed when it comes
            return
        status, out, out_headers = await fut
        out_headers.append((b"content-length", b"%d" % len(out)))
        if status == 503:
            out_headers.append(RETRY_AFTER_HEADER)
        send_start = time.monotonic_ns()
        one_write = scope.get(ONE_WRITE)
        if one_write is not None:
            one_write()  # the head waits for the body: the client gets both in one send
        await send({"type": "http.response.start", "status": status, "headers": out_headers})
        await send({"type": "http.response.body", "body": out})
        if trace is not None:
            self._finish_trace(trace, recv_start, recv_end, send_start)

    def _finish_trace(self, trace: Trace, recv_start: int, recv_end: int, send_start: int) -> None:
        ns = trace.ns
        ns[RECV_START], ns[RECV_END], ns[SEND_START] = recv_start, recv_end, send_start
        ns[SEND_END] = time.monotonic_ns()
        if not ns[REQUEST_START]:  # refused before it became a request
            ns[REQUEST_START] = recv_end
        self.tracer.finish(trace)


async def answered_or_gone(fut: asyncio.Future, receive: Any, loop: asyncio.AbstractEventLoop) -> bool:
    """Wait for the answer; False if the client disconnected first. The connection is watched
    only once the answer is late (``WATCH_AFTER_S``): a quick answer costs a timer, not a task
    (the watch cost 34 µs of server CPU per add_sub request at 4 clients). A client that leaves
    sooner has its answer freed unsent. (With the whole body read, uvicorn's ``receive`` returns
    only at a disconnect, or once the response is sent.)"""
    late = loop.create_future()
    timer = loop.call_later(WATCH_AFTER_S, _resolve, late)
    fut.add_done_callback(lambda _: _resolve(late))
    await late
    timer.cancel()
    if fut.done():
        return True
    gone = asyncio.ensure_future(receive())
    try:
        await asyncio.wait((fut, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not gone.done():
            gone.cancel()
    return fut.done() or gone.result().get("type") != "http.disconnect"


def _resolve(f: asyncio.Future) -> None:
    if not f.done():
        f.set_result(None)


async def read_infer_body(inference: Inference, model: str, version: str, headers: dict[bytes, bytes],
                          receive: Any, loop: asyncio.AbstractEventLoop | None,
                          forwarded: dict[str, str] | None = None,
                          take_body: Callable[[BodySink | None], None] | None = None
                          ) -> bytes | BodyIngest | None:
    """An infer request's body (BadRequest past the size limit; None if the client went away).
    With a ``loop``, a large binary body is taken into its request block as it arrives: a
    ``BodyIngest`` holding it whole then (with the parameters ``forwarded`` from its headers);
    ``take_body`` (the protocol's ``BODY_SINK``) has the connection read the rest into its block."""
    limit = inference.max_input_bytes
    raw = is_raw(headers.get(b"inference-header-content-length"))
    declared = headers.get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared), limit, raw)
    head_len = header_length(headers) if loop is not None else -1
    chunks: list[bytes] = []
    size = 0
    ingest: BodyIngest | None = None
    more = True
    try:
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                if ingest is not None:
                    ingest.discard()
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large(size, limit, raw)
            more = message.get("more_body", False)
            if ingest is not None:
                ingest.feed(chunk)
                continue
            chunks.append(chunk)
            if 0 < head_len <= size and more:
                joined = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks = [joined]
                tail_len = int(headers[b"content-length"]) - head_len  # type: ignore[arg-type]
                ingest = inference.begin_ingest(model, version, joined[:head_len], tail_len, loop, forwarded)
                head_len = -1
                if ingest is not None:
                    ingest.feed(memoryview(joined)[len(ingest.head):])
                    if take_body is not None:  # (no await since ``receive``: the parser is in this body)
                        take_body(ingest)
    except BaseException:
        if ingest is not None:
            if take_body is not None:
                take_body(None)  # (cancelled mid-body: the connection reads the rest and drops it)
            ingest.discard()
        raise
    if ingest is not None:
        spilled = ingest.finish()
        return ingest if spilled is None else spilled
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def read_body(scope: dict, receive: Any, limit: int) -> bytes | None:
    """The whole request body, refused (BadRequest) as soon as its declared or received length
    passes ``limit``, so a huge body is never held in memory; None when the client went away."""
    declared = dict(scope["headers"]).get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared), limit)
    chunks = []
    size = 0
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(size, limit)
        chunks.append(chunk)
        more = message.get("more_body", False)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def read_or_refuse(scope: dict, receive: Any, send: Any, limit: int) -> bytes | None:
    """``read_body``, answering a too-large body itself: None when there is nothing left to do."""
    try:
        return await read_body(scope, receive, limit)
    except BadRequest as e:  # too large: the rest of the body is not read (protocol.py)
        await send_error(send, e, close=True, openai=is_openai_path(scope["path"]))
        return None


CLOSE_HEADER = (b"connection", b"close")


async def send_error(send: Any, e: BadRequest, close: bool = False, openai: bool = False) -> None:
    """The JSON error answer (``openai``: in OpenAI's form); ``close`` for a request whose body was
    left unread: its connection ends (protocol.py drops the rest for a moment, so the client still
    reads this answer)."""
    out = error_body(e.status, str(e)) if openai else orjson.dumps({"error": str(e)})
    headers = [JSON_HEADER, (b"content-length", b"%d" % len(out))]
    if e.status == 503:
        headers.append(RETRY_AFTER_HEADER)
    if close:
        headers.append(CLOSE_HEADER)
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": out})


def _replay(body: bytes, receive: Any) -> Any:
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
