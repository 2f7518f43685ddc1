"""One answer as a connection's owner receives it, and the callback a synchronous caller waits on.

A completion points at a block in its producer's arena (a worker's or the broker's): a small
JSON document, then the outputs' bytes. The owner reads what it needs and calls ``release``,
which frees that block together with the request's own block in the owner's arena.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

from .arena import free_block
from .protocol import read_manifest_with_data


class Completion:
    """One answer: a status and a block in the producer's arena. ``release`` frees it together
    with the request's own block (outputs the server wrote into room reserved there live on
    until then)."""

    __slots__ = ("status", "buf", "offset", "_doc", "_data", "_request")

    def __init__(self, status: int, buf: memoryview | None, offset: int, doc: Any = None,
                 request: tuple[memoryview, int] | None = None) -> None:
        self.status = status
        self.buf = buf
        self.offset = offset
        self._doc = doc
        self._data = 0
        self._request = request

    def doc(self) -> Any:
        """The answer's JSON document: an object, or a list for some control answers."""
        if self._doc is None:
            assert self.buf is not None
            self._doc, self._data = read_manifest_with_data(self.buf, self.offset)
        return self._doc

    def tensor(self, desc: dict) -> memoryview:
        """The bytes of an output the response carries (a view: valid until ``release``)."""
        self.doc()
        assert self.buf is not None
        start = self._data + desc["off"]
        return self.buf[start:start + desc["size"]]

    def release(self) -> None:
        try:
            if self.buf is not None:
                free_block(self.buf, self.offset)
            if self._request is not None:
                free_block(*self._request)
        except (TypeError, ValueError):  # the mapping is already closed: nothing left to free
            pass
        self.buf = None
        self._request = None


Callback = Callable[[Completion], None]


class Answer:
    """The completion callback of one synchronous call: keeps the answer, and wakes the caller
    only if it had to block (a lock: the caller usually takes its answer on its own thread,
    see ``Connection.wait_for``)."""

    __slots__ = ("completion", "_lock")

    def __init__(self) -> None:
        self.completion: Completion | None = None
        self._lock: Any = None

    def __call__(self, completion: Completion) -> None:
        self.completion = completion
        lock = self._lock
        if lock is not None:
            lock.release()

    def done(self) -> bool:
        return self.completion is not None

    def wait(self) -> None:
        """Block until answered (the caller and the callback each look after the other's write)."""
        lock = threading.Lock()
        lock.acquire()
        self._lock = lock
        if self.completion is None:
            lock.acquire()
