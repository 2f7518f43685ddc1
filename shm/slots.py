"""A connection's completion slots: which are free, what each request in flight waits for, and
running the callbacks of those answered.

Each request takes a slot in the client segment's table. Whoever answers it (a worker, or the
broker) writes the answer's place into the slot and marks it done last; the owner then finds it
done here, builds its ``Completion`` and runs the request's callback. A streaming request also
has a ring in its own block, where its worker puts one record per response before it completes
the slot.
"""
from __future__ import annotations

import collections
import logging
import threading

import numpy as np
import posix_ipc

from .answer import AnswerDescriptor
from .channel import ClientSegment, control_name
from .completion import Callback, Completion
from .extents import map_broker_extent, map_worker_extent
from .names import object_name
from .protocol import EXTENT_SHIFT, LAST_RESPONSE, RECORD, ROLE_BROKER, ROLE_MASK, ROLE_NAMES, \
    SLOT_BYTES, SLOT_DONE, SLOT_FREE, SLOT_PENDING, STREAM_CAPACITY, no_block_text
from .ring import Ring
from .routes import Router
from .segment import Segment, SegmentCache

log = logging.getLogger("shmserve.client")


class Slots:
    """The slot table of one client segment, seen from its owner. ``lock`` guards the
    bookkeeping (and the connection's arena allocations): callbacks run without it."""

    def __init__(self, server_id: str, seg: ClientSegment, router: Router) -> None:
        self.server_id = server_id
        self.seg = seg
        self.router = router
        self.lock = threading.Lock()
        n = seg.nslots
        self._free = collections.deque(range(n))
        # The slots in flight, in the order their requests were sent: the answers one look finds
        # are completed in that order, so that a stream whose model answered its requests one by
        # one reads them in that order, as a Triton client reads them (slots are reused round the
        # table, so their numbers are not that order).
        self.inflight: dict[int, None] = {}
        self._sent_order = np.zeros(n, np.int64)  # slot -> its request's number, for many in flight
        self._sent = 0
        self._streams: dict[int, tuple[Ring, Callback]] = {}  # slot -> its response ring
        # Held while rings are read: the leader's ``complete_all`` and a closing owner's
        # ``drop_streams`` (a record read twice would be freed twice). Reentrant: a callback may
        # lead a call of its own.
        self._reading = threading.RLock()
        self.closing = ""  # set by ``cancel_all``: what every answer still to come says instead
        self._callbacks: list[tuple[Callback, int] | None] = [None] * n  # slot -> (callback, request block)
        self._starts: list[int] = [0] * n  # slot -> where its request's tensor bytes start (``find_start``)
        self._targets: list[int] = [0] * n  # slot -> the worker it went to, plus one (0: the broker)
        self._states = seg.slot_states
        # The same states as 32-bit words: a memoryview's item read costs a third of numpy's, and
        # a waiting caller reads them on every poll.
        base = seg.slots_offset
        self._words = seg.seg.buf[base:base + n * SLOT_BYTES].cast("I")
        self._stride = SLOT_BYTES // 4
        self._segments = SegmentCache()
        # (role, worker number, extent) -> its mapping (shm/extents.py: a worker's arena grows)
        self._producers: dict[tuple[int, int, int], Segment] = {}

    # -- taking and giving back (``lock`` held) ---------------------------------------------------
    def take(self, callback: Callback, off: int, start: int, stream: tuple[int, Callback] | None) -> int:
        """A slot for the request whose block is at ``off`` (its tensor bytes at ``start``);
        ``stream``: (where its response ring lies, the callback of each response). -1 if none is
        free. A slot starts uncancelled."""
        if not self._free:
            return -1
        slot = self._free.popleft()
        self.seg.uncancel(slot)
        self._callbacks[slot] = (callback, off)
        self._starts[slot] = start
        self.inflight[slot] = None
        self._sent += 1
        self._sent_order[slot] = self._sent
        if stream is not None:
            ring = Ring(self.seg.seg.buf, stream[0], STREAM_CAPACITY, RECORD)
            ring.reset()
            self._streams[slot] = (ring, stream[1])
        return slot

    def target(self, slot: int, worker: int | None) -> None:
        """Say where the request went: a worker's lane, or (None) the broker. The target before
        the state: the broker reads a pending slot's target to answer requests lost with a
        worker, and must never see one left from the slot's last use."""
        self.seg.set_target(slot, 0 if worker is None else worker + 1)
        self._words[slot * self._stride] = SLOT_PENDING

    def went_to(self, slot: int, worker: int) -> None:
        """The request is on ``worker``'s lane: one more of ours in flight there."""
        self._targets[slot] = worker + 1
        self.router.began(worker)

    def untaken(self) -> list[tuple[int, int]]:
        """(slot, worker) of each request on a worker's lane that the worker has not taken yet
        (``ClientSegment.take_bound``); ``lock`` held."""
        targets, words, stride = self._targets, self._words, self._stride
        return [(s, targets[s] - 1) for s in self.inflight
                if targets[s] and words[s * stride] == SLOT_PENDING and not self.seg.taken(s)]

    def find_start(self, start: int) -> int:
        """The slot of the request in flight whose tensor bytes start at ``start`` (-1: answered
        already). A scan: only a cancel asks, and blocks in flight never share an offset."""
        starts = self._starts
        for slot in self.inflight:
            if starts[slot] == start and self._callbacks[slot] is not None:
                return slot
        return -1

    def give_back(self, slot: int) -> None:
        """A request that could not be sent after all."""
        self.seg.set_slot_state(slot, SLOT_FREE)
        self._callbacks[slot] = None
        self.inflight.pop(slot, None)
        self._streams.pop(slot, None)
        self._free.append(slot)

    # -- completing -------------------------------------------------------------------------------
    def has_done(self) -> bool:
        """Polled while waiting: anything answered, in the fewest steps for a few in flight."""
        if self._streams and any(ring.pending() for ring, _ in list(self._streams.values())):
            return True
        inflight = self.inflight
        if len(inflight) < 64:
            words, stride = self._words, self._stride
            for s in list(inflight):
                if words[s * stride] == SLOT_DONE:
                    return True
            return False
        return bool(self._done())

    def cancel_all(self, why: str) -> None:
        """The owner closes (``lock`` held): every request in flight is cancelled, so that its
        worker drops what it would still send (its model sees ``is_cancelled()``), and each
        answer still to come is freed unread and fails with ``why``: a caller waiting on another
        thread is never told that a stream ended well when responses of it were dropped."""
        self.closing = why
        for slot in self.inflight:
            self.seg.cancel(slot)

    def drop_streams(self) -> None:
        """Free what the streams' rings hold unread (after ``cancel_all``): those blocks lie in
        their producers' arenas, which nobody else would free while this process lives."""
        with self._reading:
            for ring, _ in list(self._streams.values()):
                self._deliver(ring.drain(), None)

    def complete_all(self) -> bool:
        """Run the callbacks of everything answered so far, in the order the requests were sent,
        each streaming request's responses then its completion; True if there was anything.

        A worker answers the requests it takes one after another, writing a request's responses
        into its ring before it completes its slot, while this look goes on. So the streams are
        looked at latest sent first (a slot's state before its ring: once it says done, the ring
        is whole), and what was found is run earliest first: whatever the look found of a later
        request, it found all that came before of an earlier one, and runs that first (as Triton
        writes a stream's messages in the order its model gave them)."""
        with self._reading:
            return self._complete_found()

    def _complete_found(self) -> bool:
        words, stride = self._words, self._stride
        found: list[tuple[int, list, bool, Callback]] = []  # (slot, ring records, done, its callback), latest first
        for slot, (ring, on_response) in reversed(list(self._streams.items())):
            done = words[slot * stride] == SLOT_DONE
            records = ring.drain()
            if done or records:
                found.append((slot, records, done, on_response))
        for slot, records, done, on_response in reversed(found):
            self._deliver(records, on_response)
            if done:
                self._streams.pop(slot, None)
                self._complete(slot)
        done_slots = self._done()  # the rest: requests with no ring (a stream's found done since is drained now)
        for slot in done_slots:
            stream = self._streams.pop(slot, None)
            if stream is not None:
                self._deliver(stream[0].drain(), stream[1])
            self._complete(slot)
        return bool(found or done_slots)

    def fail_all(self, msg: str) -> None:
        """Answer every request still in flight with a 503 carrying ``msg``."""
        with self.lock:
            pending = [(i, e) for i, e in enumerate(self._callbacks) if e is not None]
            for i, _ in pending:
                self._callbacks[i] = None
            self.inflight.clear()
            self._streams.clear()
        for _, (callback, req_off) in pending:
            try:
                callback(Completion(503, None, 0, AnswerDescriptor.failure(msg), request=(self.seg.seg.buf, req_off)))
            except Exception:  # noqa: BLE001
                log.exception("completion callback failed")

    def close(self) -> None:
        self._producers.clear()
        self._segments.clear()

    def _done(self) -> list[int]:
        """Slots answered since we last looked, in the order sent; a plain scan of the few in
        flight is cheaper than numpy over the whole table until many are in flight."""
        inflight = self.inflight
        if len(inflight) < 64:  # (latest sent first, as ``complete_all`` looks: see there)
            words, stride = self._words, self._stride
            return [s for s in reversed(list(inflight)) if words[s * stride] == SLOT_DONE][::-1]
        # numpy reads the table in slot order, not the order sent: a second read finds those sent
        # before the latest one the first found, which were answered before it.
        states, order = self._states, self._sent_order
        done = np.flatnonzero(states == SLOT_DONE)
        if len(done):
            latest = order[done].max()
            done = np.flatnonzero((states == SLOT_DONE) & (order <= latest))
        return done[np.argsort(order[done], kind="stable")].tolist()

    def _producer_buf(self, role: int, num: int, extent: int = 0) -> memoryview:
        """A view of the mapping an answer lies in, its own: it stays valid while the answer is
        read even if the cache drops the segment meanwhile (its producer is gone, or the cache is
        full); a cached buffer would be released under it. ``extent``: which of a worker's
        output extents, or the broker's (0: its own segment; others are checked by ``extents.map_extent``)."""
        key = (role, num, extent)
        seg = self._producers.get(key)
        if seg is not None and not seg.closed:
            try:
                return seg.view()
            except ValueError:  # closed since we looked
                pass
        if role not in ROLE_NAMES:
            raise KeyError(f"no producer of role {role}, extent {extent}")
        name = object_name(self.server_id, "broker", 0) if role == ROLE_BROKER else \
            object_name(self.server_id, ROLE_NAMES[role], num)
        if extent and role == ROLE_BROKER:
            tables = self._segments.get(object_name(self.server_id, "tables", 0), readonly=True)
            seg = map_broker_extent(self._segments, self.server_id, extent, tables)
        elif extent:
            control = self._segments.get(control_name(name), readonly=True)
            seg = map_worker_extent(self._segments, self.server_id, num, extent, control)
        else:
            seg = self._segments.get(name)
        self._producers[key] = seg
        return seg.view()

    def forget_gone_producers(self) -> None:
        """Unmap the segments of workers that are gone (the broker unlinks a worker's segment
        once it has exited): a long-lived client would otherwise keep a mapping for every worker
        ever restarted or reloaded, until its cache's bound made it drop mappings still in use."""
        self._segments.drop_unlinked(object_name(self.server_id, "worker", ""))
        self._segments.drop_unlinked(object_name(self.server_id, "control", ""))
        self._segments.drop_unlinked(object_name(self.server_id, "broker", "0.arena."))  # its retired extents
        for key, seg in list(self._producers.items()):
            if seg.closed:
                self._producers.pop(key, None)

    def _deliver(self, records: list, on_response: Callback | None) -> None:
        """Run a stream's callback for each of its ring's ``records`` (None, or closing: free
        each unread)."""
        if self.closing:
            on_response = None
        for status, word, off, length, num in records:
            try:
                buf = self._producer_buf(word & ROLE_MASK, num, word >> EXTENT_SHIFT)
                if not 0 < off <= off + length <= len(buf):
                    continue  # not a block of that mapping: nothing to read, nothing to free
                completion = Completion(status, buf, off, end=off + length, last=bool(word & LAST_RESPONSE))
            except (posix_ipc.ExistentialError, KeyError, OSError):
                continue
            if on_response is None:
                completion.release()
                continue
            try:
                on_response(completion)
            except Exception:  # noqa: BLE001
                log.exception("stream callback failed")
                completion.release()

    def _complete(self, slot: int) -> None:
        with self.lock:
            entry = self._callbacks[slot]
            if entry is None or self._words[slot * self._stride] != SLOT_DONE:
                return  # already completed, or failed with the server
            _, status, role, num, off, length, _ = self.seg.read_slot(slot)
            self._callbacks[slot] = None
            self.inflight.pop(slot, None)
            target = self._targets[slot]
            if target:
                self._targets[slot] = 0
                self.router.ended(target - 1)
            self._words[slot * self._stride] = SLOT_FREE
            self._free.append(slot)
        callback, req_off = entry
        request = (self.seg.seg.buf, req_off)
        try:
            if off:
                buf = self._producer_buf(role & ROLE_MASK, num, role >> EXTENT_SHIFT)
                if off + length > len(buf):
                    raise OSError(f"the answer's block ({off}+{length}) lies outside its segment ({len(buf)})")
                completion = Completion(status, buf, off, request=request, end=off + length)
            else:  # no block (0 is never a block's offset): its producer had no room, not even for an error
                completion = Completion(status, None, 0, AnswerDescriptor.failure(no_block_text(length)),
                                        request=request)
        except (posix_ipc.ExistentialError, KeyError, OSError):
            completion = Completion(500, None, 0, AnswerDescriptor.failure("the response was lost: its producer is gone"),
                                    request=request)
        if self.closing:  # (cancel_all) its stream's responses were dropped: no answer reads as whole
            completion.release()  # (its request block too)
            completion = Completion(503, None, 0, AnswerDescriptor.failure(self.closing))
        try:
            callback(completion)
        except Exception:  # noqa: BLE001 - a faulty callback must not kill the waiter thread
            log.exception("completion callback failed")
            completion.release()
