"""ModelInfer's path: a ``ModelInferRequest`` to the broker link and its answer back; and
ModelStreamInfer's, one request of a stream to its responses (``stream``).

The request becomes edge/requests.py's descriptor through the KServe document (tensors.py), goes out with
``BrokerLink.submit`` like an HTTP request, and its completion becomes a ``ModelInferResponse``.
A client that cancels the call cancels the request (``BrokerLink.cancel``); its answer is freed
when it comes. While tracing is on, a sampled call is traced as an HTTP request is
(server/edge/tracing.py), its record written once the call has ended; each request on a
stream is sampled and traced on its own, its record written once its last response is sent.
"""
from __future__ import annotations

import asyncio
import re
import time
from typing import Any, AsyncGenerator

import grpc
from tritonclient.grpc import service_pb2 as pb

from shmserve.server.edge.requests import BadRequest, build_request
from shmserve.server.edge.header_forward import add_to_request, forwarded_params
from shmserve.server.edge.link import BrokerError, BrokerLink, Sent, when_room
from shmserve.server.edge.tracing import (RECV_END, RECV_START, SEND_END, SEND_START, Trace, Tracer,
                                              timed_sends)
from shmserve.shm.completion import Completion
from shmserve.shm.descriptor import InferRequest
from shmserve.shm.protocol import REQ_INFER
from shmserve.shm.trace import GRPC_STAMPS

from .status import Aborted, code_of
from .tensors import infer_response, request_doc


# The worker refuses a single-answer request to a decoupled model in the HTTP frontend's words;
# over gRPC Triton says it in these.
HTTP_DECOUPLED = "HTTP end point doesn't support models with decoupled transaction policy"
GRPC_DECOUPLED = "ModelInfer RPC doesn't support models with decoupled transaction policy"


# What C++'s std::stol reads, as Triton parses a request's model_version: optional blanks and sign,
# then digits; anything after them is ignored.
STOL = re.compile(r"\s*[+-]?\d+")


def check_version(version: str) -> None:
    """Refuse a model_version that Triton's gRPC frontend refuses before it looks the model up
    (``GetModelVersionFromString``): not an integer, or negative. Empty means the latest."""
    if not version:
        return
    number = STOL.match(version)
    if number is None:
        raise Aborted(grpc.StatusCode.INVALID_ARGUMENT,
                      f"failed to get model version from specified version string '{version}' (details: stol), "
                      f"version should be an integral value > 0")
    if int(number.group()) < 0:
        raise Aborted(grpc.StatusCode.INVALID_ARGUMENT,
                      f"invalid model version specified '{version}' , version should be an integral value > 0")


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

    async def infer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """The ``ModelInferResponse`` of ``request``; raises ``Aborted`` for an error answer.
        Sampled for tracing once the request is built, as Triton samples a ModelInfer call: one
        refused for its inputs is not traced."""
        read = time.monotonic_ns() if self.tracer.on else 0  # the message is read
        doc, req, chunks = await self._build(request, self.metadata_params(context))
        trace = self.tracer.sample(request.model_name, GRPC_STAMPS) if self.tracer.on else None
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
                raise Aborted(code_of(completion.status), GRPC_DECOUPLED if error == HTTP_DECOUPLED else error)
            response = infer_response(request.model_name, str(answer.version or request.model_version), doc,
                                      answer, completion.tensor)
        finally:
            completion.release()
        if trace is not None:
            trace.ns[SEND_START] = time.monotonic_ns()
        return response

    def _finish_trace(self, trace: Trace) -> None:
        """The call has ended (its status sent): write the record, as HTTP's once its answer is sent."""
        ns = trace.ns
        ns[SEND_END] = time.monotonic_ns()
        ns[SEND_START] = ns[SEND_START] or ns[SEND_END]  # an error status
        self.tracer.finish(trace)

    async def decoupled(self, model: str, version: str) -> bool:
        """Whether the model is decoupled (False when the broker cannot say: the request's own
        answer then says why)."""
        try:
            status, config = await self.link.control({"op": "model_config", "model": model, "version": version})
        except BrokerError:
            return False
        return status == 200 and bool((config.get("model_transaction_policy") or {}).get("decoupled"))

    async def stream(self, request: Any, decoupled: bool, read: tuple[int, int],
                     forwarded: dict[str, str] | None = None) -> AsyncGenerator[Any, None]:
        """The messages of one request on a stream (``_messages``). While tracing is on, a request
        the frontend takes is sampled as Triton's stream handler samples it: each request its own
        trace, its frontend stamps the wait for it and its read (``read``: GRPC_WAITREAD_START and
        _END, 0 when tracing was off then) and a GRPC_SEND pair per message sent; a request refused
        before it is submitted is not traced. ``forwarded``: the stream's ``metadata_params``."""
        try:
            doc, req, chunks = await self._build(request, forwarded)
        except Aborted as e:
            return refused(e)
        trace = self.tracer.sample(request.model_name, GRPC_STAMPS) if self.tracer.on else None
        if trace is None:
            return self._messages(request, decoupled, (doc, req, chunks), None)
        trace.ns[RECV_START], trace.ns[RECV_END] = read if read[0] else (req.sent_ns, req.sent_ns)
        trace.mark(req)
        return timed_sends(self._messages(request, decoupled, (doc, req, chunks), trace), trace, self.tracer)

    async def _messages(self, request: Any, decoupled: bool, built: tuple[dict, dict, list],
                        trace: Trace | None) -> AsyncGenerator[Any, None]:
        """The ``ModelStreamInferResponse`` messages of one request ``built`` (``_build``): each
        response as it comes (a decoupled model's many, another model's one), and each error as
        an ``Aborted`` with its code, which the caller sends as ``error_message`` or as the
        stream's status (the ``triton_grpc_error`` header).
        A response sent with the final flag carries ``triton_final_response`` true, the others
        false; a final flag without a response sends an empty response only when the request
        asks for it (``triton_enable_empty_final_response``), as Triton does. A model that is not
        ``decoupled`` answers once: that response is the final one."""
        doc, req, chunks = built
        try:
            events = self.link.stream(req, chunks)
        except BrokerError as e:
            yield Aborted(code_of(e.status), str(e))
            return
        empty_final = bool(doc["parameters"].get("triton_enable_empty_final_response"))
        try:
            final = False
            while not final:
                final, completion, _ = await events.events.get()
                try:
                    answer = completion.answer
                    if trace is not None:
                        trace.collect(answer)  # the version served; the final one ends the request
                    message: Any
                    if completion.status != 200:
                        message = Aborted(code_of(completion.status), answer.error or "inference failed")
                    elif final and not answer.outputs and (not empty_final or not decoupled):
                        message = None
                    else:
                        response = infer_response(request.model_name, str(answer.version or ""), doc, answer,
                                                  completion.tensor)
                        response.parameters["triton_final_response"].bool_param = final or not decoupled
                        message = pb.ModelStreamInferResponse(infer_response=response)
                finally:
                    completion.release()
                if message is not None:
                    yield message
        finally:
            events.close()  # the stream ended or the client went away: free what still comes

    async def _build(self, request: Any, forwarded: dict[str, str] | None = None) -> tuple[dict, InferRequest, list]:
        """The KServe document, the descriptor (with the ``forwarded`` parameters) and its tensor
        chunks; a refusal raises ``Aborted``."""
        received = time.monotonic_ns()
        model, version = request.model_name, request.model_version
        check_version(version)
        try:
            doc, pieces = request_doc(request)
            req, chunks = build_request(model, version, doc, pieces, self.max_tensor_elements)  # type: ignore[arg-type]
            add_to_request(req, forwarded)
            size = sum(len(c) for c in chunks)
            if size > self.max_request_bytes:
                raise BadRequest(f"the request's {size} bytes of tensor data exceed the frontend's shared-memory "
                                 f"arena (--frontend-arena-mb); send large tensors through shared memory")
        except BadRequest as e:
            raise await self._refusal(model, version, e) from None
        req.sent_ns = received
        return doc, req, chunks

    async def _submit(self, req: InferRequest, chunks: list, model: str) -> Completion:
        """Send the request, waiting for room in a fragmented arena (``link.when_room``), and
        await its completion."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()

        def resolve(completion: Completion) -> None:
            if fut.done():  # the call was cancelled: nobody reads this answer
                completion.release()
            else:
                fut.set_result(completion)

        try:
            sent: Sent = await when_room(lambda: self.link.submit(REQ_INFER, req, chunks, resolve, model=model))
        except BrokerError as e:  # (ArenaWait too, once its wait is over)
            raise Aborted(code_of(e.status), str(e)) from None
        try:
            return await fut
        except asyncio.CancelledError:
            BrokerLink.cancel(sent)  # the client cancelled the call or went away
            raise

    async def _refusal(self, model: str, version: str, e: BadRequest) -> Aborted:
        """The error of a request refused here: the model's own 404 or 503 first, as Triton looks
        the model up before the tensors (``Inference._refuse`` for HTTP)."""
        try:
            status, answer = await self.link.control({"op": "model_metadata", "model": model, "version": version})
        except BrokerError:
            status, answer = 200, {}
        if status in (404, 503):
            return Aborted(code_of(status), answer.get("error", str(e)))
        return Aborted(code_of(e.status), str(e))


async def refused(error: Aborted) -> AsyncGenerator[Any, None]:
    """The messages of a request refused before it was submitted: its error alone."""
    yield error
