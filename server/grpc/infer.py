"""ModelInfer's path: a ``ModelInferRequest`` to the broker link and its answer back.

The request becomes codec.py's descriptor through the KServe document (tensors.py), goes out with
``BrokerLink.submit`` like an HTTP request, and its completion becomes a ``ModelInferResponse``.
A client that cancels the call cancels the request (``BrokerLink.cancel``); its answer is freed
when it comes.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from shmserve.server.frontend.codec import BadRequest, build_request
from shmserve.server.frontend.inference import ARENA_WAIT_S
from shmserve.server.frontend.link import ArenaWait, BrokerError, BrokerLink, Sent
from shmserve.shm.completion import Completion
from shmserve.shm.protocol import REQ_INFER

from .status import code_of
from .tensors import infer_response, request_doc


# The worker refuses a single-answer request to a decoupled model in the HTTP frontend's words;
# over gRPC Triton says it in these.
HTTP_DECOUPLED = "HTTP end point doesn't support models with decoupled transaction policy"
GRPC_DECOUPLED = "ModelInfer RPC doesn't support models with decoupled transaction policy"


class Aborted(Exception):
    """A request answered with an error status: (gRPC code, message)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class GrpcInference:
    """One gRPC frontend's inference requests, on its broker link."""

    def __init__(self, link: BrokerLink, max_tensor_elements: int, arena_bytes: int) -> None:
        self.link = link
        self.max_tensor_elements = max_tensor_elements
        self.max_request_bytes = arena_bytes - (64 << 10)  # as Inference: what can never fit the arena

    async def infer(self, request: Any) -> Any:
        """The ``ModelInferResponse`` of ``request``; raises ``Aborted`` for an error answer."""
        received = time.monotonic_ns()
        model, version = request.model_name, request.model_version
        try:
            doc, pieces = request_doc(request)
            req, chunks = build_request(model, version, doc, pieces, self.max_tensor_elements)  # type: ignore[arg-type]
            size = sum(len(c) for c in chunks)
            if size > self.max_request_bytes:
                raise BadRequest(f"the request's {size} bytes of tensor data exceed the frontend's shared-memory "
                                 f"arena (--frontend-arena-mb); send large tensors through shared memory")
        except BadRequest as e:
            raise await self._refusal(model, version, e) from None
        req["t"] = received
        completion = await self._submit(req, chunks, model)
        try:
            result = completion.doc()
            if completion.status != 200:
                error = result.get("error", "inference failed")
                raise Aborted(code_of(completion.status), GRPC_DECOUPLED if error == HTTP_DECOUPLED else error)
            return infer_response(model, str(result.get("version", version)), doc, result, completion.tensor)
        finally:
            completion.release()

    async def _submit(self, req: dict, chunks: list, model: str) -> Completion:
        """Send the request, waiting up to ``ARENA_WAIT_S`` for room in a fragmented arena (as
        ``Inference.start_when_room``), and await its completion."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()

        def resolve(completion: Completion) -> None:
            if fut.done():  # the call was cancelled: nobody reads this answer
                completion.release()
            else:
                fut.set_result(completion)

        deadline = time.monotonic() + ARENA_WAIT_S
        while True:
            try:
                sent: Sent = self.link.submit(REQ_INFER, req, chunks, resolve, model=model)
                break
            except ArenaWait as e:
                if time.monotonic() > deadline:
                    raise Aborted(code_of(e.status), str(e)) from None
            except BrokerError as e:
                raise Aborted(code_of(e.status), str(e)) from None
            await asyncio.sleep(0.001)
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
