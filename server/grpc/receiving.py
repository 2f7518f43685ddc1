"""How many ModelInfer messages the gRPC frontend receives at once, and how long one may take.

grpc reads a unary call's request message whole, into this process's heap, before a unary
handler runs: a burst of large messages (each up to ``--grpc-max-input-size``) from many clients
at once would all be in memory together, gigabytes before the first of them is refused for want
of room in the arena. So ModelInfer is registered as a handler that reads its one message itself
(handlers.py), after taking one of its receive slots: as many largest messages as
``--grpc-receive-memory-mb`` holds (options.py; at least one). A call waiting for a slot holds
next to nothing here: grpc reads a stream's data only as far as its HTTP/2 window until a read is
asked for, and the rest waits in the client. A slot is held until the message has arrived, for at
most ``--grpc-receive-timeout-secs`` (and the frontend's half-second tick): a client that sends
its message more slowly, or never, has its call ended with DEADLINE_EXCEEDED, so that a few slow
clients cannot keep the slots from others.

Once received, a message is held by its call until the call ends; its tensors are then in the
frontend's arena too, which bounds the calls in flight (a request it cannot hold is refused at
once with UNAVAILABLE). ModelStreamInfer reads each message of a stream as the stream's requests
are submitted (stream.py), unbounded by these slots: an idle stream waits on a read for as long as
its client likes.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from shmserve.server.edge.edge_counts import EdgeCounts

from .options import RECEIVE_TIMEOUT_FLAG
from .status import Aborted


class ReceiveSlots:
    """The slots ModelInfer calls take while their message arrives (one event loop's).

    The deadline is kept by ``sweep``, on the frontend's tick, rather than a timer per call (an
    ``asyncio.timeout`` costs a timer handle made and cancelled on every request): a receipt
    ends about a tick past its time. A late call is ended from the server's side
    (``context.abort``, from a task of its own), never by cancelling its read: grpc frees a
    message it has received only when the read's result is taken, so a read cancelled just as
    its message came would keep the message for good."""

    def __init__(self, slots: int, timeout_s: float, edge: EdgeCounts | None = None) -> None:
        self.slots = slots
        self.timeout_s = timeout_s
        self.edge = edge or EdgeCounts("grpc")  # late calls are counted there (the edge metrics)
        self._free = asyncio.Semaphore(slots)
        self._receiving: dict[grpc.aio.ServicerContext, float] = {}  # each receipt's call -> when it began
        self._ending: set[grpc.aio.ServicerContext] = set()  # the late ones ``sweep`` is ending
        self._enders: set[asyncio.Task] = set()  # (held: the loop keeps only weak references to tasks)

    async def receive(self, context: grpc.aio.ServicerContext) -> Any:
        """The call's request message, read once a slot is free. Raises ``Aborted`` when the client
        ended its side with none (or grpc refused its message as too large: the client has grpc's
        RESOURCE_EXHAUSTED), and grpc's ``AbortError`` when ``sweep`` ended the call."""
        async with self._free:
            self._receiving[context] = time.monotonic()
            try:
                message = await context.read()
            finally:
                del self._receiving[context]
                self._ending.discard(context)
        if message is grpc.aio.EOF:
            raise Aborted(grpc.StatusCode.INVALID_ARGUMENT, "the call carries no request message")
        return message

    def sweep(self) -> None:
        """End the calls whose message has taken longer than the timeout: DEADLINE_EXCEEDED, sent
        from the server; their pending read then ends with grpc's ``AbortError``."""
        if not self._receiving:
            return
        began_by = time.monotonic() - self.timeout_s
        for context, began in list(self._receiving.items()):
            if began <= began_by and context not in self._ending:
                self._ending.add(context)
                self.edge.refused("receive-timeout")
                ender = asyncio.get_running_loop().create_task(self._end(context))
                self._enders.add(ender)
                ender.add_done_callback(self._enders.discard)

    async def _end(self, context: grpc.aio.ServicerContext) -> None:
        try:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"the request message did not arrive within {self.timeout_s:g} s "
                                f"({RECEIVE_TIMEOUT_FLAG})")
        except grpc.aio.AbortError:
            pass  # (how abort ends: the status is sent)
        except Exception:  # noqa: BLE001 - the call ended meanwhile (its client gone): nothing to send
            pass
