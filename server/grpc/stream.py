"""One ``ModelStreamInfer`` call: its requests run side by side, as Triton runs them.

Triton's stream handler submits each request as soon as it is read and writes each response as
it comes, so requests pipelined on one stream batch together and a quick one is not held behind
a long one (a decoupled model's stream of responses, say); a client tells the responses apart by
the request's ``id``. Here, a reader task reads the stream and submits each request in the order
read (a sequence's requests reach its scheduler in that order), and one task per request moves
its messages to the call's outbox, which the call's generator sends from.

Two bounds keep a stream from taking more than its share: at most ``MAX_RUNNING`` of its
requests run at once (past that the stream is not read until one ends, and HTTP/2's flow control
holds the client), and at most ``MAX_UNSENT`` messages wait to be sent (past that a request's
task stops taking its responses, which then wait in shared memory, where a model that streams
faster than its client reads is held back as before).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from contextlib import aclosing
from typing import Any, AsyncGenerator, AsyncIterator, Callable

import grpc

from .handlers import Malformed
from .infer import GrpcInference, check_version, refused
from .status import Aborted

MAX_RUNNING = 128  # requests of one stream in flight at once
MAX_UNSENT = 64  # messages of one stream built and not yet sent

# The messages of one request: its responses, and errors as ``Aborted``.
Messages = AsyncGenerator[Any, None]


@dataclasses.dataclass(frozen=True)
class _Ended:
    """The stream's last item in the outbox: the client closed its side and every request
    ended, or reading failed with ``error``."""

    error: BaseException | None = None


class StreamRun:
    """The requests of one stream, each submitted as read, their messages in one outbox."""

    def __init__(self, inference: GrpcInference, context: Any, forwarded: dict[str, str]) -> None:
        self.inference = inference
        self.context = context
        self.forwarded = forwarded
        self.outbox: asyncio.Queue[Any] = asyncio.Queue()
        self.unsent = asyncio.Semaphore(MAX_UNSENT)
        self.running = asyncio.Semaphore(MAX_RUNNING)
        self.requests: set[asyncio.Task] = set()
        self.decoupled: dict[tuple[str, str], bool] = {}

    async def messages(self) -> AsyncIterator[Any]:
        """Every message of every request, as they come; ends when the client closed its side
        and every request ended. Closing it (the call ended) cancels what still runs."""
        reader = asyncio.create_task(self._read())
        try:
            while True:
                item = await self.outbox.get()
                if isinstance(item, _Ended):
                    if item.error is not None:
                        raise item.error
                    return
                try:
                    yield item
                finally:
                    self.unsent.release()
        finally:
            reader.cancel()
            for task in list(self.requests):
                task.cancel()

    async def _read(self) -> None:
        try:
            while True:
                await self.running.acquire()
                messages = await self._next_request()
                if messages is None:
                    self.running.release()
                    break
                task = asyncio.create_task(self._take(messages))  # (tasks first run in the order made)
                self.requests.add(task)
                task.add_done_callback(self.requests.discard)
            while self.requests:
                await asyncio.wait(list(self.requests))
            self.outbox.put_nowait(_Ended())
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - the call's generator raises it
            self.outbox.put_nowait(_Ended(e))

    async def _next_request(self) -> Messages | None:
        """The messages of the next request read, submitted in the order read; None at the end.
        While tracing is on, the wait for it and its read are timed (Triton's GRPC_WAITREAD_START
        and _END) for the trace it may get (infer.py). Whether a model is decoupled is asked once
        per model and stream."""
        waiting = time.monotonic_ns() if self.inference.tracer.on else 0
        request = await self.context.read()
        if request is grpc.aio.EOF:
            return None
        read = (waiting, time.monotonic_ns()) if waiting else (0, 0)
        if type(request) is Malformed:
            return refused(Aborted(grpc.StatusCode.INVALID_ARGUMENT, request.message))
        try:
            key = (request.model_name, check_version(request.model_version))
        except Aborted:  # (the request itself is refused for it)
            key = (request.model_name, request.model_version)
        if key not in self.decoupled:
            self.decoupled[key] = await self.inference.decoupled(*key)
        return await self.inference.stream(request, self.decoupled[key], read, self.forwarded)

    async def _take(self, messages: Messages) -> None:
        """Move one request's messages to the outbox, at most ``MAX_UNSENT`` of the stream's
        waiting there; its first step submits it (``GrpcInference._messages``)."""
        try:
            async with aclosing(messages):
                async for message in messages:
                    await self.unsent.acquire()
                    self.outbox.put_nowait(message)
        finally:
            self.running.release()


async def run_stream(inference: GrpcInference, context: Any, forwarded: dict[str, str],
                     on_error: Callable[[Aborted], Any]) -> AsyncIterator[Any]:
    """The messages to send on one stream (``StreamRun``), each error passed to ``on_error``,
    whose result is sent in its place (None: the stream ends there)."""
    async with aclosing(StreamRun(inference, context, forwarded).messages()) as messages:
        async for message in messages:
            if isinstance(message, Aborted):
                message = on_error(message)
                if message is None:
                    return
            yield message
