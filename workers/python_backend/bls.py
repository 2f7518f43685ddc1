"""Business-logic scripting: ``pb_utils.InferenceRequest(...).exec()`` from inside ``execute``.

The worker calls other models the way any local program does: through the local client library
(``shm.client.Client``) to the broker or straight to a worker's lane. Tensors the model passes
travel through this worker's client arena; the outputs come back as views, kept alive by the
response that holds them.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from shmserve.shm.control_messages import ControlMessage

from . import pb_utils
from .convert import ERROR_CODE, array_of


log = logging.getLogger("shmserve.worker")
_gpu_memory_warned = False


def _warn_gpu_memory(request: Any) -> None:
    """``preferred_memory`` asking for GPU memory is not acted on (BLS outputs are numpy arrays in
    CPU memory): said once per instance, by name, rather than passed over in silence."""
    global _gpu_memory_warned
    preferred = request._preferred_memory
    if _gpu_memory_warned or preferred is None or \
            preferred.preferred_memory_type != pb_utils.TRITONSERVER_MEMORY_GPU:
        return
    _gpu_memory_warned = True
    log.warning("a BLS request's preferred_memory TRITONSERVER_MEMORY_GPU is not acted on: its outputs are in "
                "CPU memory (is_cpu() true), where Triton would place them on the GPU")


class Bls:
    """The worker's executor of pb_utils' calls out (``pb_utils.runtime.Executor``): BLS requests
    and the model loading API, through one local client opened on first use."""

    def __init__(self, server_id: str) -> None:
        self.server_id = server_id
        self._client: Any = None

    def client(self) -> Any:
        if self._client is None:
            from shmserve.shm.client import Client

            self._client = Client(self.server_id, arena_bytes=256 << 20)
        return self._client

    @staticmethod
    def _call(request: Any) -> tuple[str, dict, list | None, dict]:
        _warn_gpu_memory(request)
        inputs = {t.name(): array_of(t) for t in request.inputs()}
        wanted = sorted(request.requested_output_names()) or None
        flags = request.flags()
        version = request._model_version
        params = json.loads(request.parameters() or "{}")
        # -1 (the default) is the latest version, as in Triton; any other number names that version
        # (0 or -2 are no version: refused as Triton's core refuses them)
        options = {"version": "" if version == -1 else str(version), "request_id": request.request_id(),
                   "parameters": params or None, "sequence_id": request.correlation_id(),
                   "sequence_start": bool(flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START),
                   "sequence_end": bool(flags & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END),
                   "timeout": request.timeout()}
        return request._model_name, inputs, wanted, options

    @staticmethod
    def _error(e: Any, model: str = "") -> Any:
        """The target's error as the caller sees it in Triton: its message and its code (the
        model's own, or the one the server's status maps to). A decoupled target called without
        ``decoupled=True`` is told in the words of Triton's BLS, not the local client's."""
        from shmserve.shm.client import DECOUPLED_ONLY

        code = e.code if e.code is not None else ERROR_CODE.get(e.status, pb_utils.TritonError.INTERNAL)
        message = e.message
        if e.status == 501 and message == DECOUPLED_ONLY:
            message = (f"Model {model} is using the decoupled. The current BLS request call doesn't support models "
                       f"using the decoupled transaction policy. Please use 'decoupled=True' argument to the 'exec' "
                       f"or 'async_exec' calls for decoupled models.'")
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))

    @staticmethod
    def _response(result: Any) -> Any:
        return pb_utils.InferenceResponse([pb_utils.Tensor(name, result[name]) for name in result])

    def execute(self, request: Any) -> Any:
        from shmserve.shm.client import InferenceServerError

        model, inputs, wanted, options = self._call(request)
        parent = request._trace if request._trace is not None and request._trace._children is not None else None
        try:
            if parent is not None:
                sent = time.monotonic_ns()
                result = self.client().infer_async(model, inputs, wanted, _traced=True, **options).result()
                _traced_child(parent, model, sent, result)
                return self._response(result)
            return self._response(self.client().infer(model, inputs, wanted, **options))
        except InferenceServerError as e:
            return self._error(e, model)

    async def execute_async(self, request: Any) -> Any:
        from shmserve.shm.client import InferenceServerError

        model, inputs, wanted, options = self._call(request)
        parent = request._trace if request._trace is not None and request._trace._children is not None else None
        sent = time.monotonic_ns()
        try:
            result = await asyncio.wrap_future(self.client().infer_async(model, inputs, wanted, _traced=parent is not None,
                                                                         **options))
        except InferenceServerError as e:
            return self._error(e, model)
        if parent is not None:
            _traced_child(parent, model, sent, result)
        return self._response(result)

    def stream(self, request: Any) -> Any:
        """``exec(decoupled=True)``: the target's responses, one by one as they come; an error
        response ends them (as an InferenceResponse carrying the error, which Triton gives too)."""
        from shmserve.shm.client import InferenceServerError

        model, inputs, wanted, options = self._call(request)
        try:
            return ResponseIterator(self.client().stream(model, inputs, wanted, **options))  # sent now, as in Triton
        except InferenceServerError as e:  # refused at once (an unknown model): one error response, as Triton's
            return ResponseIterator(None, self._error(e, model))

    async def stream_async(self, request: Any) -> "ResponseIterator":
        """``async_exec(decoupled=True)``: as in Triton, the request is sent and its responses'
        iterator given at once (see ``ResponseIterator``)."""
        return self.stream(request)

    def control(self, message: ControlMessage) -> Any:
        """A model-control call (pb_utils.load_model and friends); TritonModelException on refusal."""
        from shmserve.shm.client import InferenceServerError

        try:
            return self.client()._control(message)
        except InferenceServerError as e:
            raise pb_utils.TritonModelException(e.message) from None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


_END = object()


def _traced_child(parent: Any, model: str, sent_ns: int, result: Any) -> None:
    """A traced request's BLS call answered: its trace (REQUEST_START when sent, the model's
    stamps, REQUEST_END now) and its own children's (an ensemble's steps) go with the parent's
    answer, which its frontend writes as traces of their own under it, as Triton does."""
    from shmserve.shm.answer import StepTrace

    version, stamps, steps = result._answer
    stamps = tuple(stamps[:5]) if len(stamps) >= 5 else (sent_ns, 0, 0, 0, 0)
    if not stamps[0]:  # sent straight to a worker's lane: no queue but its own (QUEUE_START when sent)
        stamps = (sent_ns, *stamps[1:])
    parent._add_child(StepTrace(model, version, -1, (sent_ns, *stamps, time.monotonic_ns())), steps)


class ResponseIterator:
    """What ``exec(decoupled=True)`` and ``await async_exec(decoupled=True)`` give, as in Triton:
    the target's responses as they come (an error response ends them). ``for`` and ``next()`` wait
    in the calling thread, as Triton's iterator does (and so block a model's event loop meanwhile);
    ``async for`` waits in the loop's executor, so other coroutines run on. ``cancel()`` cancels
    the request: the target sees ``is_cancelled()`` and may stop, and what it still sends is freed
    unread."""

    def __init__(self, stream: Any, refused: Any = None) -> None:
        self._stream = stream  # shm.client.Stream (None: the request was refused with ``refused``)
        self._refused = refused
        self._ended = False

    def __iter__(self) -> "ResponseIterator":
        return self

    def __next__(self) -> Any:
        from shmserve.shm.client import InferenceServerError

        if self._ended:
            raise StopIteration
        if self._stream is None:
            self._ended = True
            return self._refused
        try:
            return Bls._response(next(self._stream))
        except InferenceServerError as e:
            self._ended = True
            return Bls._error(e)
        except StopIteration:
            self._ended = True
            raise

    def __aiter__(self) -> "ResponseIterator":
        return self

    async def __anext__(self) -> Any:
        response = await asyncio.get_running_loop().run_in_executor(None, self._next_or_end)
        if response is _END:
            raise StopAsyncIteration
        return response

    def _next_or_end(self) -> Any:
        try:
            return next(self)
        except StopIteration:
            return _END

    def cancel(self) -> None:
        self._ended = True
        if self._stream is not None:
            self._stream.cancel()
