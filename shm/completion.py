"""One answer as a connection's owner receives it, and the callback a synchronous caller waits on.

A completion points at a block in its producer's arena (a worker's or the broker's): an answer
descriptor (shm/answer.py), then the outputs' bytes. The owner reads what it needs and calls
``release``, which frees that block together with the request's own block in the owner's arena.
A reader that cannot take it now (a stream's client reading slowly) ``detach``es it: its bytes
are copied to the owner's heap and both blocks freed at once, since arenas are FIFO and one block
held stalls every allocation behind it.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable

from .answer import AnswerCorrupt, AnswerDescriptor, OutputTensor, decode_answer
from .arena import free_block


class Completion:
    """One answer: a status and a block in the producer's arena. ``release`` frees it together
    with the request's own block (outputs the server wrote into room reserved there live on
    until then)."""

    __slots__ = ("status", "buf", "offset", "end", "last", "heap_bytes", "_answer", "_data", "_request")

    def __init__(self, status: int, buf: memoryview | None, offset: int, answer: AnswerDescriptor | None = None,
                 request: tuple[memoryview, int] | None = None, end: int | None = None, last: bool = False) -> None:
        self.status = status
        self.buf = buf
        self.offset = offset
        self.end = end  # where the block ends (None: the mapping's end)
        self.last = last  # a stream's response sent with the final flag (protocol.LAST_RESPONSE)
        self.heap_bytes = 0  # the size of its copy in this process's heap, once ``detach``ed
        self._answer = answer
        self._data = 0
        self._request = request

    @property
    def answer(self) -> AnswerDescriptor:
        """The answer, read once (bounds-checked: a block that holds no answer reads as a 500)."""
        answer = self._answer
        if answer is None:
            assert self.buf is not None
            try:
                answer, self._data = decode_answer(self.buf, self.offset, self.end)
            except AnswerCorrupt as e:
                self.status = 500
                answer = AnswerDescriptor(error=f"the server's answer is unreadable: {e}")
            self._answer = answer
        return answer

    def tensor(self, output: OutputTensor) -> memoryview:
        """The bytes of an output the answer carries (a view: valid until ``release``)."""
        self.answer
        assert self.buf is not None
        start = self._data + output.offset
        return self.buf[start:start + output.size]

    def detach(self) -> int:
        """Copy the answer's block into this process's heap and free it now, with the request's
        own block: for a reader whose requests reserve no room for outputs in their blocks (a
        frontend's). Returns the bytes copied (0: no block was in an arena); ``release`` then
        frees what is left."""
        if self.heap_bytes:
            return 0
        buf, offset, end = self.buf, self.offset, self.end
        copy = memoryview(bytearray(buf[offset:end])) if buf is not None and end is not None else None
        try:
            if copy is not None:
                self.answer  # (read before the block goes)
                free_block(buf, offset)  # type: ignore[arg-type]
            if self._request is not None:
                free_block(*self._request)
                self._request = None
        except (TypeError, ValueError):  # the mapping is already closed: nothing left to free
            pass
        if copy is None:
            return 0
        self.buf, self.offset, self.end = copy, 0, len(copy)
        self._data -= offset
        self.heap_bytes = len(copy)
        return len(copy)

    def release(self) -> None:
        if _forked[0]:  # (inherited through fork(): the blocks are the parent's, which frees them)
            self.buf = self._request = None
            return
        try:
            if self.buf is not None and not self.heap_bytes:
                free_block(self.buf, self.offset)
            if self._request is not None:
                free_block(*self._request)
        except (TypeError, ValueError):  # the mapping is already closed: nothing left to free
            pass
        self.buf = None
        self._request = None


Callback = Callable[[Completion], None]

_forked = [False]  # set in a child of fork(): what it inherited is the parent's to free


def _after_fork() -> None:
    _forked[0] = True


os.register_at_fork(after_in_child=_after_fork)


_DROPPING = threading.Lock()  # (an abandoned answer is released once, by whichever side sees it last)


class Answer:
    """The completion callback of one synchronous call: keeps the answer, and wakes the caller
    only if it had to block (a lock: the caller usually takes its answer on its own thread,
    see ``Connection.wait_for``)."""

    __slots__ = ("completion", "_lock", "_abandoned")

    def __init__(self) -> None:
        self.completion: Completion | None = None
        self._lock: Any = None
        self._abandoned = False

    def __call__(self, completion: Completion) -> None:
        self.completion = completion
        if self._abandoned:  # (read after the write: ``abandon`` looks in the other order)
            self._drop()
            return
        lock = self._lock
        if lock is not None:
            lock.release()

    def abandon(self) -> None:
        """The caller stopped waiting (an exception, Ctrl-C): the answer, now or when it comes, is
        released unread, so its blocks do not stay taken in the arena for good."""
        self._abandoned = True
        if self.completion is not None:
            self._drop()

    def _drop(self) -> None:
        with _DROPPING:
            completion, self.completion = self.completion, None
        if completion is not None:
            completion.release()

    def done(self) -> bool:
        return self.completion is not None

    def wait(self) -> None:
        """Block until answered (the caller and the callback each look after the other's write)."""
        lock = threading.Lock()
        lock.acquire()
        self._lock = lock
        if self.completion is None:
            lock.acquire()
