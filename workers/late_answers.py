"""Answers that come after ``execute`` returned: Triton's response sender in a model that is not
decoupled (one response, then the final flag, from any thread, whenever the model likes).

A backend returns a ``Deferred`` in place of such a request's response. The worker keeps the
request (its slot, its regions) in ``LateAnswers`` until the model finishes it; the model's thread
only hands the response over and wakes the worker, whose loop writes it as any other answer, so
arena writes, statistics, sequence state and the response cache stay on the loop. A kept request
whose client cancels it is answered at once (Triton's client sees its call end then too), one
whose client left is dropped, and one whose sender the model let go of without the final flag is
answered with ``ABANDONED``: nothing waits for a response that can no longer come.
"""
from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Callable

from shmserve.shm.batch_entry import BatchEntry
from shmserve.shm.waker import Waker, fence

from .backend import Response
from .region_holds import Held

ABANDONED = ("the model released the request's response sender without sending "
             "TRITONSERVER_RESPONSE_COMPLETE_FINAL")
# How often the worker looks at the cancelled words of the requests it keeps, while it keeps any
# (a local client's cancel does not wake the worker).
CANCEL_CHECK_S = 0.05


class Deferred:
    """One request's response to come: filled once by the model's side (any thread), watched by
    the worker. The first ``finish`` wins; later ones change nothing."""

    __slots__ = ("_lock", "response", "done", "_post")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.response: Response | None = None
        self.done = False
        self._post: Callable[[Deferred], None] | None = None

    def finish(self, response: Response) -> None:
        with self._lock:
            if self.done:
                return
            self.response = response
            self.done = True
            post = self._post
        if post is not None:
            post(self)

    def abandon(self) -> None:
        """The model can no longer send: its sender is gone and the final flag never came."""
        self.finish(Response(error=ABANDONED, status=500))

    def watch(self, post: Callable[[Deferred], None]) -> bool:
        """Have ``post(self)`` called once it is finished; False if it already is."""
        with self._lock:
            if self.done:
                return False
            self._post = post
            return True


@dataclasses.dataclass
class Kept:
    """A request the worker keeps until its model finishes it."""

    entry: BatchEntry
    deferred: Deferred
    sender: Any  # a streaming call's StreamSender (workers/stream.py), which then answers; else None
    phases: tuple[int, int, int]  # its batch's start, inputs built, executed: trace timestamps
    held: Held | None = None  # the regions it names, let go of once it is answered


class LateAnswers:
    """The requests a worker keeps, and those finished since its loop last looked."""

    def __init__(self, waker: Waker) -> None:
        self.waker = waker  # the worker's own: a model's thread wakes the loop through it
        self.kept: dict[int, Kept] = {}  # by id() of its Deferred
        self._finished: collections.deque[Deferred] = collections.deque()

    def __len__(self) -> int:
        return len(self.kept)

    def keep(self, kept: Kept) -> bool:
        """Keep ``kept`` until its model finishes it; False if it already has (answer it now)."""
        self.kept[id(kept.deferred)] = kept
        if kept.deferred.watch(self._post):
            return True
        del self.kept[id(kept.deferred)]
        return False

    def _post(self, deferred: Deferred) -> None:
        """On the model's thread: the record first, then the wake-up (the worker's Waker rule)."""
        self._finished.append(deferred)
        fence()
        self.waker.notify()

    def has_finished(self) -> bool:
        return bool(self._finished)

    def take_finished(self) -> list[tuple[Kept, Response]]:
        """The kept requests their models finished, with their responses."""
        out = []
        while self._finished:
            deferred = self._finished.popleft()
            kept = self.kept.pop(id(deferred), None)
            if kept is not None and deferred.response is not None:  # (else answered already: cancelled)
                out.append((kept, deferred.response))
        return out

    def take(self, which: Callable[[Kept], bool]) -> list[Kept]:
        """Stop keeping the requests ``which`` picks (cancelled ones, those of a client that left)."""
        picked = [k for k in self.kept.values() if which(k)]
        for k in picked:
            del self.kept[id(k.deferred)]
        return picked
