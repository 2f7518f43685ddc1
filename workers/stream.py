"""Responses of decoupled models: zero, one or many per request, sent whenever the model likes.

Each streaming request carries a small ring the client reserved in its own request block. Every
``send`` writes a response block into this worker's arena, puts a record on that ring and wakes
the client; the final send also completes the request's slot. Senders may be called from any
thread of the model, during or after ``execute``.

A traced request (``"trace_queued_ns"`` in its entry) is timed as one whole: its responses carry no trace
timestamps of their own, and the final answer carries the stream's QUEUE_START and COMPUTE_*:
the batch's start, its inputs read, the first response (the model's output starts), the final
flag (the model is done with the request, however long after ``execute`` it comes).
"""
from __future__ import annotations

import threading
import time

from shmserve.shm.batch_entry import BatchEntry
from shmserve.shm.answer import AnswerDescriptor
from shmserve.shm.channel import ClientSegment
from shmserve.shm.protocol import LAST_RESPONSE, RECORD, ROLE_WORKER, STREAM_CAPACITY, role_word
from shmserve.shm.ring import Ring
from shmserve.shm.stats import BUSY_SINCE, StatsWriter

from .answers import Answers
from .backend import Response
from .region_holds import RegionHolds

RING_FULL_TIMEOUT_S = 60.0

Block = tuple[int, int, int, int]  # a response block: (status, extent of this worker's arena, offset, length)


class StreamSender:
    """The sender of one streaming request. ``stats`` counts the request when it finishes,
    under ``stats_lock`` (senders run on the model's threads, the worker's loop on its own). It
    holds the request's shared-memory regions until then (``holds``): later responses may still
    write output regions or come from views of input regions."""

    def __init__(self, answers: Answers, client: ClientSegment, entry: BatchEntry, stats: StatsWriter,
                 stats_lock: threading.Lock, holds: RegionHolds) -> None:
        self.answers = answers
        self.client = client
        self.entry = entry
        self.stats = stats
        self.stats_lock = stats_lock
        self.holds = holds
        stream = entry["stream"]
        self.ring = Ring(self.client.seg.buf, stream["off"], STREAM_CAPACITY, RECORD)
        self.lock = threading.Lock()
        self.finished = False
        self.completed = False  # its slot is completed (after ``finished``: a forwarded end may wait)
        self.sent = 0
        self.failed = False  # as Triton counts it: an answer of ours failed (no room...), not a model's error response
        self.model_errored = False  # the model sent an error response (a success, kept apart for the canary)
        self.dropped = False  # a response found no room in the arena, not even for its error
        self.abandoned = False  # its client read nothing for RING_FULL_TIMEOUT_S: later responses are dropped
        self.computing = (0, 0)  # traced: the batch's start and this request's inputs read (worker.py)
        self.output_start = 0  # traced: when the first response came
        self.forwarded = bool(entry.get("regions"))  # by the broker, which holds them until the batch is done
        self.held = holds.hand_to_sender(entry)  # last: nothing above may fail with it taken

    def __call__(self, response: Response | None, final: bool) -> None:
        with self.lock:
            if self.finished:
                raise RuntimeError("this request's final response was already sent")
            if self.client.seg.closed:  # its client left, and the worker let go of its segment
                self._client_left(final)
                return
            last: Block | None = None
            if response is not None:
                if not self.output_start and "trace_queued_ns" in self.entry:
                    self.output_start = time.monotonic_ns()
                status, answer, tensors = self.answers.encode(self.entry, response)
                override, extent, off, total = self.answers.write_block(self.client, self.entry, answer, tensors)
                status = override or status
                if status != 200 and not override and response.model_error:
                    self.model_errored = True
                else:
                    self.failed |= status != 200
                if off > 0:
                    last = (status, extent, off, total)
                    if not self.sent and status == 200:  # (counted before it can reach the client)
                        with self.stats_lock:
                            self.stats.first_response(self.entry.get("sent_ns", 0))
                    if not final:
                        self._put(*last)
                    self.sent += 1
                else:  # not even its error found room: the final answer says so
                    self.dropped = True
            if final:
                self.finished = True
                self._finish(last)
        try:
            self.client.waker.notify()
        except (TypeError, ValueError):  # its client left meanwhile (its segment was let go)
            pass

    def _client_left(self, final: bool) -> None:
        """Nothing reaches a client that left: a response is dropped unwritten, and the final
        one still counts the stream and lets go of its regions (a send is no error to the model)."""
        if final:
            self.finished = self.completed = True
            self._count()
            self._let_go()

    def name_worker(self, num: int) -> None:
        """Its batch is done and the broker forgets it: a request the broker forwarded that is
        still open names worker ``num`` in its slot, so that the broker fails it if this worker
        dies before the final response (as a direct request's slot names its worker), also one
        whose end waits for the batch (``_complete``). Under the lock, on the worker's loop: no
        final response completes the slot meanwhile, and a completed one is left alone (its slot
        may already carry the client's next request)."""
        with self.lock:
            slot = self.entry["slot"]
            if not self.completed and self.client.target(slot) == 0:
                self.client.set_target(slot, num + 1)

    def _put(self, status: int, extent: int, off: int, total: int, last: bool = False) -> None:
        """Put a response on the request's ring; ``last``: it came with the final flag. A client
        that read nothing for ``RING_FULL_TIMEOUT_S`` has given up on the stream: that response
        and every later one are dropped at once, and the request is cancelled (the model sees
        ``is_cancelled()``), so a stopped reader holds the model that long once, not per response.
        A cancelled request (its client cancelled it, closed, or died: the broker then cancels
        its requests within a second) is given up on at once, its ring full or not: nobody reads
        it, and what went on its ring unread would lie in this arena until the client's process
        exits."""
        slot = self.entry["slot"]
        try:
            if self.abandoned or self.client.cancelled(slot):
                self.abandoned = True
                self.answers.arena.free(extent, off)
                return
        except (TypeError, ValueError):  # its client left meanwhile (its segment was let go)
            self.answers.arena.free(extent, off)
            return
        deadline = time.monotonic() + RING_FULL_TIMEOUT_S
        word = role_word(ROLE_WORKER, extent) | (LAST_RESPONSE if last else 0)
        try:
            while not self.ring.put(status, word, off, total, self.answers.num):
                cancelled = self.client.cancelled(slot)
                if cancelled or time.monotonic() > deadline:  # nobody reads: drop, do not hang the model
                    self.answers.arena.free(extent, off)
                    self.abandoned = True
                    if not cancelled:
                        self.client.cancel(slot)
                    return
                self.client.waker.notify()
                time.sleep(0.0005)
        except (TypeError, ValueError):  # its client left meanwhile (its segment was let go): nobody reads it
            self.answers.arena.free(extent, off)

    def _finish(self, last: Block | None) -> None:
        """Count the stream, let go of its regions, then send the ``last`` response (a model that
        is not decoupled answers once: the frontend passes that on as final) and complete the
        request's slot: the client then knows no response follows, statistics read after that
        already hold this stream, and a region it unregistered meanwhile is gone from the next
        status it asks for. Its regions are let go whatever happens here."""
        try:
            self._complete(last)
        finally:
            self._let_go()

    def _let_go(self) -> None:
        held, self.held = self.held, None
        self.holds.let_go(held)

    def _count(self) -> None:
        """Count the finished stream (under ``stats_lock``: the worker's loop counts too)."""
        with self.stats_lock:
            self.stats.finished_stream(self.entry.get("sent_ns", 0), not self.failed)
            if self.model_errored and not self.failed:
                self.stats.model_error()
            self.stats.flush()

    def _complete(self, last: Block | None) -> None:
        self._count()
        if self.dropped:  # the client reads shm.protocol.NO_ROOM
            end: Block = (503, 0, 0, 0)
        else:
            trace: tuple[int, ...] = ()
            if "trace_queued_ns" in self.entry:  # QUEUE_START (0: direct), COMPUTE_START, _INPUT_END, _OUTPUT_START, _END
                now = time.monotonic_ns()
                trace = (self.entry["trace_queued_ns"], *self.computing, self.output_start or now, now)
            final = AnswerDescriptor(final=True, responses=self.sent, trace=trace).encode()
            override, extent, off, total = self.answers.write_block(self.client, self.entry, final, [])
            end = (override or 200, extent, off, total)
        self._let_go()
        # A request the broker forwarded that ends inside ``execute``, on the worker's loop, ends
        # with its batch, after the worker told the broker the batch is done (the broker then no
        # longer counts its regions as in use).
        if (self.forwarded and threading.current_thread() is threading.main_thread()
                and self.stats.area.scalars[BUSY_SINCE]):
            self.answers.later(lambda: self._end(last, end))
        else:
            self._end(last, end)

    def _end(self, last: Block | None, end: Block) -> None:
        if last is not None:
            self._put(*last, last=True)
        self.completed = True
        try:
            self.client.complete(self.entry["slot"], end[0], role_word(ROLE_WORKER, end[1]), self.answers.num,
                                 end[2], end[3])
            self.client.waker.notify()
        except (TypeError, ValueError):  # its client left meanwhile (its segment was let go): nobody reads it
            if end[2] > 0:
                self.answers.arena.free(end[1], end[2])

    def fail(self, status: int, message: str) -> None:
        """The model raised before finishing: one error response, then the end."""
        if not self.finished:
            self(Response(error=message, status=status), final=True)
