"""What one streaming request's callbacks hand its reader, until the reader stops reading.

Each response of a stream is a block in its worker's arena, and its final completion frees the
request's own block in the owner's arena. Arenas are FIFO: one block nobody frees stalls every
allocation behind it, so a reader that stops early (an HTTP client that disconnects, a loop that
breaks out of a local stream) must free what is queued for it and what is still to come.
``close`` does both: it frees the queue and makes every later event be freed as it arrives. A
reader that stops before the final event also cancels the request (``Connection.cancel``): the
model sees ``is_cancelled()`` and may stop sending.

A reader that is slow rather than gone (a network client reading its stream slower than the model
answers) would hold its blocks just as long, and the model's other clients would find its arena
full. A frontend's streams therefore share a ``SpillRoom``: a response its reader has not taken
``SPILL_AFTER_S`` after it came is copied to the frontend's heap and its blocks freed
(``Completion.detach``), and so is one that comes while the stream's responses still in arenas
take a quarter of the room (``SpillRoom.hold``: a model that writes faster than its reader takes
would fill its arena meanwhile). A reader that keeps up takes each response where its producer
wrote it, with no copy. That heap is bounded: a response that would take it past its bound ends
the stream that holds the most of it (``SpillRoom.make_room``), with an error (status 429) in
place of what it had not read, and its request is cancelled. A response larger than the whole
room is left where it is. Only for readers whose requests reserve no room for outputs in their
own blocks (a frontend's): ``detach`` frees those blocks too.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import queue
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Generator

from .answer import AnswerDescriptor
from .completion import Completion

if TYPE_CHECKING:
    from .connection import Connection


# Status of a stream ended for the responses its reader left unread (gRPC RESOURCE_EXHAUSTED).
UNREAD_STATUS = 429
# How long a response may wait in its producer's arena for a reader that is busy (sending the one
# before): copying each response that finds the reader busy cost a gRPC stream of 1 MiB tensors
# 1.4x its time.
SPILL_AFTER_S = 0.2
# The order events came in, across every stream of the process: a gRPC stream of many requests
# sends their responses in that order (server/grpc/stream.py).
_arrivals = itertools.count(1)


def next_number() -> int:
    """A number after every event's so far (for a message made of no event: a refusal)."""
    return next(_arrivals)


def _arena_bytes(completion: Completion) -> int:
    """The bytes of the answer's block in its producer's arena (0: none, or copied already)."""
    if completion.buf is None or completion.end is None or completion.heap_bytes:
        return 0
    return max(completion.end - completion.offset, 0)


class SpillRoom:
    """The heap a process's streams may fill with copies of responses their readers have not
    taken yet, at most ``limit`` bytes in all (``--frontend-arena-mb`` for a frontend: as much as
    it holds of its clients' requests). ``flag`` names that bound in the error of a stream ended
    for it."""

    def __init__(self, limit: int, flag: str) -> None:
        self.limit = limit
        self.flag = flag
        # How much of one stream's responses may wait in arenas before the next are copied at
        # once (by default a quarter of a worker's 256 MiB arena cap too): past 8 MiB, a stream of
        # large tensors its network takes more slowly than the model writes ran 1.3-1.8x its time.
        self.hold = limit // 4
        self.held = 0
        self.ended = 0  # streams ended for it (a frontend's edge metrics count them)
        self._streams: "weakref.WeakSet[StreamEvents]" = weakref.WeakSet()  # those holding some of it

    def make_room(self, size: int, stream: "StreamEvents") -> bool:
        """Room for ``size`` more bytes of ``stream``'s: streams are ended, the one holding the
        most first, until there is; False if ``stream`` itself was ended for it."""
        while self.held + size > self.limit:
            holders = [s for s in self._streams if s.spilled]
            largest = max(holders, key=lambda s: s.spilled, default=stream)
            self.ended += 1
            if largest is stream or largest.spilled < stream.spilled + size:
                stream.end_unread(stream.spilled + size, self)
                return False
            largest.end_unread(largest.spilled, self)
        self.held += size
        self._streams.add(stream)
        return True

    def give_back(self, size: int) -> None:
        self.held -= size


class StreamEvents:
    """The queue between a stream's callbacks and its reader: events ``(final, completion,
    context)`` in order, the final one last. ``events`` is a ``queue.Queue`` when the callbacks
    run on another thread than the reader, an ``asyncio.Queue`` when both run on one loop; with
    ``spill``, an event the reader leaves waiting (``SPILL_AFTER_S``, ``SpillRoom.hold``) is
    copied there (the reader takes its events with ``next``). An ``asyncio.Queue``'s events are
    numbered as they come (``head``, ``taken``), so that the reader of several requests' events
    can send them in that order: ``on_queued`` is called with each number as its event is queued,
    ``on_taken`` as one is taken."""

    def __init__(self, events: "queue.Queue | asyncio.Queue", spill: SpillRoom | None = None) -> None:
        self.events = events
        self._lock = threading.Lock()  # orders a late event against ``close`` (they may run on two threads)
        self._closed = False
        self._ended = False  # the final event came: nothing is left to cancel
        # (connection, where the request's tensor bytes start): set by whoever submitted it
        self.request: "tuple[Connection, int] | None" = None
        self._spill = spill
        self._waiting = False  # the reader waits in ``next``: an event that comes now is taken at once
        self.spilled = 0  # bytes of ``spill`` its queued events hold
        # queued, not copied yet: (when it came, its bytes, the completion), oldest first
        self._in_arena: collections.deque[tuple[float, int, Completion]] = collections.deque()
        self._in_arena_bytes = 0
        self._timer: asyncio.TimerHandle | None = None  # copies the oldest once it waited SPILL_AFTER_S
        # The numbers of the queued events, oldest first (an asyncio.Queue's only: ``next`` takes them).
        self._numbers: collections.deque[int] | None = \
            collections.deque() if isinstance(events, asyncio.Queue) else None
        self.taken = 0  # the number of the event ``next`` returned last
        self.on_queued: Callable[[int, StreamEvents], None] | None = None
        self.on_taken: Callable[[], None] | None = None

    def put(self, final: bool, completion: Completion, context: Any = None) -> None:
        """A callback's event: queued for the reader (with a spill room: copied there later if the
        reader leaves it waiting, at once if the stream's output in arenas is already the room's
        ``hold``), or freed at once once the reader is gone."""
        with self._lock:
            self._ended |= final
            if not self._closed:
                if self._spill is None or (self._waiting and self.events.empty()):
                    pass
                else:
                    size = _arena_bytes(completion)
                    if self._in_arena_bytes + size > self._spill.hold:
                        if not self._spilled(completion):
                            completion.release()  # (the stream was ended for it)
                            return
                    else:
                        self._in_arena.append((time.monotonic(), size, completion))
                        self._in_arena_bytes += size
                        if self._timer is None:
                            self._timer = asyncio.get_running_loop().call_later(SPILL_AFTER_S, self._spill_waiting)
                self._queue((final, completion, context))
                return
        completion.release()

    def _queue(self, event: tuple[bool, Completion, Any]) -> None:
        if self._numbers is not None:
            number = next_number()
            self._numbers.append(number)
            if self.on_queued is not None:
                self.on_queued(number, self)
        self.events.put_nowait(event)

    def head(self) -> int | None:
        """The number of the oldest event queued, None if none is."""
        return self._numbers[0] if self._numbers else None

    def queued_numbers(self) -> list[int]:
        """The numbers of the events queued, oldest first."""
        return list(self._numbers or ())

    def _spill_waiting(self) -> None:
        """The timer: copy what waited ``SPILL_AFTER_S``, then wait for the next oldest."""
        with self._lock:
            self._timer = None
            due = time.monotonic() - SPILL_AFTER_S
            while self._in_arena and not self._closed:
                came, size, completion = self._in_arena[0]
                if came > due:
                    self._timer = asyncio.get_running_loop().call_later(came - due, self._spill_waiting)
                    return
                self._in_arena.popleft()
                self._in_arena_bytes -= size
                if not self._spilled(completion):
                    return  # the stream was ended: what was queued is freed

    def _spilled(self, completion: Completion) -> bool:
        """``completion`` copied to the spill room, its blocks freed; False if that ended the
        stream. A response larger than the whole room stays where its producer wrote it."""
        spill = self._spill
        assert spill is not None
        size = _arena_bytes(completion)
        if size > spill.limit:
            return True
        if size and not spill.make_room(size, self):
            return False
        try:
            copied = completion.detach()  # (an answer without a block still frees its request's)
        except BaseException:
            spill.give_back(size)
            raise
        self.spilled += copied
        spill.give_back(size - copied)  # (nothing, unless no copy was made)
        return True

    def end_unread(self, unread: int, spill: SpillRoom) -> None:
        """Its reader left ``unread`` bytes of responses unread past ``spill``'s bound: what is
        queued is dropped for an error saying so, the request is cancelled, and every later
        event is freed as it comes. Called under this stream's lock, or for another stream on
        the loop both run on."""
        cancel = self.request if not self._ended and not self._closed else None
        self._closed = True
        self._ended = True
        if cancel is not None:
            cancel[0].cancel(cancel[1])
        self._drop_queued()
        error = AnswerDescriptor.failure(
            f"the stream's responses were read too slowly: {unread} bytes of them waited unread, past the "
            f"{spill.limit} bytes the server keeps of unread responses ({spill.flag}); the request was cancelled")
        self._queue((True, Completion(UNREAD_STATUS, None, 0, error, last=True), None))

    async def next(self) -> tuple[bool, Completion, Any]:
        """The next event of an ``asyncio.Queue``, waited for: one that comes while the reader
        waits here stays where its producer wrote it, since the reader takes it at once."""
        self._waiting = True
        try:
            event = await self.events.get()
        finally:
            self._waiting = False
        if self._numbers:
            self.taken = self._numbers.popleft()
        self._taken(event[1])
        if self.on_taken is not None:
            self.on_taken()
        return event

    def _taken(self, completion: Completion) -> None:
        if self._in_arena and self._in_arena[0][2] is completion:
            self._in_arena_bytes -= self._in_arena.popleft()[1]
        if completion.heap_bytes and self._spill is not None:
            self.spilled -= completion.heap_bytes
            self._spill.give_back(completion.heap_bytes)

    def close(self) -> None:
        """The reader stops: cancel the request if it has not ended, free what is queued, and
        from now on each event as it comes."""
        with self._lock:
            cancel = self.request if not self._ended and not self._closed else None
        if cancel is not None:
            cancel[0].cancel(cancel[1])
        self._discard()

    def _discard(self) -> None:
        with self._lock:
            self._closed = True
            self._drop_queued()

    def _drop_queued(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._in_arena.clear()
        self._in_arena_bytes = 0
        if self._numbers is not None:
            self._numbers.clear()
        left = []
        while True:
            try:
                left.append(self.events.get_nowait())
            except (queue.Empty, asyncio.QueueEmpty):
                break
        for _, completion, _ in left:
            self._taken(completion)
            completion.release()

    def __del__(self) -> None:
        # A reader dropped before it ever read (a generator never started runs no ``finally``):
        # the callbacks let go of this object after the final event, which is then freed here.
        if not self._closed:
            self._discard()  # (never cancels from a collector: the final event has come)


class Stream:
    """The results of one ``Client.stream`` call, an iterator; ``cancel()`` (or ``close()``)
    gives up on the rest and cancels the request on the server."""

    def __init__(self, events: StreamEvents, results: Generator[Any, None, None]) -> None:
        self._events = events
        self._results = results

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Any:
        return next(self._results)

    def cancel(self) -> None:
        self._events.close()  # cancels the request and frees what is queued and what still comes
        try:
            self._results.close()  # a reader inside it stops (its ``finally`` closes the events too)
        except ValueError:  # the generator is running on another thread (``async for`` in an executor)
            pass

    def close(self) -> None:
        """As for a generator: the same as ``cancel``."""
        self.cancel()
