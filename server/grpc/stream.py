"""One ``ModelStreamInfer`` call: its requests run side by side, as Triton runs them.

Triton's stream handler submits each request as soon as it is read and writes each response as
it comes, so requests pipelined on one stream batch together and a quick one is not held behind
a long one (a decoupled model's stream of responses, say); a client tells the responses apart by
the request's ``id``. Here, a reader task reads the stream and submits each request in the order
read (a sequence's requests reach its scheduler in that order), and one task per request moves
its messages to the call's outbox, which the call's generator sends from.

A stream takes no more than its share: at most ``MAX_RUNNING`` of its requests run at once (past
that the stream is not read until one ends, and HTTP/2's flow control holds the client); a
request whose frontend has no room now (slots, arena) waits for one of the stream's own requests
to end rather than being refused for room they hold; and a request's next message is taken once
its last was sent (a model that streams faster than its client reads waits in shared memory, as
on a stream of one request at a time), so a traced request's send pairs time the sends.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from contextlib import aclosing
from typing import Any, AsyncGenerator, AsyncIterator

import grpc

from .handlers import Malformed
from .infer import GrpcInference, check_version, refused
from .status import Aborted

MAX_RUNNING = 128  # requests of one stream in flight at once

# The messages of one request: its responses, and errors as ``Aborted``.
Messages = AsyncGenerator[Any, None]


@dataclasses.dataclass(frozen=True)
class _Ended:
    """The stream's last item in the outbox: the client closed its side and every request
    ended, or reading (or a request's messages) failed with ``error``."""

    error: BaseException | None = None


class StreamRun:
    """The requests of one stream, each submitted as read, their messages in one outbox: each
    with the future its request's task waits on until it was sent."""

    def __init__(self, inference: GrpcInference, context: Any, forwarded: dict[str, str]) -> None:
        self.inference = inference
        self.context = context
        self.forwarded = forwarded
        self.outbox: asyncio.Queue[Any] = asyncio.Queue()
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
                message, sent = item
                yield message
                if not sent.done():
                    sent.set_result(None)
                item = message = None  # (not held while the stream waits: an error's traceback holds its request)
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
                task = asyncio.create_task(self._take(messages))
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
        """The messages of the next request read, submitted before the next is read; None at the
        end. While tracing is on, the wait for it and its read are timed (Triton's
        GRPC_WAITREAD_START and _END) for the trace it may get (infer.py). Whether a model is
        decoupled is asked once per model and stream."""
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
        return await self.inference.stream(request, self.decoupled[key], read, self.forwarded, self._room)

    async def _room(self) -> bool:
        """Wait for one of the stream's running requests to end (its slot and blocks given
        back); False when none runs."""
        if not self.requests:
            return False
        await asyncio.wait(list(self.requests), return_when=asyncio.FIRST_COMPLETED)
        return True

    async def _take(self, messages: Messages) -> None:
        """Move one request's messages to the outbox, each once the one before it was sent; a
        failure ends the stream with it, as it ended the call before requests ran side by side."""
        loop = asyncio.get_running_loop()
        try:
            async with aclosing(messages):
                async for message in messages:
                    sent = loop.create_future()
                    self.outbox.put_nowait((message, sent))
                    await sent
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the call's generator raises it
            self.outbox.put_nowait(_Ended(e))
        finally:
            self.running.release()

