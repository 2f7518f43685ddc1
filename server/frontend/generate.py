"""Triton's generate extension: ``/generate`` and ``/generate_stream`` (server-sent events).

The body is a flat JSON object: keys that name model inputs become tensors (a scalar or a string
is one value, a list its values), shaped by the model's config: its dimensions, the one variable
dimension or a batching model's batch dimension taking what the values leave (Triton's rule, and
its error text when they do not fit); ``parameters`` and any other key become request parameters. Each response is a flat JSON
object of the outputs: one-element tensors become scalars (BYTES as text), others lists.

A stream's responses lie in its worker's arena until the frontend frees them: ``EventStream``
frees what is left (and what still comes) when the client disconnects mid-stream, as at the end.
"""
from __future__ import annotations

from typing import Any, AsyncGenerator

import orjson
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from shmserve.shm.streams import StreamEvents
from shmserve.shm.tensors import CONFIG_TO_WIRE

from .codec import BadRequest, json_data, json_tensor_bytes
from .tracing import Trace, Tracer, timed_sends


def build_generate_request(model: str, version: str, body: Any, config: dict) -> tuple[dict, list]:
    if not isinstance(body, dict):
        raise BadRequest("the generate request must be a JSON object")
    specs = {t["name"]: t for t in config.get("input", [])}
    batched = int(config.get("max_batch_size", 0)) > 0
    raw_params = body.get("parameters") or {}
    if not isinstance(raw_params, dict):
        raise BadRequest("the generate request's 'parameters' must be a JSON object")
    params = dict(raw_params)
    inputs, chunks, rel = [], [], 0
    for key, value in body.items():
        if key in ("parameters", "id"):
            continue
        spec = specs.get(key)
        if spec is None:
            if isinstance(value, (bool, int, float, str)):
                params[key] = value
            continue
        datatype = CONFIG_TO_WIRE.get(spec.get("data_type", ""), "")
        if not datatype:
            raise BadRequest(f"input '{key}' has an unsupported data type")
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, (dict, list)) or v is None for v in values):
            raise BadRequest(f"input '{key}': a generate input is a scalar or a flat list of scalars")
        data = json_tensor_bytes(key, datatype, [len(values)], values)  # the infer endpoint's checks
        shape = _tensor_shape(key, len(values), [int(d) for d in spec.get("dims", [])], batched)
        inputs.append({"name": key, "datatype": datatype, "shape": shape, "data": rel, "size": len(data)})
        chunks.append(data)
        rel += len(data)
    # A missing input is left to the model's input check, which words it as Triton does.
    req: dict[str, Any] = {"model": model, "version": version, "inputs": inputs, "outputs": None}
    if "id" in body:
        if not isinstance(body["id"], str):
            raise BadRequest("the generate request 'id' must be a string")
        req["id"] = body["id"]
    if params:
        req["params"] = {k: v for k, v in params.items() if isinstance(v, (bool, int, float, str))}
    return req, chunks


def _tensor_shape(name: str, count: int, dims: list[int], batched: bool) -> list[int]:
    """The shape the model's config gives ``count`` values, as Triton's generate endpoint forms it:
    the config's dimensions, with the one variable dimension (or the batch dimension) taking what
    is left; a batching model's batch dimension is 1 when another dimension varies."""
    shape = ([-1] if batched else []) + dims
    if batched and sum(d < 0 for d in shape) > 1:
        shape[0] = 1
    fixed = 1
    for d in shape:
        fixed *= d if d >= 0 else 1
    free = [i for i, d in enumerate(shape) if d < 0]
    if not free and count == fixed:
        return shape
    if len(free) == 1 and fixed > 0 and count % fixed == 0 and count:
        shape[free[0]] = count // fixed
        return shape
    raise BadRequest(f"The schema can not convert input '{name}' to tensor with proper shape")


def output_values(result: dict, tensor_of: Any) -> dict[str, Any]:
    """A response's outputs by name: one-element tensors as scalars (BYTES as text), others lists."""
    out: dict[str, Any] = {}
    for o in result.get("outputs", ()):
        values = json_data(o["datatype"], tensor_of(o), o["shape"])
        out[o["name"]] = values[0] if len(values) == 1 else values
    return out


def generate_response(model: str, result: dict, tensor_of: Any) -> dict:
    return {"model_name": model, "model_version": str(result.get("version", "")), **output_values(result, tensor_of)}


class EventStream(StreamingResponse):
    """The server-sent events of one ``generate_stream`` request: one event per response, an
    error as ``{"error": ...}``. However the response ends (the last event sent, or the client
    gone mid-stream and the sending cancelled or failed), the stream's events are closed: what
    was not sent is freed, and so is every response the model still sends. A traced request's
    events are timed as they are sent (``timed_sends``), its trace written when the response ends."""

    def __init__(self, model: str, events: StreamEvents, trace: Trace | None, tracer: Tracer) -> None:
        self.model = model
        self.events = events
        self.trace = trace
        lines = self._lines()
        super().__init__(lines if trace is None else timed_sends(lines, trace, tracer), media_type="text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.events.close()
            if self.trace is not None:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]  # writes the trace if not yet

    async def _lines(self) -> AsyncGenerator[bytes, None]:
        while True:
            final, completion, _ = await self.events.events.get()
            try:
                doc = completion.doc()
                if self.trace is not None:
                    self.trace.collect(doc)  # the version served; the final one ends the request
                if completion.status != 200:
                    line = orjson.dumps({"error": doc.get("error", "inference failed")})
                elif not final:
                    line = orjson.dumps(generate_response(self.model, doc, completion.tensor))
                else:
                    return
            finally:
                completion.release()
            yield b"data: " + line + b"\n\n"
            if final:
                return


class TracedAnswer(Response):
    """A generate answer of a traced request: its send timed (HTTP_SEND_START, _END), its trace
    written once it is sent."""

    def __init__(self, answer: Response, trace: Trace, tracer: Tracer) -> None:
        super().__init__(bytes(answer.body), answer.status_code, media_type=answer.media_type)
        self.trace = trace
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.trace.sending()
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.trace.sent()
            self.tracer.finish(self.trace)


def traced(answer: Response, trace: Trace | None, tracer: Tracer) -> Response:
    """``answer``, its send timed when its request is traced."""
    return answer if trace is None else TracedAnswer(answer, trace, tracer)
