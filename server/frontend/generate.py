"""Triton's generate extension: ``/generate`` and ``/generate_stream`` (server-sent events).

The body is a JSON object read as Triton 2.51 reads it (``ConvertGenerateRequest``): its members
in order, duplicates kept. A member that names a model input becomes that tensor (a scalar or a
string is one value, a list its values), shaped by the model's metadata: the fixed dimensions
must divide the count, the innermost variable dimension takes the rest, any other is 1 (Triton's
rule, and its error text when they do not fit). Any other member, and each member of a
``parameters`` object, is a request parameter. Each refusal is Triton's, at the point Triton
makes it. Each response is a flat JSON object: the request's id, the model's name and version,
the response's parameters and its outputs (one-element tensors as scalars, BYTES as text,
others lists).

A stream's responses lie in its worker's arena until the frontend frees them: ``EventStream``
frees what is left (and what still comes) when the client disconnects mid-stream, as at the end.
"""
from __future__ import annotations

import json
from typing import Any, AsyncGenerator

import orjson
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from shmserve.server.edge.requests import (INT64_MAX, INT64_MIN, NOT_OBJECT, NOT_STRING, SHAPE_MISMATCH, BadRequest,
                                           JsonTypeError, json_tensor_bytes, json_value_error, parse_json,
                                           unable_to_parse)
from shmserve.server.edge.tracing import Trace, Tracer, timed_sends
from shmserve.shm.answer import AnswerDescriptor
from shmserve.shm.descriptor import InferRequest, InputTensor
from shmserve.shm.streams import StreamEvents
from shmserve.shm.tensors import CONFIG_TO_WIRE
from shmserve.signature import request_tag

from .codec import FLOAT_TYPES, dumps, json_data


class Pairs(list):
    """A JSON object as its (key, value) pairs in order, duplicate keys kept: Triton reads every
    member, so a key given twice is seen twice (an input given twice is refused)."""


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_generate_body(data: bytes) -> Any:
    """The body with its objects as ``Pairs``: checked by orjson first, so a bad body is refused
    in the same words as on every other endpoint."""
    parse_json(data)
    try:
        return json.loads(data, object_pairs_hook=Pairs, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"failed to parse the request JSON buffer: {e}") from None


class _GenerateRequest:
    """One generate body turned into inputs and parameters as Triton's ``ConvertGenerateRequest``
    does: every member in order (``parameters`` an object whose members are read the same way),
    a member naming a model input a tensor, any other a request parameter, each refusal in
    Triton's words at the point Triton makes it."""

    def __init__(self, model: str, config: dict, request_id: str) -> None:
        self.specs = {t["name"]: t for t in config.get("input", [])}
        self.batched = int(config.get("max_batch_size", 0)) > 0
        self.tag = request_tag(request_id)
        self.inputs: list[InputTensor] = []
        self.chunks: list[bytes | memoryview] = []
        self.params: dict[str, Any] = {}
        self.added: set[str] = set()
        self.offset = 0

    def members(self, pairs: Pairs, nested: bool = False) -> None:
        first: dict[str, Any] = {}  # each key's first value: what Triton reads each time the key comes
        for key, value in pairs:
            first.setdefault(key, value)
        for key, value in pairs:
            if key == "parameters" and not nested:
                if key in self.specs:
                    raise BadRequest("Keyword 'parameters' for nested schema also given as input tensor name")
                if not isinstance(value, Pairs):
                    raise JsonTypeError("Expected JSON object for keyword: 'parameters': attempt to access JSON "
                                        "non-object as object")
                try:
                    self.members(value, nested=True)
                except BadRequest as e:
                    e.args = (f"Converting keyword: 'parameters': {e}",)
                    raise
            elif key in self.specs:
                self.tensor(key, first[key])
            else:
                self.parameter(key, first[key])

    def parameter(self, key: str, value: Any) -> None:
        if value is None or not isinstance(value, (bool, int, float, str)):
            raise BadRequest(f"parameter '{key}' has invalid type. It should be either 'int', 'bool', or 'string'.")
        if isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
            value = float(value)  # a JSON number past int64 is a double to Triton
        # Triton passes each occurrence (with its object's first value for the key); a model reads
        # the last one passed
        self.params[key] = value

    def tensor(self, name: str, value: Any) -> None:
        spec = self.specs[name]
        datatype = CONFIG_TO_WIRE.get(spec.get("data_type", ""), "")
        if not datatype:
            raise BadRequest(f"input '{name}' has an unsupported data type")
        values = value if isinstance(value, list) else [value]
        if datatype == "BYTES" and not all(isinstance(v, str) for v in _leaves(values)):
            raise JsonTypeError(f"Unable to parse JSON bytes array: {NOT_STRING}")
        dims = ([-1] if self.batched else []) + [int(d) for d in spec.get("dims", [])]  # the model's metadata
        shape = _tensor_shape(name, len(values), dims)
        if datatype in ("FP16", "BF16"):
            raise BadRequest(f"receiving {datatype} data via JSON is not supported. Please use the binary data "
                             f"format for input {name}")
        if any(isinstance(v, list) for v in values):
            raise unable_to_parse("data", SHAPE_MISMATCH)
        wrong = json_value_error(datatype, values)
        if wrong:
            raise unable_to_parse("data", wrong)
        if name in self.added:
            raise BadRequest(f"{self.tag}input '{name}' already exists in request")
        self.added.add(name)
        data = json_tensor_bytes(name, datatype, [len(values)], values)  # the infer endpoint's range checks
        self.inputs.append(InputTensor(name, datatype, shape, len(data), self.offset))
        self.chunks.append(data)
        self.offset += len(data)


def _leaves(values: list) -> list:
    out: list = []
    for v in values:
        out.extend(_leaves(v) if isinstance(v, list) else [v])
    return out


def build_generate_request(model: str, version: str, body: Any, config: dict) -> tuple[InferRequest, list]:
    """The request descriptor of a generate body (``parse_generate_body``) for a model of ``config``.
    The request's id is read first; a missing input is left to the model's input check, which
    words it as Triton does. (A dict, as the OpenAI routes make, is read as its pairs.)"""
    if isinstance(body, dict):
        body = Pairs(body.items())
    if not isinstance(body, Pairs):
        raise JsonTypeError(f"{NOT_OBJECT} (the generate request must be a JSON object)")
    request_id = next((v for k, v in body if k == "id"), "")
    if not isinstance(request_id, str):
        raise unable_to_parse("id", NOT_STRING)
    conversion = _GenerateRequest(model, config, request_id)
    conversion.members(body)
    return InferRequest(model, version, conversion.inputs, None, request_id, conversion.params or None), \
        conversion.chunks


def _tensor_shape(name: str, count: int, dims: list[int]) -> list[int]:
    """The shape ``count`` values take in an input of the model's metadata shape ``dims`` (a
    batching model's batch dimension first, as -1), as Triton's generate endpoint forms it: the
    fixed dimensions must divide the count; the innermost variable dimension takes what is left,
    any other is 1."""
    shape = list(dims)
    left = count
    for d in reversed(shape):
        if d != -1:
            if d <= 0 or left % d:
                raise BadRequest(f"The schema can not convert input '{name}' to tensor with proper shape")
            left //= d
    for i in range(len(shape) - 1, -1, -1):
        if shape[i] == -1:
            shape[i], left = left, 1
    if left != 1:
        raise BadRequest(f"The schema can not convert input '{name}' to tensor with proper shape")
    return shape


def output_values(answer: AnswerDescriptor, tensor_of: Any) -> dict[str, Any]:
    """A response's outputs by name: one-element tensors as scalars (BYTES as text), others lists."""
    out: dict[str, Any] = {}
    for o in answer.outputs:
        values = json_data(o.datatype, tensor_of(o), o.shape)
        out[o.name] = values[0] if len(values) == 1 else values
    return out


def generate_response(model: str, answer: AnswerDescriptor, tensor_of: Any, request_id: str = "") -> bytes:
    """One response as Triton's generate endpoint writes it: the request's id (if it had one),
    the model's name and version, the response's parameters and its outputs, one flat object
    (where names meet, that order wins); a float output's NaN or infinity as Triton writes it
    (``NaN``, ``Infinity``), where orjson would write null."""
    resp: dict[str, Any] = {"id": request_id} if request_id else {}
    resp["model_name"] = model
    resp["model_version"] = answer.served_version()
    for key, value in (answer.params or {}).items():
        resp.setdefault(key, value)
    for key, value in output_values(answer, tensor_of).items():
        resp.setdefault(key, value)
    return dumps(resp, ((o.datatype, tensor_of(o)) for o in answer.outputs if o.datatype in FLOAT_TYPES))


class EventStream(StreamingResponse):
    """The server-sent events of one ``generate_stream`` request: one event per response, an
    error as ``{"error": ...}``. However the response ends (the last event sent, or the client
    gone mid-stream and the sending cancelled or failed), the stream's events are closed: what
    was not sent is freed, and so is every response the model still sends. A traced request's
    events are timed as they are sent (``timed_sends``), its trace written when the response ends."""

    def __init__(self, model: str, events: StreamEvents, trace: Trace | None, tracer: Tracer,
                 request_id: str = "", first: tuple | None = None, status: int = 200) -> None:
        self.model = model
        self.request_id = request_id
        self.first = first  # the stream's first event, if the caller has taken it already
        self.events = events
        self.trace = trace
        lines = self._lines()
        super().__init__(lines if trace is None else timed_sends(lines, trace, tracer), status_code=status,
                         media_type="text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.first is not None:  # never read (the client left first)
                self.first[1].release()
                self.first = None
            self.events.close()
            if self.trace is not None:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]  # writes the trace if not yet

    async def _lines(self) -> AsyncGenerator[bytes, None]:
        while True:
            if self.first is not None:
                (final, completion, _), self.first = self.first, None
            else:
                final, completion, _ = await self.events.next()
            try:
                answer = completion.answer
                if self.trace is not None:
                    self.trace.collect(answer)  # the version served; the final one ends the request
                if completion.status != 200:
                    line = orjson.dumps({"error": answer.error or "inference failed"})
                elif not final:
                    line = generate_response(self.model, answer, completion.tensor, self.request_id)
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
