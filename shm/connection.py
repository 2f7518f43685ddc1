"""The low-level channel from one process to the broker, shared by the HTTP frontend and the
local client library.

A connection owns a client segment: a request ring the broker drains, a table of completion slots
that workers and the broker fill, and an arena for request descriptors and input tensors.

Completions reach the callback given at submit time in one of two ways:
- threaded (default): a waiter thread sleeps on the connection's semaphore and runs callbacks;
- loop-driven (``loop_driven=True``, the HTTP frontend): producers wake a FIFO the owner's event
  loop watches, and the owner calls ``on_readable`` there; callbacks run on the loop itself, with
  no thread hop (one wake-up fewer per response).
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import random
import time
from typing import Any, Callable, Iterable

import numpy as np
import orjson
import posix_ipc

from .arena import free_block
from .channel import DEFAULT_SLOTS, LANE_PENDING, NO_LANE, BrokerSegment, ClientSegment, WorkerSegment
from .names import check_server_id, object_name, pid_alive
from .region_table import RegionTable
from .protocol import (NO_ROOM, RECORD, REQ_BYE, REQ_CONTROL, REQ_DIRECT, REQ_INFER, REQ_POLLING, ROLE_NAMES, ROLE_WORKER,
                       SENT_ALL, SLOT_BYTES, SLOT_DONE, SLOT_FREE, SLOT_PENDING, STREAM_CAPACITY, manifest_room,
                       read_manifest_raw, read_manifest_with_data, rewrite_send_time, write_manifest)
from .ring import Ring
from .segment import SegmentCache
from .tensors import byte_view
from .copying import copy_into
from .waker import AWAKE, SpinPolicy, fence, read_all

log = logging.getLogger("shmserve.client")
_counter = itertools.count()
_UNKNOWN: Any = object()
ROUTE_CACHE_LIMIT = 256
SEEN_ANSWERS_LIMIT = 256  # answer documents a client keeps parsed (Completion.shared_doc),
SEEN_ANSWER_BYTES = 8192  # each at most this long
CLIENT_SPIN_S = float(os.environ.get("SHMSERVE_CLIENT_SPIN_US", "2000")) / 1e6


class ServerUnavailable(ConnectionError):
    """No server with that id is running, or it went away; a new Connection may succeed later."""


class Backpressure(RuntimeError):
    """The connection is out of slots or arena space right now; retrying later can succeed."""


SEND_TIME_DIGITS = 20  # room kept for a reserved request's send time (any 64-bit count of ns)


class Reservation:
    """A request block taken before its tensor bytes have all arrived (``Connection.reserve``)."""

    __slots__ = ("off", "total", "doc_len", "prefix", "route", "data")

    def __init__(self, off: int, total: int, doc_len: int, prefix: bytes, route: dict, data: memoryview) -> None:
        self.off = off
        self.total = total
        self.doc_len = doc_len  # the descriptor's length with the longest send time
        self.prefix = prefix
        self.route = route
        self.data: memoryview | None = data  # where the tensor bytes go; None once sent or discarded


class Answer:
    """The completion callback of one synchronous call: keeps the answer, and wakes the caller
    only if it had to block (a lock, cheaper than a Future or an Event on this hot path)."""

    __slots__ = ("completion", "_lock")

    def __init__(self) -> None:
        self.completion: Completion | None = None
        self._lock: Any = None

    def __call__(self, completion: "Completion") -> None:
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


class Completion:
    """One answer: a status and a block in the producer's arena. ``release`` frees it together
    with the request's own block (outputs the server wrote into room reserved there live on
    until then)."""

    __slots__ = ("status", "buf", "offset", "sent", "sent_at", "_doc", "_data", "_request")

    def __init__(self, status: int, buf: memoryview | None, offset: int, doc: Any = None,
                 request: tuple[memoryview, int] | None = None, sent: int = 0, sent_at: int = 0) -> None:
        self.status = status
        self.buf = buf
        self.offset = offset
        self.sent = sent  # bytes of the answer the worker wrote to the HTTP client itself
        self.sent_at = sent_at  # when it wrote them (monotonic ns)
        self._doc = doc
        self._data = 0
        self._request = request

    def doc(self) -> Any:
        """The answer's JSON document: an object, or a list for some control answers."""
        if self._doc is None:
            assert self.buf is not None
            self._doc, self._data = read_manifest_with_data(self.buf, self.offset)
        return self._doc

    def shared_doc(self, seen: dict[bytes, Any]) -> Any:
        """``doc()``, taken from ``seen`` (parsed documents by their bytes) when this answer's
        document was seen before: a repeated call gets the same answer document, and its parse
        was most of the cost of reading a small answer. The document is shared: read it only."""
        if self._doc is None:
            assert self.buf is not None
            raw, self._data = read_manifest_raw(self.buf, self.offset)
            doc = seen.get(raw)
            if doc is None:
                doc = orjson.loads(raw)
                if len(raw) <= SEEN_ANSWER_BYTES:
                    if len(seen) >= SEEN_ANSWERS_LIMIT:
                        seen.clear()
                    seen[raw] = doc
            self._doc = doc
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


class Connection:
    def __init__(self, server_id: str = "shmserve", arena_bytes: int = 64 << 20, slots: int = DEFAULT_SLOTS,
                 loop_driven: bool = False) -> None:
        self.server_id = check_server_id(server_id)
        try:
            self.broker = BrokerSegment.attach(server_id)
        except (posix_ipc.ExistentialError, ConnectionError, FileNotFoundError):
            raise ServerUnavailable(f"no shmserve server with id '{server_id}' is running on this host") from None
        self.broker_pid = self.broker.pid
        if not pid_alive(self.broker_pid):
            self.broker.close()
            raise ServerUnavailable(f"the shmserve server with id '{server_id}' is not running (stale objects)")
        self.name = object_name(server_id, "client", f"{os.getpid()}-{next(_counter)}")
        self.seg = ClientSegment.create(self.name, arena_bytes, slots, fifo=loop_driven)
        self.arena = self.seg.arena
        assert self.arena is not None
        self._free_slots = collections.deque(range(slots))
        self._inflight: set[int] = set()
        self._woken_slots: set[int] = set()  # slots whose wake-up word we raised (``want_wake``)
        self._streams: dict[int, tuple[Ring, Callback]] = {}  # slot -> its response ring
        self._callbacks: list[tuple[Callback, int] | None] = [None] * slots
        self._lock = threading.Lock()
        self._cond = threading.Condition()  # guards _leading (see "waiting" below)
        self._leading = False
        self._spin = SpinPolicy(CLIENT_SPIN_S)
        self._segments = SegmentCache()
        self._producer_bufs: dict[tuple[int, int], memoryview] = {}
        self._closed = False
        self.alive = True
        self.broker.announce(os.getpid(), self.name)
        self.lane = self._await_lane()
        self._cookie = self.seg.cookie
        self._states = self.seg.slot_states
        # The same states as 32-bit words: a memoryview's item read costs a third of numpy's, and
        # the waiting caller reads its slot's state on every poll.
        base = self.seg.slots_offset
        self._state_words = self.seg.seg.buf[base:base + slots * SLOT_BYTES].cast("I")
        self._stride = SLOT_BYTES // 4
        self._routes_gen = -1
        self._routes: dict = {}
        self._splits: dict = {}
        self._route_cache: dict[tuple[Any, Any], list[int] | None] = {}
        self._regions = RegionTable(self.broker.regions)
        self._workers: dict[int, WorkerSegment] = {}
        self._load: dict[int, int] = collections.defaultdict(int)  # worker -> our requests on it
        self._targets: list[int] = [0] * slots
        self._totals: list[int] = [0] * slots  # each slot's request block size (``rerun`` sends it again)
        self._waiter: threading.Thread | None = None
        if not loop_driven:
            self._waiter = threading.Thread(target=self._wait_loop, name=f"shmserve-completions-{self.name}",
                                            daemon=True)
            self._waiter.start()

    def _await_lane(self, timeout: float = 10.0) -> int | None:
        """Wait until the broker has taken our connect record (and given us a lane, if one is free)."""
        deadline = time.monotonic() + timeout
        delay = 0.0001
        while self.seg.lane == LANE_PENDING:
            if time.monotonic() > deadline or not pid_alive(self.broker_pid):
                self.seg.close()
                self.seg.unlink()
                raise ServerUnavailable(f"the shmserve server '{self.server_id}' did not accept the connection")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
        lane = self.seg.lane
        return None if lane == NO_LANE else lane

    # -- routing --------------------------------------------------------------------------------
    def _route(self, doc: dict) -> int | None:
        """The worker to send ``doc`` to directly, or None to go through the broker."""
        # (a local caller may name the version as a number, as the broker accepts it)
        workers = self._direct_route(doc.get("model"), str(doc.get("version") or ""))
        if workers is None:
            return None
        # Registered regions: the worker resolves (and bounds-checks) those the broker published;
        # any other name (a CUDA region, one not yet published, a mistake) goes to the broker.
        for t in doc.get("inputs", ()):
            if "region" in t and self._regions.get(t["region"]) is None:
                return None
        for o in doc.get("outputs") or ():
            if "region" in o and self._regions.get(o["region"]) is None:
                return None
        return self._least_loaded(workers)

    def _least_loaded(self, workers: list[int]) -> int:
        if len(workers) == 1:
            return workers[0]
        return min(workers, key=self._load.__getitem__)

    def _direct_route(self, model: Any, version: str) -> list[int] | None:
        """The workers that take (model, version) on our lane per the routing table, or None
        (no lane, not served directly, or a split the broker's odds send elsewhere)."""
        if self.lane is None:
            return None
        gen = self.broker.routes.generation()
        if gen != self._routes_gen:
            gen, raw = self.broker.routes.read()
            routes = orjson.loads(raw) if raw else {}
            self._routes = routes.get("models", {})
            self._splits = routes.get("splits", {})
            self._routes_gen = gen
            live = {w for vs in self._routes.values() for e in vs.values() for w in e["workers"]}
            for num in [n for n in self._workers if n not in live]:
                self._workers.pop(num).close()  # a stopped worker's mapping would pin its memory
            self._route_cache.clear()
        asked = (model, version)
        workers: Any = self._route_cache.get(asked, _UNKNOWN)
        if workers is not _UNKNOWN:
            return workers
        if len(self._route_cache) >= ROUTE_CACHE_LIMIT:  # names a client made up must not pile up
            self._route_cache.clear()
        kept = True  # whether the route of the (model, version) asked for is kept
        if not version:
            split = self._splits.get(model)
            if split is None:
                workers = self._route_cache[asked] = None
                return workers
            # The broker's split (a canary's fraction), chosen here; a request that goes through
            # the broker instead is chosen there, with the same odds (drawn per request).
            kept = split["canary"] is None
            # (the table holds versions as numbers: the route cache keys them as text)
            version = str(split["canary"] if not kept and random.random() < split["fraction"] else split["stable"])
        key = (model, version)
        workers = self._route_cache.get(key, _UNKNOWN)
        if workers is _UNKNOWN:
            workers = self._route_cache[key] = self._direct_workers(*key)
        if kept:
            self._route_cache[asked] = workers
        return workers

    def _direct_workers(self, model: Any, version: str) -> list[int] | None:
        """The workers serving (model, version) on direct lanes per the routing table, or None;
        cached per routing-table generation (the lookup is per request otherwise)."""
        versions = self._routes.get(model)
        if not versions:
            return None
        v = versions.get(version)
        if not v or not v["ready"] or not v["direct"] or not v["workers"]:
            return None
        return list(v["workers"])

    def _worker(self, num: int) -> WorkerSegment | None:
        seg = self._workers.get(num)
        if seg is None:
            try:
                seg = WorkerSegment.attach(object_name(self.server_id, "worker", num))
            except (posix_ipc.ExistentialError, FileNotFoundError, ValueError):
                return None
            self._workers[num] = seg
        return seg

    # -- sending --------------------------------------------------------------------------------
    def submit(self, kind: int, doc: dict, tensors: Iterable[Any], callback: Callback, reserve: int = 0,
               on_response: Callback | None = None, waited: bool = False, polling: bool = False) -> int:
        """Write the request (descriptor then tensor bytes) into our arena and wake the broker.

        Tensor references in ``doc`` give ``data`` as offsets relative to where the tensor bytes
        start, in the order of ``tensors``; ``reserve`` more bytes follow them (room the server may
        write outputs into). Returns the absolute offset where the tensor bytes start. ``waited``
        says the caller will block in ``wait_for`` for this request (so it leads; no waiter thread
        needs waking); ``polling`` says the caller polls for the answer on its own (a loop-driven
        owner), so the worker may poll for the next request too.
        """
        if not self.alive:
            raise ServerUnavailable(f"the shmserve server '{self.server_id}' has gone away; reconnect")
        chunks = [t if isinstance(t, (bytes, bytearray)) else byte_view(t) if isinstance(t, np.ndarray)
                  else memoryview(t).cast("B") for t in tensors]
        body = sum(len(c) for c in chunks) + reserve
        if on_response is not None:
            # A streaming request: its response ring follows everything else, 64-byte aligned.
            doc["stream"] = (body + 63) & ~63
            body = doc["stream"] + Ring.nbytes(STREAM_CAPACITY, RECORD)
        if kind == REQ_INFER and "t" not in doc:
            doc["t"] = time.monotonic_ns()  # when the request arrived, for queue and request durations
        data = orjson.dumps(doc)
        return self._send(kind, data, chunks, body, callback, doc if kind == REQ_INFER else None, on_response,
                          doc.get("stream", 0), waited, polling)[0]

    def submit_prepared(self, prefix: bytes, route: dict | tuple[str, str], chunks: list, size: int,
                        callback: Callback, sent_ns: int, polling: bool = False, direct: bytes = b"") -> int:
        """``submit`` of an inference descriptor serialized before up to its send time
        (``prepared_prefix``) with the send time ``sent_ns``; ``route``: that descriptor (read
        only), or (model, version) if it names no region; ``chunks``: its tensors' bytes, ``size``
        in all. The HTTP frontend's repeated requests: nothing is copied or serialized.
        ``direct``: a trailer (``DIRECT_TRAILER`` last) that lets the worker write the answer to the
        HTTP client itself. Returns the request's slot."""
        if not self.alive:
            raise ServerUnavailable(f"the shmserve server '{self.server_id}' has gone away; reconnect")
        data = b"%b%d}" % (prefix, sent_ns)
        if direct:
            return self._send(REQ_INFER | REQ_DIRECT, data, [*chunks, direct], size + len(direct), callback, route,
                              None, 0, False, polling)[1]
        return self._send(REQ_INFER, data, chunks, size, callback, route, None, 0, False, polling)[1]

    def rerun(self, slot: int, tensors: bytes | memoryview, prefix_len: int, sent_ns: int, callback: Callback,
              route: dict | tuple[str, str]) -> int:
        """Send a request again in the slot and block of the last one, sent with a direct trailer
        and answered whole by its worker, which nobody has completed yet: the HTTP frontend's next
        request on a keep-alive connection, when its descriptor (``prefix_len`` bytes before the
        send time) and trailer are those in the block. ``tensors``: its tensor bytes, in the
        block's order. The last request is then over without a completion (no callback, no block
        freed, no slot taken). Returns when the worker wrote the last answer (its ``sent_at``), or
        -1 if the slot cannot be used so (nothing done: the caller goes the usual way)."""
        if not self.alive:
            return -1
        with self._lock:
            entry = self._callbacks[slot]
            if entry is None or self._state_words[slot * self._stride] != SLOT_DONE:
                return -1
            _, status, _, _, answer_off, _, _, sent, sent_at = self.seg.read_slot(slot)
            if status != 200 or sent != SENT_ALL or answer_off:
                return -1  # not answered whole by its worker: the completion has work to do
            off, total = entry[1], self._totals[slot]
            buf = self.seg.seg.buf
            start = rewrite_send_time(buf, off, prefix_len, sent_ns)
            if start < 0 or start + len(tensors) > off + total:
                return -1
            copy_into(buf[start:start + len(tensors)], tensors)
            self._untarget(slot)
            worker = self._hand(slot, REQ_INFER | REQ_DIRECT, off, total, start, callback, route, None, 0, False,
                                False)
        self._wake(worker, False)
        return sent_at

    def want_wake(self, slot: int) -> bool:
        """Ask to be woken when the direct answer in ``slot`` completes; False if it came
        meanwhile (then ``complete_ready`` completes it, and no wake-up is owed). True, asking
        nothing, if it was completed already."""
        if slot not in self._inflight:
            return True
        self._woken_slots.add(slot)
        self.seg.set_wake(slot, True)
        fence()  # the worker completes, fences, then reads the word: one of us sees the other
        return self._state_words[slot * self._stride] != SLOT_DONE

    def call_prepared(self, prefix: bytes, views: list, body: int, model: str, version: str
                      ) -> tuple[Completion, int]:
        """A synchronous call of a descriptor serialized before up to its send time
        (``prepared_prefix``): a client's repeated call, whose tensors are all copied into its arena
        (no region names). ``views``: the tensors' bytes. Returns the completion and the data start.

        When this thread may lead the waiting with nothing else in flight (a single-threaded
        caller), it polls its own slot's state and completes that slot alone: with several client
        processes on a core every step of this path runs cache-cold, so it takes few of them.
        Anything else (another request in flight, a long wait) goes the general way."""
        if not self.alive:
            raise ServerUnavailable(f"the shmserve server '{self.server_id}' has gone away; reconnect")
        data = b"%b%d}" % (prefix, time.monotonic_ns())
        answer = Answer()
        if self._inflight or self._waiter is None or not self._take_lead():
            start = self._send(REQ_INFER, data, views, body, answer, (model, version), None, 0, True, False)[0]
            self.wait_for(answer.done, answer.wait)
        else:
            try:
                start, slot = self._send(REQ_INFER, data, views, body, answer, (model, version), None, 0, True, False)
                self._poll_own(slot)
                if answer.completion is None:
                    self._lead_until(answer.done, poll=True)
            finally:
                self._leave_lead()
            if answer.completion is None:  # the connection closed under us: close() answers it
                answer.wait()
        assert answer.completion is not None
        return answer.completion, start

    def _poll_own(self, slot: int) -> None:
        """The leader's poll for its own answer while it is the only one in flight, within the
        spin budget; completes it when it came."""
        words, at, inflight = self._state_words, slot * self._stride, self._inflight
        if words[at] != SLOT_DONE:
            answered_or_joined = lambda: words[at] == SLOT_DONE or len(inflight) != 1  # noqa: E731
            if not self._spin.poll(answered_or_joined, time.perf_counter()) or words[at] != SLOT_DONE:
                return  # the wait is long, or another request joined: the general way
        self._complete(slot)

    @staticmethod
    def prepared_prefix(doc: dict) -> bytes:
        """A descriptor's bytes up to its send time, which comes last (workers key the checks
        they did on a descriptor by these bytes: workers/descriptors.py)."""
        return orjson.dumps(doc)[:-1] + b',"t":'

    def _send(self, kind: int, data: bytes, chunks: list, body: int, callback: Callback,
              route: dict | tuple[str, str] | None, on_response: Callback | None, stream_at: int, waited: bool,
              polling: bool) -> tuple[int, int]:
        """Place the descriptor and tensors in the arena and hand the request to a worker's lane
        or the broker's ring. ``route``: the descriptor to route by, or (model, version) of one
        without region names, or None for the broker. Returns (data start, slot)."""
        total = manifest_room(len(data)) + body
        with self._lock:
            if not self._free_slots:
                raise Backpressure("too many requests in flight on this connection")
            off = self._alloc(total)
            buf = self.seg.seg.buf
            pos = start = write_manifest(buf, off, data)
            for c in chunks:
                n = len(c)
                copy_into(buf[pos:pos + n], c)
                pos += n
            slot, worker = self._dispatch(kind, off, total, start, callback, route, on_response, stream_at,
                                          waited, polling)
        self._wake(worker, waited)
        return start, slot

    def _alloc(self, total: int) -> int:
        off = self.arena.alloc(total)  # type: ignore[union-attr]
        if off < 0:
            raise Backpressure(f"no room for a {total}-byte request in the shared-memory arena "
                               f"({self.arena.capacity} bytes); retry later")  # type: ignore[union-attr]
        return off

    def reserve(self, prefix: bytes, body: int, route: dict) -> Reservation:
        """Take a request block before its tensor bytes have all arrived (``send_reserved`` sends
        it, ``discard`` gives it back): the HTTP frontend copies a large body in as it comes.
        ``prefix``: the descriptor's bytes up to its send time (``prepared_prefix``)."""
        if not self.alive:
            raise ServerUnavailable(f"the shmserve server '{self.server_id}' has gone away; reconnect")
        doc_len = len(prefix) + SEND_TIME_DIGITS + 1
        room = manifest_room(doc_len)
        with self._lock:
            off = self._alloc(room + body)
        return Reservation(off, room + body, doc_len, prefix, route, self.seg.seg.buf[off + room:off + room + body])

    def send_reserved(self, r: Reservation, callback: Callback, polling: bool = False) -> None:
        """Send a reserved request whose tensor bytes are all in place; its send time is now."""
        if r.data is None:
            raise ValueError("this reservation was sent or discarded")
        if not self.alive:
            self.discard(r)
            raise ServerUnavailable(f"the shmserve server '{self.server_id}' has gone away; reconnect")
        data = b"%b%d}" % (r.prefix, time.monotonic_ns())
        if manifest_room(len(data)) != manifest_room(r.doc_len):
            # The tensors start where the reserved room ends: pad the document to that room
            # (whitespace after its opening brace, the same for every request of this shape).
            data = b"{" + b" " * (r.doc_len - len(data)) + data[1:]
        buf = self.seg.seg.buf
        r.data = None
        with self._lock:
            start = write_manifest(buf, r.off, data)
            _, worker = self._dispatch(REQ_INFER, r.off, r.total, start, callback, r.route, None, 0, False, polling)
        self._wake(worker, False)

    def discard(self, r: Reservation) -> None:
        """Give back a reserved block that will not be sent (a closed connection's arena is gone)."""
        if r.data is not None:
            r.data = None
            if not self._closed:
                free_block(self.seg.seg.buf, r.off)

    def _dispatch(self, kind: int, off: int, total: int, start: int, callback: Callback,
                  route: dict | tuple[str, str] | None, on_response: Callback | None, stream_at: int,
                  waited: bool, polling: bool) -> tuple[int, WorkerSegment | None]:
        """Hand a written request block to a worker's lane or the broker's ring, with ``_lock``
        held; ``_wake`` then wakes the receiver. Returns (slot, the worker, or None: the broker).
        Frees the block if the request cannot be taken (Backpressure)."""
        if not self._free_slots:
            free_block(self.seg.seg.buf, off)
            raise Backpressure("too many requests in flight on this connection")
        slot = self._free_slots.popleft()
        return slot, self._hand(slot, kind, off, total, start, callback, route, on_response, stream_at, waited,
                                polling)

    def _hand(self, slot: int, kind: int, off: int, total: int, start: int, callback: Callback,
              route: dict | tuple[str, str] | None, on_response: Callback | None, stream_at: int,
              waited: bool, polling: bool) -> WorkerSegment | None:
        """``_dispatch`` of a slot already taken; returns the worker (None: the broker)."""
        buf = self.seg.seg.buf
        self._callbacks[slot] = (callback, off)
        self._totals[slot] = total
        self._inflight.add(slot)
        if slot in self._woken_slots:  # raised by ``want_wake`` in the slot's last use
            self._woken_slots.discard(slot)
            self.seg.set_wake(slot, False)
        if on_response is not None:
            ring = Ring(buf, start + stream_at, STREAM_CAPACITY, RECORD)
            ring.reset()
            self._streams[slot] = (ring, on_response)
        if route is None:
            target = None
        elif type(route) is dict:
            target = self._route(route)
        else:
            workers = self._direct_route(*route)
            target = self._least_loaded(workers) if workers else None
        worker = self._worker(target) if target is not None else None
        # The target before the state: the broker reads a pending slot's target to answer
        # requests lost with a worker, and must never see one left from the slot's last use.
        self.seg.set_target(slot, target + 1 if worker is not None else 0)  # type: ignore[operator]
        self._state_words[slot * self._stride] = SLOT_PENDING
        if worker is not None:
            hint = REQ_POLLING if polling or (waited and self._spin.budget() > 0) else 0
            if worker.lanes[self.lane].put(kind | hint, slot, off, total, self._cookie):  # type: ignore[index]
                worker.ring_bell(self.lane)  # type: ignore[arg-type]
                self._targets[slot] = target + 1  # type: ignore[operator]
                self._load[target] += 1  # type: ignore[index]
            else:
                worker = None  # its lane is full: the broker will queue it
        if worker is None:
            self.seg.set_target(slot, 0)
        if worker is None and not self.seg.requests.put(kind & ~REQ_DIRECT, slot, off, total, 0):
            self.seg.set_slot_state(slot, SLOT_FREE)
            self._callbacks[slot] = None
            self._inflight.discard(slot)
            self._streams.pop(slot, None)
            self._free_slots.append(slot)
            free_block(buf, off)
            raise Backpressure("the request ring to the broker is full; retry later")
        return worker

    def _wake(self, worker: WorkerSegment | None, waited: bool) -> None:
        if worker is not None:
            worker.waker.notify()
        else:
            self.broker.waker.notify()
        if not waited and self._waiter is not None and not self._leading:
            with self._cond:
                self._cond.notify()  # the waiter thread leads for a request nobody waits for

    def infer(self, doc: dict, tensors: Iterable[Any], callback: Callback, reserve: int = 0,
              on_response: Callback | None = None, waited: bool = False) -> int:
        return self.submit(REQ_INFER, doc, tensors, callback, reserve, on_response, waited)

    def control(self, doc: dict, callback: Callback) -> None:
        self.submit(REQ_CONTROL, doc, (), callback)

    # -- receiving ------------------------------------------------------------------------------
    def _producer_buf(self, role: int, num: int) -> memoryview:
        """The mapping an answer lies in (kept per producer: the cache unmaps only at close)."""
        buf = self._producer_bufs.get((role, num))
        if buf is None:
            name = object_name(self.server_id, "broker", 0) if role == 0 else \
                object_name(self.server_id, ROLE_NAMES[role], num)
            buf = self._producer_bufs[(role, num)] = self._segments.get(name).buf
        return buf

    def _done_slots(self) -> list[int]:
        """Slots answered since we last looked; a plain scan of the few in flight is cheaper than
        numpy over the whole table until many are in flight."""
        inflight = self._inflight
        if len(inflight) < 64:
            words, stride = self._state_words, self._stride
            return [s for s in list(inflight) if words[s * stride] == SLOT_DONE]
        return np.flatnonzero(self._states == SLOT_DONE).tolist()

    def _has_done(self) -> bool:
        """Polled while waiting: anything answered, in the fewest steps for a few in flight."""
        if self._streams and any(ring.pending() for ring, _ in list(self._streams.values())):
            return True
        inflight = self._inflight
        if len(inflight) < 64:
            words, stride = self._state_words, self._stride
            for s in list(inflight):
                if words[s * stride] == SLOT_DONE:
                    return True
            return False
        return bool(self._done_slots())

    def _drain_stream(self, ring: Ring, on_response: Callback) -> int:
        records = ring.drain()
        for status, flags, off, length, num in records:
            try:
                completion = Completion(status, self._producer_buf(ROLE_WORKER, num), off)
            except (posix_ipc.ExistentialError, KeyError, OSError):
                continue
            try:
                on_response(completion)
            except Exception:  # noqa: BLE001
                log.exception("stream callback failed")
                completion.release()
        return len(records)

    def _complete_all(self) -> bool:
        """Run the callbacks of everything answered so far; True if there was anything."""
        # Streamed responses first: a request's final completion comes after all of them.
        streamed = 0
        for ring, on_response in list(self._streams.values()):
            streamed += self._drain_stream(ring, on_response)
        done = self._done_slots()
        for slot in done:
            stream = self._streams.pop(slot, None)
            if stream is not None:  # the worker filled the ring before it completed the slot
                self._drain_stream(*stream)
            self._complete(slot)
        return bool(streamed or done)

    # -- waiting (threaded connections) ----------------------------------------------------------
    # One thread at a time *leads*: it alone sleeps on the connection's semaphore, drains response
    # rings and completes slots, running every request's callback. A synchronous caller leads
    # while it waits for its own answer, so that answer costs no hand-off between threads; the
    # waiter thread leads only while requests are in flight that no caller waits for (futures,
    # streams, callbacks), or that a caller still waits for after the leader left.

    def _take_lead(self) -> bool:
        with self._cond:
            if self._leading:
                return False
            self._leading = True
            return True

    def _leave_lead(self) -> None:
        with self._cond:
            self._leading = False
            if self._inflight:  # somebody else's answers are still coming: the waiter takes over
                self._cond.notify()

    def _lead_until(self, finished: Callable[[], bool], poll: bool) -> None:
        """Complete answers as the leader until ``finished()`` holds or the connection ends;
        ``poll``: a caller waiting for its own answer, which may poll first (SpinPolicy)."""
        waker = self.seg.waker
        ready = lambda: self._has_done() or finished()  # noqa: E731
        spin = self._spin if poll else None
        checked = time.monotonic()
        while not finished() and not self._closed:
            waker.sleep(1.0, ready, spin)
            self._complete_all()
            if time.monotonic() - checked > 1.0:
                checked = time.monotonic()
                if not self.check_server():
                    return

    def _wait_loop(self) -> None:
        while not self._closed:
            with self._cond:
                while not self._closed and (self._leading or not self._inflight):
                    if not self._cond.wait(1.0) and not self._leading and not self.check_server():
                        return
                if self._closed:
                    return
                self._leading = True
            try:
                self._lead_until(lambda: not self._inflight, poll=False)
            finally:
                with self._cond:
                    self._leading = False

    def wait_for(self, done: Callable[[], bool], block: Callable[[], Any]) -> None:
        """A synchronous caller's wait for its own request: lead if nobody does (its answer then
        arrives on this thread, polled for a moment first while answers come quickly), else
        ``block()`` until the leader delivers it."""
        if done():
            return
        if self._waiter is None or not self._take_lead():
            block()
            return
        try:
            self._lead_until(done, poll=True)
        finally:
            self._leave_lead()
        if not done():  # the connection closed under us: close() answers what was in flight
            block()

    def fileno(self) -> int:
        """The FIFO a loop-driven owner watches (``loop.add_reader``)."""
        assert self.seg.fifo_fd is not None, "not a loop-driven connection"
        return self.seg.fifo_fd

    def on_readable(self, arm: bool = True) -> None:
        """Loop-driven owners call this when the FIFO is readable: runs the ready callbacks, then
        (``arm``) declares the owner asleep so that producers wake it for the next answer."""
        read_all(self.fileno())
        while True:
            self._complete_all()
            if not arm or not self.seg.waker.arm(self._has_done):
                return

    # -- polling (loop-driven owners) ------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def stay_awake(self) -> None:
        """The owner polls from now on (``complete_ready``): producers need not wake it."""
        self.seg.waker.flag[0] = AWAKE

    def complete_ready(self) -> bool:
        """Run the callbacks of the requests answered so far; True if there were any. (The owner
        stops polling with ``on_readable()``: it completes what slipped in, then arms.)"""
        return self._complete_all()

    def check_server(self) -> bool:
        """False (and every pending request failed) if the broker died or was replaced."""
        if self.alive and pid_alive(self.broker_pid) and self.broker.started_ns == self._broker_started():
            return True
        if self.alive:
            self._server_gone()
        return False

    def _broker_started(self) -> int:
        try:
            seg = BrokerSegment.attach(self.server_id)
        except (posix_ipc.ExistentialError, ConnectionError):
            return -1
        try:
            return seg.started_ns
        finally:
            seg.close()

    def _complete(self, slot: int) -> None:
        with self._lock:
            entry = self._callbacks[slot]
            if entry is None or self._state_words[slot * self._stride] != SLOT_DONE:
                return  # already completed (by a caller's own poll), or failed with the server
            _, status, role, num, off, _, _, sent, sent_at = self.seg.read_slot(slot)
            self._callbacks[slot] = None
            self._inflight.discard(slot)
            self._untarget(slot)
            self._state_words[slot * self._stride] = SLOT_FREE
            self._free_slots.append(slot)
        callback, req_off = entry
        request = (self.seg.seg.buf, req_off)
        try:
            if off:
                completion = Completion(status, self._producer_buf(role, num), off, request=request, sent=sent,
                                        sent_at=sent_at)
            elif sent == SENT_ALL:  # no block: a direct answer its worker sent whole (0 is never a block's offset)
                completion = Completion(status, None, 0, request=request, sent=sent, sent_at=sent_at)
            else:  # no block: its producer had no room for one, not even for an error
                completion = Completion(status, None, 0, {"error": NO_ROOM}, request=request, sent=sent)
        except (posix_ipc.ExistentialError, KeyError, OSError):
            completion = Completion(500, None, 0, {"error": "the response was lost: its producer is gone"},
                                    request=request, sent=sent, sent_at=sent_at)
        try:
            callback(completion)
        except Exception:  # noqa: BLE001 - a faulty callback must not kill the waiter thread
            log.exception("completion callback failed")
            completion.release()

    def _untarget(self, slot: int) -> None:
        """The slot's request is over: its worker has one of ours fewer in flight (``_lock`` held)."""
        target = self._targets[slot]
        if target:
            self._targets[slot] = 0
            self._load[target - 1] -= 1

    def _server_gone(self) -> None:
        self.alive = False
        # What was answered is answered (a worker may have written it to its HTTP client already:
        # a failure written behind it would answer the client's next request).
        self._complete_all()
        self._fail_all(f"the shmserve server '{self.server_id}' went away while the request was in flight")

    def _fail_all(self, msg: str) -> None:
        """Answer every request still in flight with a 503 carrying ``msg``."""
        with self._lock:
            pending = [(i, e) for i, e in enumerate(self._callbacks) if e is not None]
            for i, _ in pending:
                self._callbacks[i] = None
            self._inflight.clear()
            self._streams.clear()
        for _, (callback, req_off) in pending:
            try:
                callback(Completion(503, None, 0, {"error": msg}, request=(self.seg.seg.buf, req_off)))
            except Exception:  # noqa: BLE001
                log.exception("completion callback failed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Names first: once the broker hears BYE, workers drop what no longer has a name.
        self.seg.unlink()
        if self.alive and pid_alive(self.broker_pid):
            try:
                self.seg.requests.put(REQ_BYE, 0, 0, 0, 0)
                self.broker.waker.notify()
            except posix_ipc.Error:
                pass
        if self._waiter is not None:
            with self._cond:
                self._cond.notify_all()
            self.seg.waker.post()  # wake the leader so it sees _closed
            self._waiter.join(timeout=2.0)
        # Nothing will answer what is still in flight on this connection: say so, do not hang.
        self._fail_all("the connection was closed while the request was in flight")
        for seg in self._workers.values():
            seg.close()
        self._workers.clear()
        self._producer_bufs.clear()
        self._segments.clear()
        self.broker.close()
        self.seg.close()

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
