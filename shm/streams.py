"""What one streaming request's callbacks hand its reader, until the reader stops reading.

Each response of a stream is a block in its worker's arena, and its final completion frees the
request's own block in the owner's arena. Arenas are FIFO: one block nobody frees stalls every
allocation behind it, so a reader that stops early (an HTTP client that disconnects, a loop that
breaks out of a local stream) must free what is queued for it and what is still to come.
``close`` does both: it frees the queue and makes every later event be freed as it arrives. A
reader that stops before the final event also cancels the request (``Connection.cancel``): the
model sees ``is_cancelled()`` and may stop sending.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from typing import TYPE_CHECKING, Any, Generator

from .completion import Completion

if TYPE_CHECKING:
    from .connection import Connection


class StreamEvents:
    """The queue between a stream's callbacks and its reader: events ``(final, completion,
    context)`` in order, the final one last. ``events`` is a ``queue.Queue`` when the callbacks
    run on another thread than the reader, an ``asyncio.Queue`` when both run on one loop."""

    def __init__(self, events: "queue.Queue | asyncio.Queue") -> None:
        self.events = events
        self._lock = threading.Lock()  # orders a late event against ``close`` (they may run on two threads)
        self._closed = False
        self._ended = False  # the final event came: nothing is left to cancel
        # (connection, where the request's tensor bytes start): set by whoever submitted it
        self.request: "tuple[Connection, int] | None" = None

    def put(self, final: bool, completion: Completion, context: Any = None) -> None:
        """A callback's event: queued for the reader, or freed at once once the reader is gone."""
        with self._lock:
            self._ended |= final
            if not self._closed:
                self.events.put_nowait((final, completion, context))
                return
        completion.release()

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
            left = []
            while True:
                try:
                    left.append(self.events.get_nowait())
                except (queue.Empty, asyncio.QueueEmpty):
                    break
        for _, completion, _ in left:
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
