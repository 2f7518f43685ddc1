"""The low-level channel from one process to the broker, shared by the HTTP frontend and the
local client library.

A connection owns a client segment: a request ring the broker drains, a table of completion slots
that workers and the broker fill, and an arena for request descriptors and input tensors. An
inference request goes straight onto a worker's lane when the routing table allows it
(shm/routes.py), else onto the request ring for the broker; either way its answer comes back in
its slot.

Completions reach the callback given at submit time in one of two ways:
- threaded (default): one thread at a time *leads* the waiting (see "waiting" below) and runs
  the callbacks;
- loop-driven (``loop_driven=True``, the HTTP frontend): producers wake a FIFO the owner's event
  loop watches, and the owner calls ``on_readable`` there; callbacks run on the loop itself, with
  no thread hop.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable, Iterable

import numpy as np
import posix_ipc

from .access import others
from .arena import free_block
from .channel import (DEFAULT_SLOTS, LANE_PENDING, LANE_REFUSED, NO_LANE, BrokerSegment, ClientSegment, NotTheServers,
                      OtherLayout, WorkerSegment)
from .completion import Callback
from .control_messages import ControlMessage
from .copying import copy_into
from .descriptor import InferRequest, stamp_sent
from .liveness import BROKER_TICKET, NoTicket, Tickets, process_ticket
from .names import SHM_DIR, check_server_id, object_name
from .protocol import RECORD, REQ_BYE, REQ_CANCEL, REQ_CONTROL, REQ_INFER, REQ_POLLING, STREAM_CAPACITY, \
    manifest_room, write_manifest
from .ring import Ring
from .routes import Router
from .slots import Slots
from .tensors import byte_view
from .truncation_guard import restore as restore_guarded
from .waker import AWAKE, SpinPolicy, read_all

log = logging.getLogger("shmserve.client")

_counter = itertools.count()
# How long a synchronous caller polls for its answer before it sleeps (microseconds), unless the
# owner says otherwise (``Client(poll_us=...)``); its requests then ask the worker to poll too.
DEFAULT_POLL_US = 2000


class ServerUnavailable(ConnectionError):
    """No server with that id is running, or it went away; a new Connection may succeed later."""


class NoServer(ServerUnavailable):
    """No server with that id runs on this host at all (no broker file, or none alive)."""


class ConnectionClosed(ValueError):
    """A call on a client (connection) its owner closed: as a closed file's, a programming error
    that no retry mends."""


CLOSED_IN_FLIGHT = "the connection was closed while the request was in flight"
CLOSE_SETTLE_S = 1.0  # the most a close waits for its requests in flight to end (cancelled)


class Backpressure(RuntimeError):
    """The connection is out of slots or arena space right now; retrying later can succeed."""


class SlotsTaken(Backpressure):
    """Every slot of the connection holds a request in flight (``slots``, ``Connection(slots=)``)."""

    def __init__(self, slots: int) -> None:
        super().__init__(f"too many requests in flight on this connection ({slots})")
        self.slots = slots


class ArenaBusy(Backpressure):
    """The arena has the room by volume (at most half of it in use) but not in one piece ahead of
    its oldest outstanding block: that block comes back within moments, so a caller that can wait
    a little should, rather than refuse (a full arena is overload, and refused at once)."""


class RequestTooLarge(ValueError):
    """A request larger than the whole arena: no retry can send it (``Client(arena_bytes=)``,
    a frontend's ``--frontend-arena-mb``, set the arena)."""


class Reservation:
    """A request block taken before its tensor bytes have all arrived (``Connection.reserve``)."""

    __slots__ = ("off", "start", "total", "request", "data")

    def __init__(self, off: int, start: int, total: int, request: InferRequest, data: memoryview) -> None:
        self.off = off
        self.start = start  # where its tensor bytes start
        self.total = total
        self.request = request  # written in the block already; its send time is stamped when sent
        self.data: memoryview | None = data  # where the tensor bytes go; None once sent or discarded


class Connection:
    def __init__(self, server_id: str = "shmserve", arena_bytes: int = 64 << 20, slots: int = DEFAULT_SLOTS,
                 loop_driven: bool = False, poll_us: int = DEFAULT_POLL_US) -> None:
        self.server_id = check_server_id(server_id)
        try:
            self.broker = BrokerSegment.attach(server_id)
        except OtherLayout as e:
            raise ServerUnavailable(f"the shmserve server '{server_id}' runs another version: {e}") from None
        except NotTheServers as e:
            raise ServerUnavailable(f"the shmserve server '{server_id}' cannot be reached: {e}") from None
        except (posix_ipc.ExistentialError, ConnectionError, FileNotFoundError):
            raise NoServer(f"no shmserve server with id '{server_id}' is running on this host") from None
        except (posix_ipc.PermissionsError, PermissionError):
            raise ServerUnavailable(f"the shmserve server '{server_id}' runs as another user: this process (uid "
                                    f"{os.geteuid()}) may not open its shared memory; run the client as the "
                                    f"server's user, or start the server with --local-client-users={os.geteuid()} "
                                    f"(docs/deploy.md)") from None
        # The server's user must open what we create when it is not ours (shm/access.py).
        self.readers = others((self.broker.seg.uid,))
        # Liveness both ways by tickets, not pids: we may be in another PID namespace (another
        # container of the pod) than the server (shm/liveness.py).
        try:
            self._tickets, self.ticket = process_ticket(server_id)
        except OSError:
            self.broker.close()
            raise NoServer(f"no shmserve server with id '{server_id}' is running on this host") from None
        except NoTicket as e:  # (a process of a user that may write broker.0 locked its free bytes)
            self.broker.close()
            raise ServerUnavailable(f"the shmserve server '{server_id}' could not be connected to: no liveness "
                                    f"ticket could be taken ({e})") from None
        if not self._broker_alive():
            self.broker.close()
            raise ServerUnavailable(f"the shmserve server with id '{server_id}' is not running (stale objects)")
        self.name, self.seg = self._create_segment(arena_bytes, slots, loop_driven)
        self._seg_inode = os.stat(SHM_DIR + self.name).st_ino
        self.arena = self.seg.arena
        assert self.arena is not None
        self._cond = threading.Condition()  # guards _leading (see "waiting" below)
        self._leading = False
        self._spin = SpinPolicy(poll_us / 1e6)
        self._closed = False
        self._forked = False  # set in a child process that inherited this connection (``_after_fork``)
        self.alive = True
        _connections.add(self)
        try:
            self.broker.announce(self.ticket, self.name)
        except ConnectionError:  # (nobody took our segment: it is ours to remove)
            self.seg.close()
            self.seg.unlink()
            self.broker.close()
            raise
        self.lane = self._await_lane()
        self._router = Router(self.server_id, self.broker, self.lane)
        self._slots = Slots(self.server_id, self.seg, self._router)
        self._cookie = self.seg.cookie
        self._lost: set[int] = set()  # slots whose lane record seemed lost at the last check
        self._waiter: threading.Thread | None = None
        if not loop_driven:
            self._waiter = threading.Thread(target=self._wait_loop, name=f"shmserve-completions-{self.name}",
                                            daemon=True)
            self._waiter.start()

    def _create_segment(self, arena_bytes: int, slots: int, fifo: bool) -> tuple[str, ClientSegment]:
        """Our segment, ``client.<ticket>-<k>``: a name no live client has (the ticket is ours);
        one a dead holder of the same ticket left behind is passed over."""
        while True:
            name = object_name(self.server_id, "client", f"{self.ticket}-{next(_counter)}")
            try:
                return name, ClientSegment.create(name, arena_bytes, self.ticket, slots, fifo=fifo,
                                                  readers=self.readers)
            except posix_ipc.ExistentialError:
                continue

    def _broker_alive(self) -> bool:
        """Whether the broker we attached still holds its ticket (not: its pid lives, which we
        may not see)."""
        tickets: Tickets = self._tickets
        return tickets.fd >= 0 and tickets.held(BROKER_TICKET)

    def _await_lane(self, timeout: float = 10.0) -> int | None:
        """Wait until the broker has taken our connect record (and given us a lane, if one is free)."""
        deadline = time.monotonic() + timeout
        delay = 0.0001
        while self.seg.lane == LANE_PENDING:
            if time.monotonic() > deadline or not self._broker_alive():
                self.seg.close()
                self.seg.unlink()
                raise ServerUnavailable(f"the shmserve server '{self.server_id}' did not accept the connection")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
        lane = self.seg.lane
        if lane == LANE_REFUSED:  # (a bound on what one user's clients hold: the server's log says)
            self.seg.close()
            self.seg.unlink()
            raise ServerUnavailable(f"the shmserve server '{self.server_id}' refused the connection (its log says why)")
        return None if lane == NO_LANE else lane

    # -- sending --------------------------------------------------------------------------------
    def submit(self, kind: int, doc: InferRequest | ControlMessage, tensors: Iterable[Any], callback: Callback,
               reserve: int = 0, on_response: Callback | None = None, waited: bool = False,
               polling: bool = False) -> int:
        """Write the request (descriptor then tensor bytes) into our arena and hand it to a worker
        or the broker; ``callback`` gets its completion.

        ``doc``: an inference request (REQ_INFER), or a control message (REQ_CONTROL). An
        inference request's tensors in the block give ``data`` as offsets relative to where the
        tensor bytes start, in the order of ``tensors``; ``reserve`` more bytes follow them (room
        the server may write outputs into). Returns the absolute offset where the tensor bytes
        start. ``waited`` says the caller will block in ``wait_for`` for this request (so it
        leads; no waiter thread needs waking); ``polling`` says the caller polls for the answer on
        its own (a loop-driven owner), so the worker may poll for the next request too.
        """
        self._check_open()
        chunks = [t if isinstance(t, (bytes, bytearray)) else byte_view(t) if isinstance(t, np.ndarray)
                  else memoryview(t).cast("B") for t in tensors]
        body = sum(len(c) for c in chunks) + reserve
        stream_at = 0
        request = doc if isinstance(doc, InferRequest) else None
        if request is not None:
            if on_response is not None:
                # A streaming request: its response ring follows everything else, 64-byte aligned.
                stream_at = request.stream = (body + 63) & ~63
                body = stream_at + Ring.nbytes(STREAM_CAPACITY, RECORD)
            if not request.sent_ns:
                request.sent_ns = time.monotonic_ns()  # when it arrived, for queue and request durations
            data = request.encode()
        else:
            data = doc.encode()
        total = manifest_room(len(data)) + body
        with self._slots.lock:
            self._check_open()  # (under the lock: ``close`` fails what was sent before it, nothing after)
            off = self._alloc(total)
            buf = self.seg.seg.buf
            pos = start = write_manifest(buf, off, data)
            for c in chunks:
                n = len(c)
                copy_into(buf[pos:pos + n], c)
                pos += n
            hint = REQ_POLLING if polling or (waited and self._spin.budget() > 0) else 0
            worker = self._dispatch(kind | hint, off, total, start, callback, request, on_response, stream_at)
        self._wake(worker, waited)
        return start

    def _check_open(self) -> None:
        if self._closed:
            if self._forked:
                raise ConnectionClosed("this client was made before fork(): its shared memory, slots and threads "
                                       "are the parent process's; make a new Client in this process")
            raise ConnectionClosed("this client is closed: connect a new one")
        if not self.alive:
            raise ServerUnavailable(f"the shmserve server '{self.server_id}' has gone away; reconnect")

    def infer(self, request: InferRequest, tensors: Iterable[Any], callback: Callback, reserve: int = 0,
              on_response: Callback | None = None, waited: bool = False) -> int:
        return self.submit(REQ_INFER, request, tensors, callback, reserve, on_response, waited)

    def control(self, message: ControlMessage, callback: Callback) -> None:
        self.submit(REQ_CONTROL, message, (), callback)

    def reserve(self, request: InferRequest, body: int) -> Reservation:
        """Take a request block before its tensor bytes have all arrived (``send_reserved`` sends
        it, ``discard`` gives it back): the HTTP frontend copies a large body in as it comes.
        The descriptor is written now; its send time is set when it is sent."""
        self._check_open()
        data = request.encode()
        room = manifest_room(len(data))
        with self._slots.lock:
            self._check_open()
            off = self._alloc(room + body)
            write_manifest(self.seg.seg.buf, off, data)
        return Reservation(off, off + room, room + body, request, self.seg.seg.buf[off + room:off + room + body])

    def send_reserved(self, r: Reservation, callback: Callback, polling: bool = False) -> int:
        """Send a reserved request whose tensor bytes are all in place; its send time is now.
        Returns where its tensor bytes start (as ``submit``)."""
        if r.data is None:
            raise ValueError("this reservation was sent or discarded")
        if not self.alive:
            self.discard(r)
            raise ServerUnavailable(f"the shmserve server '{self.server_id}' has gone away; reconnect")
        r.request.sent_ns = time.monotonic_ns()
        r.data = None
        start = r.start
        with self._slots.lock:
            self._check_open()  # closed since it was reserved: the block went with the arena
            stamp_sent(self.seg.seg.buf, r.off + 4, r.request.sent_ns)  # (past the manifest's length prefix)
            worker = self._dispatch(REQ_INFER | (REQ_POLLING if polling else 0), r.off, r.total, start, callback,
                                    r.request, None, 0)
        self._wake(worker, False)
        return start

    def discard(self, r: Reservation) -> None:
        """Give back a reserved block that will not be sent (a closed connection's arena is gone)."""
        if r.data is not None:
            r.data = None
            if not self._closed:
                free_block(self.seg.seg.buf, r.off)

    def _alloc(self, total: int) -> int:
        arena = self.arena
        off = arena.alloc(total)  # type: ignore[union-attr]
        if off < 0 and not arena.could_ever_hold(total):  # type: ignore[union-attr]
            raise RequestTooLarge(f"a {total}-byte request cannot fit this connection's shared-memory arena "
                                  f"({arena.capacity} bytes), now or later")  # type: ignore[union-attr]
        if off < 0:
            if arena.starved:  # type: ignore[union-attr]
                raise Backpressure(f"no room for a {total}-byte request: /dev/shm is full (the client could not "
                                   f"take a page of its arena); retry later")
            busy = arena.live_bytes() + total <= arena.capacity // 2  # type: ignore[union-attr]
            raise (ArenaBusy if busy else Backpressure)(
                f"no room for a {total}-byte request in the shared-memory arena ({arena.capacity} bytes); "  # type: ignore[union-attr]
                f"retry later")
        return off

    def _dispatch(self, kind: int, off: int, total: int, start: int, callback: Callback, route: InferRequest | None,
                  on_response: Callback | None, stream_at: int) -> WorkerSegment | None:
        """Hand a written request block to a worker's lane (``route``: the inference descriptor to
        route by) or the broker's ring, with the slots' lock held; ``_wake`` then wakes the
        receiver. ``kind`` may carry REQ_POLLING, which only a worker reads. Returns the worker,
        or None: the broker. Frees the block if the request cannot be taken (Backpressure)."""
        slots = self._slots
        slot = slots.take(callback, off, start, (start + stream_at, on_response) if on_response is not None else None)
        if slot < 0:
            free_block(self.seg.seg.buf, off)
            raise SlotsTaken(self.seg.nslots)
        picked = self._router.pick(route) if route is not None else None
        lane = picked[1].lanes[self.lane] if picked is not None else None  # type: ignore[index]
        if lane is not None and lane.has_room():
            num, worker = picked  # type: ignore[misc]
            # Bound and sent to that worker for good: the worker runs only a record its slot is
            # bound to, once, and a request bound to a lane never goes through the broker too.
            self.seg.bind(slot, off, total)
            slots.target(slot, num)
            if lane.put(kind, slot, off, total, self._cookie):
                worker.ring_bell(self.lane)  # type: ignore[arg-type]
            # (else a process of our user changed the lane's counters since: _put_lost_again puts it again)
            slots.went_to(slot, num)
            return worker
        self.seg.unbind(slot)  # (when the worker's lane is full too: the broker will queue it)
        slots.target(slot, None)
        if not self.seg.requests.put(kind & ~REQ_POLLING, slot, off, total, 0):
            slots.give_back(slot)
            free_block(self.seg.seg.buf, off)
            raise Backpressure("the request ring to the broker is full; retry later")
        return None

    def cancel(self, start: int) -> bool:
        """Give up on the request whose tensor bytes start at ``start`` (what ``submit`` returned):
        its slot's cancelled word is set, which its worker's model reads (``is_cancelled``) and
        which makes a worker answer it at once instead of running it; one still queued in the
        broker is dropped there (a ``REQ_CANCEL`` record). The request is still answered (with
        Triton's cancelled error if it never ran), and its callback must release that answer as
        usual: only then are its block and its slot free, once no process reads them any more.
        False if it was answered already."""
        if not self.alive or self._closed:
            return False
        with self._slots.lock:
            slot = self._slots.find_start(start)
            if slot < 0:
                return False
            self.seg.cancel(slot)
            to_broker = self.seg.target(slot) == 0
            if to_broker:
                to_broker = self.seg.requests.put(REQ_CANCEL, slot, 0, 0, 0)  # full ring: the flag still holds
        if to_broker:
            self.broker.waker.notify()
        return True

    def _wake(self, worker: WorkerSegment | None, waited: bool) -> None:
        if worker is not None:
            worker.waker.notify()
        else:
            self.broker.waker.notify()
        if not waited and self._waiter is not None and not self._leading:
            with self._cond:
                self._cond.notify()  # the waiter thread leads for a request nobody waits for

    # -- waiting (threaded connections) ----------------------------------------------------------
    # One thread at a time *leads*: it alone sleeps on the connection's flag (waker.py), drains response
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
            if self._slots.inflight:  # somebody else's answers are still coming: the waiter takes over
                self._cond.notify()

    def _lead_until(self, finished: Callable[[], bool], poll: bool) -> None:
        """Complete answers as the leader until ``finished()`` holds or the connection ends;
        ``poll``: a caller waiting for its own answer, which may poll first (SpinPolicy)."""
        waker = self.seg.waker
        ready = lambda: self._slots.has_done() or finished()  # noqa: E731
        spin = self._spin if poll else None
        checked = time.monotonic()
        while not finished() and not self._closed:
            waker.sleep(1.0, ready, spin)
            self._slots.complete_all()
            if time.monotonic() - checked > 1.0:
                checked = time.monotonic()
                if not self.check_server():
                    return

    def _wait_loop(self) -> None:
        while not self._closed:
            with self._cond:
                while not self._closed and (self._leading or not self._slots.inflight):
                    if not self._cond.wait(1.0) and not self._leading and not self.check_server():
                        return
                if self._closed:
                    return
                self._leading = True
            try:
                self._lead_until(lambda: not self._slots.inflight, poll=False)
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
            self._slots.complete_all()
            if not arm or not self.seg.waker.arm(self._slots.has_done):
                return

    # -- polling (loop-driven owners) ------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self._slots.inflight)

    def stay_awake(self) -> None:
        """The owner polls from now on (``complete_ready``): producers need not wake it."""
        self.seg.waker.flag[0] = AWAKE

    def complete_ready(self) -> bool:
        """Run the callbacks of the requests answered so far; True if there were any. (The owner
        stops polling with ``on_readable()``: it completes what slipped in, then arms.)"""
        return self._slots.complete_all()

    def check_server(self) -> bool:
        """False (and every pending request failed) if the broker died or was replaced, or it
        disconnected us for what this process wrote into shared memory (see the server's log)."""
        if self.alive and self.seg.disconnected():
            self._server_gone(f"the shmserve server '{self.server_id}' disconnected this client: it found "
                              f"garbage in the client's shared memory (the server's log says what)")
            return False
        if self.alive and self._broker_alive() and self.broker.started_ns == self._broker_started():
            if not self._segment_named():
                # (the broker unlinks a client it disconnects; one whose segment was truncated never
                # sees the refusal written into it, nor any answer: it waited for good)
                self._server_gone(f"the shmserve server '{self.server_id}' disconnected this client, or another "
                                  f"process removed its shared memory: its segment {self.name} is gone")
                return False
            self._slots.forget_gone_producers()  # once a second or so, with the other checks
            restore_guarded()  # a page replaced for want of room is the object's again (truncation_guard.py)
            self._put_lost_again()
            return True
        if self.alive:
            self._server_gone()
        return False

    def _segment_named(self) -> bool:
        """Whether our segment's name still names it."""
        try:
            return os.stat(SHM_DIR + self.name).st_ino == self._seg_inode
        except OSError:
            return False

    def _put_lost_again(self) -> None:
        """Put again the lane record of each direct request that its worker has not taken, at two
        checks in a row, while that lane stood empty: the record was lost (another process of
        our user may write our lanes: zero their counters, truncate the object they lie in), and
        its caller would wait for good. A worker runs a record once however often it is put
        (``ClientSegment.take_bound``), so a request that was only slow costs nothing more."""
        if self.lane is None:
            return
        suspects, self._lost = self._lost, set()
        woken: dict[int, WorkerSegment] = {}
        with self._slots.lock:
            for slot, num in self._slots.untaken():
                worker = self._router.mapped(num)
                lane = worker.lanes[self.lane] if worker is not None else None
                if lane is None or lane.pending() != 0:
                    continue  # (not empty: the worker is busy, and will take it)
                if slot not in suspects:
                    self._lost.add(slot)
                    continue
                off, total = self.seg.bound(slot)
                if lane.put(REQ_INFER, slot, off, total, self._cookie):
                    worker.ring_bell(self.lane)
                    woken[num] = worker
        for worker in woken.values():
            worker.waker.notify()
        if woken:
            log.warning("%s: put again the lane records of requests their worker never took (another process of "
                        "this user may write its lanes)", self.name)

    def _broker_started(self) -> int:
        try:
            return BrokerSegment.started_ns_of(self.server_id)
        except (posix_ipc.ExistentialError, ConnectionError, ValueError):
            return -1

    def _server_gone(self, why: str = "") -> None:
        self.alive = False
        self._slots.complete_all()  # what was answered is answered
        self._slots.fail_all(why or f"the shmserve server '{self.server_id}' went away while the request was in flight")

    def close(self) -> None:
        if self._forked:
            return  # the parent's: nothing of it is this process's to end
        with self._slots.lock:  # (a request is sent before this, and answered below, or refused: ``submit``)
            if self._closed:
                return
            self._closed = True
            self._slots.cancel_all(CLOSED_IN_FLIGHT)
            # those the broker holds (queued, an ensemble's run) are dropped there, as by ``cancel``
            told = [self.seg.requests.put(REQ_CANCEL, slot, 0, 0, 0) for slot in list(self._slots.inflight)
                    if self.seg.target(slot) == 0] if self.alive else []
        if any(told):
            self.broker.waker.notify()
        self._settle_in_flight()
        # Names first: once the broker hears BYE, workers drop what no longer has a name.
        self.seg.unlink()
        if self.alive and self._broker_alive():
            try:
                self.seg.requests.put(REQ_BYE, 0, 0, 0, 0)
                self.broker.waker.notify()
            except posix_ipc.Error:
                pass
        if self._waiter is not None:
            with self._cond:
                self._cond.notify_all()
            self.seg.waker.post()  # wake the leader so it sees _closed
            if self._waiter is not threading.current_thread():  # (closed from a callback it runs: it ends itself)
                self._waiter.join(timeout=2.0)
        # What streams hold unread lies in their workers' arenas, which nobody else frees while
        # this process lives; nothing will answer what is still in flight: say so, do not hang.
        self._slots.drop_streams()
        self._slots.fail_all(CLOSED_IN_FLIGHT)
        self._router.close()
        self._slots.close()
        self.broker.close()
        self.seg.close()

    def _settle_in_flight(self) -> None:
        """Let the requests in flight at a close end (cancelled: their workers drop what they
        would still send) for up to ``CLOSE_SETTLE_S``, freeing each answer unread: an answer
        written after we stopped reading would lie in its worker's arena until this process
        exits. A model that ignores cancellation past that is left to it."""
        deadline = time.monotonic() + CLOSE_SETTLE_S
        while self._slots.inflight and self.alive and time.monotonic() < deadline:
            self._slots.complete_all()
            if self._slots.inflight:
                time.sleep(0.001)

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_connections: "weakref.WeakSet[Connection]" = weakref.WeakSet()


def _after_fork() -> None:
    """In a child of fork(): every inherited connection is the parent's (its slots, its waiter
    thread, its segment, which the parent keeps using): calls on it are refused by name rather
    than mixing the two processes' requests."""
    for conn in list(_connections):
        conn._forked = conn._closed = True


os.register_at_fork(after_in_child=_after_fork)
