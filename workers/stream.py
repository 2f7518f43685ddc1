"""Responses of decoupled models: zero, one or many per request, sent whenever the model likes.

Each streaming request carries a small ring the client reserved in its own request block. Every
``send`` writes a response block into this worker's arena, puts a record on that ring and wakes
the client; the final send also completes the request's slot. Senders may be called from any
thread of the model, during or after ``execute``.
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import orjson

from shmserve.shm.protocol import RECORD, ROLE_WORKER, STREAM_CAPACITY
from shmserve.shm.ring import Ring

from .backend import Response

if TYPE_CHECKING:
    from .worker import Worker

RING_FULL_TIMEOUT_S = 60.0


class StreamSender:
    def __init__(self, worker: "Worker", entry: dict) -> None:
        self.worker = worker
        self.entry = entry
        self.client = worker._client(entry["client"])
        stream = entry["stream"]
        self.ring = Ring(self.client.seg.buf, stream["off"], STREAM_CAPACITY, RECORD)
        self.lock = threading.Lock()
        self.finished = False
        self.sent = 0
        self.failed = False
        self.dropped = False  # a response found no room in the arena, not even for its error

    def __call__(self, response: Response | None, final: bool) -> None:
        with self.lock:
            if self.finished:
                raise RuntimeError("this request's final response was already sent")
            if response is not None:
                status, doc, tensors = self.worker._encode(self.entry, response)
                override, off, total = self.worker._write_block(self.entry, doc, tensors)
                status = override or status
                self.failed |= status != 200
                if off > 0:
                    self._put(status, 0, off, total)
                    self.sent += 1
                else:  # not even its error found room: the final answer says so
                    self.dropped = True
            if final:
                self.finished = True
                self._finish()
        self.client.waker.notify()

    def _put(self, status: int, flags: int, off: int, total: int) -> None:
        deadline = time.monotonic() + RING_FULL_TIMEOUT_S
        while not self.ring.put(status, flags, off, total, self.worker.num):
            if time.monotonic() > deadline:  # the client stopped reading: drop, do not hang the model
                self.worker.arena.free(off)
                return
            self.client.waker.notify()
            time.sleep(0.0005)

    def _finish(self) -> None:
        """Complete the request's slot: the client then knows no response follows."""
        if self.dropped:  # the client reads shm.protocol.NO_ROOM
            self.client.complete(self.entry["slot"], 503, ROLE_WORKER, self.worker.num, 0, 0)
        else:
            doc = orjson.dumps({"final": True, "responses": self.sent})
            override, off, total = self.worker._write_block(self.entry, doc, [])
            self.client.complete(self.entry["slot"], override or 200, ROLE_WORKER, self.worker.num, off, total)
        self.worker.stream_finished(self)

    def fail(self, status: int, message: str) -> None:
        """The model raised before finishing: one error response, then the end."""
        if not self.finished:
            self(Response(error=message, status=status), final=True)
