"""ModelInfer's path: a ``ModelInferRequest`` to the broker link and its answer back; and
ModelStreamInfer's, one request of a stream to its responses (``stream``).

The message becomes the broker descriptor at once (requests.py, with edge/requests.py's checks),
goes out with ``BrokerLink.submit`` like an HTTP request, and its completion becomes the
serialized ``ModelInferResponse`` (responses.py).
A client that cancels the call cancels the request (``completion_of``); its answer is freed
when it comes, or at once where it had come. While tracing is on, a sampled call is traced as an HTTP request is
(server/edge/tracing.py), its record written once the call has ended; each request on a
stream is sampled and traced on its own, its record written once its last response is sent.
"""
from __future__ import annotations

import asyncio
import re
import time
from typing import Any, AsyncGenerator, Awaitable, Callable, NamedTuple

import grpc

from shmserve.server.edge.header_forward import forwarded_params
from shmserve.server.edge.link import (ArenaWait, BrokerError, BrokerLink, Overloaded, Sent, completion_of,
                                      when_room)
from shmserve.server.edge.requests import EMPTY_FINAL_PARAMETER, BadRequest, NegativeShape
from shmserve.server.edge.tracing import (RECV_END, RECV_START, REQUEST_END, SEND_END, SEND_START, Trace,
                                              Tracer, timed_sends)
from shmserve.shm import control_messages as control
from shmserve.shm.answer import DECOUPLED_REFUSAL
from shmserve.shm.completion import Completion
from shmserve.shm.streams import StreamEvents
from shmserve.shm.descriptor import InferRequest
from shmserve.shm.protocol import REQ_INFER
from shmserve.shm.trace import GRPC_STAMPS
from shmserve.signature import BATCH_DIM_NOTE, dims_text, request_tag

from .status import Aborted, answer_code, code_of
from .requests import descriptor_from_message
from .responses import error_head, infer_response


# The worker refuses a single-answer request to a decoupled model in the HTTP frontend's words
# (shm/answer.py DECOUPLED_REFUSAL); over gRPC Triton says it in these.
GRPC_DECOUPLED = "ModelInfer RPC doesn't support models with decoupled transaction policy"

# What C++'s std::stol reads, as Triton parses a request's model_version: optional blanks and sign,
# then digits; anything after them is ignored.
STOL = re.compile(r"\s*[+-]?[0-9]+", re.ASCII)


def check_version(version: str) -> str:
    """The version a model_version names, as Triton's gRPC frontend reads it before it looks the
    model up (``GetModelVersionFromString``: C++'s std::stol, then no negative number): "" for the
    latest, else the number in plain digits ("+1", " 1" and "1abc" are version 1). Refuses what
    that refuses, in its words."""
    if not version:
        return ""
    number = STOL.match(version)
    value = int(number.group()) if number is not None else None
    if value is None or not -(1 << 63) <= value < (1 << 63):  # (stol throws past a long's range)
        raise Aborted(grpc.StatusCode.INVALID_ARGUMENT,
                      f"failed to get model version from specified version string '{version}' (details: stol), "
                      f"version should be an integral value > 0")
    if value < 0:
        raise Aborted(grpc.StatusCode.INVALID_ARGUMENT,
                      f"invalid model version specified '{version}' , version should be an integral value > 0")
    return str(value)


class ModelTraits(NamedTuple):
    """What a stream needs to know of a model before it submits a request to it."""

    decoupled: bool  # its responses come as it sends them, not in the order read
    sequence_batched: bool  # its requests may wait for a sequence slot


class GrpcInference:
    """One gRPC frontend's inference requests, on its broker link."""

    def __init__(self, link: BrokerLink, tracer: Tracer, max_tensor_elements: int, arena_bytes: int,
                 header_forward: re.Pattern[str] | None = None) -> None:
        self.link = link
        self.header_forward = header_forward  # --grpc-header-forward-pattern (frontend/header_forward.py)
        self.tracer = tracer
        self.max_tensor_elements = max_tensor_elements
        self.max_request_bytes = arena_bytes - (64 << 10)  # as Inference: what can never fit the arena

    def metadata_params(self, context: grpc.aio.ServicerContext) -> dict[str, str]:
        """The request parameters a call's metadata adds under --grpc-header-forward-pattern
        (every request of a stream gets its stream's)."""
        if self.header_forward is None:
            return {}
        return forwarded_params(self.header_forward, context.invocation_metadata() or ())

    async def infer(self, request: Any, context: grpc.aio.ServicerContext) -> bytes:
        """The serialized ``ModelInferResponse`` of ``request``; raises ``Aborted`` for an error
        answer. Sampled for tracing once the request is built, as Triton samples a ModelInfer
        call: one refused for its inputs is not traced."""
        tracer = self.tracer
        read = time.monotonic_ns() if tracer.on else 0  # the message is read
        req, chunks = await self._build(request, self.metadata_params(context))
        trace = tracer.sample(request.model_name, GRPC_STAMPS) if tracer.on else None
        if trace is not None:
            trace.ns[RECV_START] = trace.ns[RECV_END] = read
            context.add_done_callback(lambda _: self._finish_trace(trace))
            trace.mark(req)
        completion = await self._submit(req, chunks, request.model_name)
        try:
            answer = completion.answer
            if trace is not None:
                trace.collect(answer)
            if completion.status != 200:
                error = answer.error or "inference failed"
                raise Aborted(answer_code(completion), GRPC_DECOUPLED if error == DECOUPLED_REFUSAL else error)
            response = infer_response(request, answer.served_version(request.model_version), answer,
                                      completion.tensor)
        finally:
            completion.release()
            if trace is not None and trace.ns[REQUEST_END]:
                trace.responded()  # (an error answer's too: Triton's handler stamps whatever the core answered)
        if trace is not None:
            trace.ns[SEND_START] = time.monotonic_ns()
        return response

    def _finish_trace(self, trace: Trace) -> None:
        """The call has ended (its status sent): write the record, as HTTP's once its answer is sent."""
        ns = trace.ns
        ns[SEND_END] = time.monotonic_ns()
        ns[SEND_START] = ns[SEND_START] or ns[SEND_END]  # an error status
        self.tracer.finish(trace)

    async def traits(self, model: str, version: str) -> ModelTraits:
        """Whether the model is decoupled, and sequence-batched (neither when the broker cannot
        say: the request's own answer then says why)."""
        try:
            status, config = await self.link.control(control.ModelConfig(model, version))
        except BrokerError:
            return ModelTraits(False, False)
        if status != 200:
            return ModelTraits(False, False)
        return ModelTraits(bool((config.get("model_transaction_policy") or {}).get("decoupled")),
                           "sequence_batching" in config)

    async def stream(self, request: Any, decoupled: bool, read: tuple[int, int],
                     forwarded: dict[str, str] | None = None,
                     room: Callable[[], Awaitable[bool]] | None = None) \
            -> tuple[AsyncGenerator[Any, None], StreamEvents | None]:
        """Submit one request of a stream, and return its messages (``_messages``) and the events
        they are made of (None for a request refused before it was submitted). Where the
        frontend has no room for it now (its slots or its arena taken), ``room`` waits for one of
        the stream's own requests to end and says whether one did; then the request is sent again,
        so a stream is never refused for room its own requests hold. While tracing is on, a
        request the frontend takes is sampled as Triton's stream handler samples it: each request
        its own trace, its frontend stamps the wait for it and its read (``read``:
        GRPC_WAITREAD_START and _END, 0 when tracing was off then) and a GRPC_SEND pair per message
        sent; a request refused before it is submitted is not traced. ``forwarded``: the stream's
        ``metadata_params``."""
        try:
            req, chunks = await self._build(request, forwarded)
            empty_final = _empty_final(request)
        except Aborted as e:
            e.head = error_head(request)
            return refused(e.with_traceback(None)), None  # (its frames hold the request, which may be large)
        trace = self.tracer.sample(request.model_name, GRPC_STAMPS) if self.tracer.on else None
        if trace is not None:
            trace.ns[RECV_START], trace.ns[RECV_END] = read if read[0] else (req.sent_ns, req.sent_ns)
            trace.mark(req)
        events = await self._send_stream(req, chunks, room)
        if not isinstance(events, StreamEvents):
            return refused(Aborted(code_of(events.status), str(events), error_head(request))), None
        messages = self._messages(request, decoupled, events, empty_final, trace)
        return (messages if trace is None else timed_sends(messages, trace, self.tracer)), events

    async def _send_stream(self, req: InferRequest, chunks: list,
                           room: Callable[[], Awaitable[bool]] | None) -> StreamEvents | BrokerError:
        """``link.stream``, sent again as long as the frontend has no room but ``room`` made some;
        a fragmented arena is waited for (``when_room``); the refusal otherwise."""
        while True:
            try:
                return self.link.stream(req, chunks)
            except Overloaded as e:
                if room is not None and await room():
                    continue
                if not isinstance(e, ArenaWait):
                    return e
            except BrokerError as e:
                return e
            try:
                return await when_room(lambda: self.link.stream(req, chunks))
            except BrokerError as e:
                return e

    async def _messages(self, request: Any, decoupled: bool, events: StreamEvents, empty_final: bool,
                        trace: Trace | None) -> AsyncGenerator[Any, None]:
        """The ``ModelStreamInferResponse`` messages of one request submitted (``events``): each
        response as it comes (a decoupled model's many, another model's one), and each error as
        an ``Aborted`` with its code, which the caller sends as ``error_message`` or as the
        stream's status (the ``triton_grpc_error`` header).
        A response sent with the final flag carries ``triton_final_response`` true
        (``Completion.last``), the others false; a final flag without a response sends an empty
        response only when the request asks for it (``empty_final``), and never after a response
        or an error sent with the final flag, as Triton does. A model that is not ``decoupled``
        answers once: that response is the final one. The empty final response names the model's
        version as the request spelled it, as Triton's does (and as an error's head)."""
        try:
            final = ended = False  # ended: a response or an error came with the final flag
            while not final:
                final, completion, _ = await events.next()
                try:
                    answer = completion.answer
                    if trace is not None:
                        trace.collect(answer)  # the version served; the final one ends the request
                    message: Aborted | bytes | None
                    if completion.status != 200:
                        ended |= completion.last  # an error sent with the final flag ends it too
                        head = error_head(request, None if answer.refused else
                                          final or not decoupled or completion.last)
                        message = Aborted(answer_code(completion), answer.error or "inference failed", head)
                    elif final and not answer.outputs and (not empty_final or not decoupled or ended):
                        message = None
                    else:
                        ended |= completion.last
                        # (the empty final response, which no version served, names it as requested)
                        message = infer_response(request, answer.served_version(request.model_version), answer,
                                                 completion.tensor, final=final or not decoupled or completion.last,
                                                 stream=True)
                finally:
                    completion.release()
                if message is not None:
                    yield message
        finally:
            events.close()  # the stream ended or the client went away: free what still comes

    async def _build(self, request: Any, forwarded: dict[str, str] | None = None) -> tuple[InferRequest, list]:
        """The descriptor (with the ``forwarded`` parameters) and its tensor chunks; a refusal
        raises ``Aborted``."""
        received = time.monotonic_ns()
        version = check_version(request.model_version)
        try:
            req, chunks = descriptor_from_message(request, self.max_tensor_elements, self.max_request_bytes, forwarded)
        except BadRequest as e:
            raise await self._refusal(request.model_name, version, e, request.id) from None
        req.version = version
        req.sent_ns = received
        return req, chunks

    async def _submit(self, req: InferRequest, chunks: list, model: str) -> Completion:
        """Send the request and await its completion: its callback sets the future this call's
        task waits on, the one hop back to it. A fragmented arena is waited for (``when_room``)."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()

        def resolve(completion: Completion) -> None:
            if fut.done():  # the call was cancelled: nobody reads this answer
                completion.release()
            else:
                fut.set_result(completion)

        def send() -> Sent:
            return self.link.submit(REQ_INFER, req, chunks, resolve, model=model)

        try:
            try:
                sent = send()
            except ArenaWait:
                sent = await when_room(send)
        except BrokerError as e:  # (ArenaWait too, once its wait is over)
            raise Aborted(code_of(e.status), str(e)) from None
        return await completion_of(fut, sent)  # (a call the client cancels or leaves cancels it)

    async def _refusal(self, model: str, version: str, e: BadRequest, request_id: str = "") -> Aborted:
        """The error of a request refused here: the model's own 404 or 503 first, as Triton looks
        the model up before the tensors (``Inference._refuse`` for HTTP)."""
        try:
            status, answer = await self.link.control(control.ModelMetadata(model, version))
        except BrokerError:
            status, answer = 200, {}
        if status in (404, 503):
            return Aborted(code_of(status), answer.get("error", str(e)))
        if isinstance(e, NegativeShape):
            text = await self._unexpected_shape(model, version, e, request_id)
            if text:
                return Aborted(code_of(e.status), text)
        return Aborted(code_of(e.status), str(e))

    async def _unexpected_shape(self, model: str, version: str, e: NegativeShape, request_id: str) -> str | None:
        """Triton's refusal of a shape with a negative dimension that the model's dims do not
        take ("unexpected shape ..."), read from the model's config; None where they take it."""
        try:
            status, config = await self.link.control(control.ModelConfig(model, version))
        except BrokerError:
            return None
        spec = next((t for t in config.get("input", []) if t.get("name") == e.input_name), None) \
            if status == 200 else None
        if spec is None:
            return None
        batched = int(config.get("max_batch_size", 0)) > 0
        dims = [int(d) for d in spec.get("dims", [])]
        given = e.shape[1:] if batched else e.shape
        if len(given) == len(dims):  # (as the core walks them: a -1 before a mismatch is its own refusal)
            for d, g in zip(dims, given):
                if g == -1:
                    return (f"{request_tag(request_id)}All input dimensions should be specified for input "
                            f"'{e.input_name}' for model '{model}', got {dims_text(e.shape)}")
                if d != -1 and d != g:
                    break
            else:
                return None
        return (f"{request_tag(request_id)}unexpected shape for input '{e.input_name}' for model '{model}'. "
                f"Expected {dims_text(([-1] if batched else []) + dims)}, got {dims_text(e.shape)}. "
                f"{BATCH_DIM_NOTE if batched else ''}")


def _empty_final(request: Any) -> bool:
    """Whether a stream's request asks for an empty response carrying only the final flag
    (``triton_enable_empty_final_response``); Triton's refusal of a value not a bool."""
    if EMPTY_FINAL_PARAMETER not in request.parameters:
        return False
    asked = request.parameters[EMPTY_FINAL_PARAMETER]
    if asked.WhichOneof("parameter_choice") != "bool_param":  # (before the request runs)
        raise Aborted(grpc.StatusCode.INVALID_ARGUMENT,
                      f"invalid value type for '{EMPTY_FINAL_PARAMETER}' parameter, expected bool_param.")
    return asked.bool_param


async def refused(error: Aborted) -> AsyncGenerator[Any, None]:
    """The messages of a request refused before it was submitted: its error alone."""
    yield error
