"""One ``ModelStreamInfer`` call: its requests run side by side, as Triton runs them.

Triton's stream handler submits each request as soon as it is read, so requests pipelined on one
stream batch together and a quick one is not held behind a long one's stream of responses (a
decoupled model's); it writes a decoupled model's responses as they come, and the one response
of each request to a model that is not decoupled in the order the requests were read (an error
that refuses such a request included), so a client that reads those by position (tritonclient
sets no request id by default) pairs them with its requests. Here, a reader task reads the
stream and submits each request in the order read (a sequence's requests reach its scheduler in
that order), and one task per request moves its messages to the call's outbox, which the call's
generator sends from: in the order their responses came from the models (``StreamEvents``
numbers them), except that a response to a request of a model that is not decoupled waits for
those of the same kind read before it. So the responses a decoupled model sends for one request
come before those it sends for the next, as Triton writes them.

A stream takes no more than its share: at most ``MAX_RUNNING`` of its requests run at once (past
that the request read waits, and the stream is not read further, until one ends: HTTP/2's flow
control holds the client). A request of a sequence (a sequence id, to a model with a sequence
batcher) counts apart, up to ``MAX_SEQUENCE_STEPS``: sequences waiting for a slot may wait for a
later request of the same stream (the step of the slot's holder that ends it), which Triton
reads at once, so they must not keep the stream from being read. A
request whose frontend has no room now (slots, arena) waits for one of the stream's own requests
to end rather than being refused for room they hold; and a request's next message is taken once
its last was sent (a model that streams faster than its client reads waits in shared memory, as
on a stream of one request at a time), so a traced request's send pairs time the sends.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import heapq
import time
from contextlib import aclosing
from typing import Any, AsyncGenerator, AsyncIterator

import grpc

from shmserve.shm.streams import StreamEvents, next_number

from .handlers import Malformed
from .infer import GrpcInference, ModelTraits, check_version, refused
from .status import Aborted

MAX_RUNNING = 128  # requests of one stream in flight at once
MAX_SEQUENCE_STEPS = 1024  # requests of a sequence in flight at once on one stream, apart from those

# The messages of one request: its responses, and errors as ``Aborted``.
Messages = AsyncGenerator[Any, None]


@dataclasses.dataclass(frozen=True)
class _Ended:
    """How the stream ends: the client closed its side and every request ended, or reading (or
    a request's messages) failed with ``error``."""

    error: BaseException | None = None


class _Turn:
    """The place of a request to a model that is not decoupled among the stream's (``StreamRun.turns``);
    ``spent`` once its first message was sent (a model that turned out decoupled sends more: those
    go as they come)."""

    __slots__ = ("spent",)

    def __init__(self) -> None:
        self.spent = False


@dataclasses.dataclass(order=True)
class _Outgoing:
    """A message waiting in the outbox: sent in the order of ``number`` (its response's arrival,
    ``StreamEvents``), then ``sent`` is set for the request's task to take its next."""

    number: int
    message: Any = dataclasses.field(compare=False)
    sent: asyncio.Future = dataclasses.field(compare=False)
    turn: _Turn | None = dataclasses.field(default=None, compare=False)  # its request's, where it has one


class StreamRun:
    """The requests of one stream, each submitted as read, their messages in one outbox, sent in
    the order their responses came, but for a request's to a model that is not decoupled, which
    waits its turn: a message waits while a request still running (and not waiting its turn) has
    an earlier response queued and not yet made into its message."""

    def __init__(self, inference: GrpcInference, context: Any, forwarded: dict[str, str]) -> None:
        self.inference = inference
        self.context = context
        self.forwarded = forwarded
        self.outbox: list[_Outgoing] = []  # a heap
        self.ended: _Ended | None = None
        self.changed = asyncio.Event()  # a message came to the outbox, an event was taken, the stream ended
        self.running = asyncio.Semaphore(MAX_RUNNING)
        self.steps = asyncio.Semaphore(MAX_SEQUENCE_STEPS)  # (a sequence's requests)
        self.requests: set[asyncio.Task] = set()
        self.open: set[StreamEvents] = set()  # the events of the requests running
        # (number, events) of every event queued for a running request, smallest first; an entry
        # whose event was taken since is dropped once it comes first (``_first_queued``)
        self.queued_heap: list[tuple[int, StreamEvents]] = []
        self.traits: dict[tuple[str, str], ModelTraits] = {}
        # One token per running request of a model that is not decoupled, in the order read: its
        # response goes once its token is first (Triton's order for them)
        self.turns: collections.deque[_Turn] = collections.deque()
        self.turn_of: dict[StreamEvents, _Turn] = {}  # the turn of each running request that has one

    async def messages(self) -> AsyncIterator[Any]:
        """Every message of every request, in the order their responses came; ends when the
        client closed its side and every request ended. Closing it (the call ended) cancels
        what still runs."""
        reader = asyncio.create_task(self._read())
        try:
            while True:
                item = self._next_out()
                if item is None:
                    ended = self.ended
                    if ended is not None and not self.outbox:
                        if ended.error is not None:
                            raise ended.error
                        return
                    self.changed.clear()
                    await self.changed.wait()
                    continue
                yield item.message
                if item.turn is not None and not item.turn.spent:
                    item.turn.spent = True
                    if self.turns and self.turns[0] is item.turn:
                        self.turns.popleft()
                if not item.sent.done():
                    item.sent.set_result(None)
                item = None  # (not held while the stream waits: an error's traceback holds its request)
        finally:
            reader.cancel()
            for task in list(self.requests):
                task.cancel()
            for events in list(self.open):  # (a task cancelled before its first step closes nothing)
                events.on_queued = events.on_taken = None
                events.close()

    def _next_out(self) -> _Outgoing | None:
        """The outbox's first message whose turn it is (a response to a model that is not
        decoupled waits for those read before it), unless a running request's earlier response
        is queued still (its task makes it into a message and puts it here next); once the
        stream ended with an error, what is in the outbox goes first as it stands."""
        outbox = self.outbox
        if not outbox:
            return None
        if self.ended is not None and self.ended.error is not None:
            return heapq.heappop(outbox)
        first_queued = self._first_queued()
        if self._may_go(outbox[0].turn):  # (the usual case: no sort)
            return heapq.heappop(outbox) if outbox[0].number <= first_queued else None
        for item in sorted(outbox):
            if item.number > first_queued:
                return None
            if self._may_go(item.turn):
                outbox.remove(item)
                heapq.heapify(outbox)
                return item
        return None

    def _may_go(self, turn: _Turn | None) -> bool:
        """Whether a message of a request with ``turn`` may be sent now, as far as turns go."""
        return turn is None or turn.spent or (bool(self.turns) and self.turns[0] is turn)

    def _first_queued(self) -> float:
        """The smallest number of an event queued for a running request that is not waiting
        its turn (infinity: none is). One that waits sends nothing before its turn, whatever
        came first: its events (the end that follows its response) hold back no one else's."""
        queued = self.queued_heap
        while queued and queued[0][1].head() != queued[0][0]:  # taken, or dropped with its request
            heapq.heappop(queued)
        if not queued:
            return float("inf")
        if self._may_go(self.turn_of.get(queued[0][1])):  # (the usual case: no sort)
            return queued[0][0]
        for number, events in sorted(queued, key=lambda entry: entry[0]):
            if events.head() == number and self._may_go(self.turn_of.get(events)):
                return number
        return float("inf")

    def _on_queued(self, number: int, events: StreamEvents) -> None:
        heapq.heappush(self.queued_heap, (number, events))

    def _end(self, ended: _Ended) -> None:
        if self.ended is None:
            self.ended = ended
        self.changed.set()

    async def _read(self) -> None:
        try:
            while True:
                request = await self._next_request()
                if request is None:
                    break
                messages, events, in_turn, place = request
                turn = _Turn() if in_turn else None
                if turn is not None:
                    self.turns.append(turn)
                if events is not None:
                    self.open.add(events)
                    if turn is not None:
                        self.turn_of[events] = turn
                    for number in events.queued_numbers():  # (those that came before it was read)
                        self._on_queued(number, events)
                    events.on_queued = self._on_queued
                    events.on_taken = self.changed.set
                task = asyncio.create_task(self._take(messages, events, turn, place))
                self.requests.add(task)
                task.add_done_callback(self.requests.discard)
            while self.requests:
                await asyncio.wait(list(self.requests))
            self._end(_Ended())
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - the call's generator raises it
            self._end(_Ended(e))

    async def _next_request(self) -> tuple[Messages, StreamEvents | None, bool, asyncio.Semaphore] | None:
        """The messages of the next request read, submitted before the next is read, their
        events, whether they wait their turn (a model that is not decoupled, or a request
        refused before its model was known), and the place it took before it was submitted (one
        of ``MAX_RUNNING``, or of ``MAX_SEQUENCE_STEPS`` for a request of a sequence), which
        its end gives back; None at the end. While tracing is on, the wait for it and its read are timed
        (Triton's GRPC_WAITREAD_START and _END) for the trace it may get (infer.py). What a
        model is (decoupled, sequence-batched) is asked once per model and stream."""
        waiting = time.monotonic_ns() if self.inference.tracer.on else 0
        request = await self.context.read()
        if request is grpc.aio.EOF:
            return None
        read = (waiting, time.monotonic_ns()) if waiting else (0, 0)
        if type(request) is Malformed:
            await self.running.acquire()
            return refused(Aborted(grpc.StatusCode.INVALID_ARGUMENT, request.message)), None, True, self.running
        try:
            key = (request.model_name, check_version(request.model_version))
        except Aborted:  # (the request itself is refused for it)
            key = (request.model_name, request.model_version)
        if key not in self.traits:
            self.traits[key] = await self.inference.traits(*key)
        traits = self.traits[key]
        place = self.steps if traits.sequence_batched and _in_a_sequence(request) else self.running
        await place.acquire()
        messages, events = await self.inference.stream(request, traits.decoupled, read, self.forwarded, self._room)
        return messages, events, not traits.decoupled, place

    async def _room(self) -> bool:
        """Wait for one of the stream's running requests to end (its slot and blocks given
        back); False when none runs."""
        if not self.requests:
            return False
        await asyncio.wait(list(self.requests), return_when=asyncio.FIRST_COMPLETED)
        return True

    async def _take(self, messages: Messages, events: StreamEvents | None, turn: _Turn | None,
                    place: asyncio.Semaphore) -> None:
        """Move one request's messages to the outbox, each once the one before it was sent,
        numbered as the response it was made of (made and put here with no wait between: no
        other task sees the response taken and its message not yet here); a failure ends the
        stream with it, as it ended the call before requests ran side by side."""
        loop = asyncio.get_running_loop()
        try:
            async with aclosing(messages):
                async for message in messages:
                    sent = loop.create_future()
                    number = events.taken if events is not None and events.taken else next_number()
                    heapq.heappush(self.outbox, _Outgoing(number, message, sent, turn))
                    self.changed.set()
                    await sent
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the call's generator raises it
            self._end(_Ended(e))
        finally:
            if turn is not None and turn in self.turns:  # (ended with no message sent: the next goes)
                self.turns.remove(turn)
            if events is not None:
                self.open.discard(events)
                self.turn_of.pop(events, None)
                events.on_queued = events.on_taken = None
            self.changed.set()
            place.release()


def _in_a_sequence(request: Any) -> bool:
    """Whether a request names a sequence: a ``sequence_id`` not 0 (or a string not empty)."""
    param = request.parameters.get("sequence_id")
    if param is None:
        return False
    kind = param.WhichOneof("parameter_choice")
    return bool(getattr(param, kind)) if kind is not None else False
