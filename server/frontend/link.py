"""The frontend's way to the broker: a loop-driven shm ``Connection`` on the asyncio loop.

Producers wake the frontend through a FIFO the loop watches with ``add_reader``, so completions
run on the loop itself: no waiter thread, no ``call_soon_threadsafe`` hop. A timer checks once a
second that the broker lives; if it restarts, the next request opens a fresh connection and
requests in flight get a 503 instead of hanging.

While requests are in flight and answers keep coming (one within ``SHMSERVE_FRONTEND_SPIN_US``
of the last submission or answer), the loop *polls* for answers instead of sleeping: a callback
that completes what is done, yields the CPU and schedules itself again, so sockets are still
served between polls (uvloop then checks them without blocking). After the last answer it goes on
for ``SHMSERVE_FRONTEND_IDLE_SPIN_US`` with nothing in flight: a client in a closed loop sends its
next request within that time, and the loop sees it without a wake-up from epoll (on a VM an idle
vCPU's wake-up costs tens of microseconds of latency). Producers then see the frontend awake and
skip the FIFO write (about 30 us of a worker's time on a VM), and the answer costs no wake-up of
the loop. Its requests ask the
worker to poll for the next one as well (``REQ_POLLING``, within the worker's own limit), so
requests that follow closely cross no sleep between our processes in either direction.

Polling pays only when the answer comes soon. The loop keeps a running average of how long each
model's answers take; a request to a model whose answers take longer than
``SHMSERVE_FRONTEND_POLL_WAIT_US`` (a batching model under load, a slow model) neither starts nor
prolongs the polling, and is not sent with the worker's polling hint: the worker wakes the loop
once per round instead, and the CPU the polling would burn stays with the worker and the clients.
With ``SHMSERVE_FRONTEND_CORE_CHECK=1`` (off by default: it costs batching models their rate) the
loop does not poll either while, on average, other tasks want every core (``shm.cores``): its
spins would be taken from them, clients of this host among them.
"""
from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Callable


from shmserve.shm.channel import DEFAULT_SLOTS
from shmserve.shm.cores import CoreCheck
from shmserve.shm.peer_fds import allow_tracing_by
from shmserve.shm.connection import Backpressure, Completion, Connection, Reservation, ServerUnavailable
from shmserve.shm.protocol import REQ_CONTROL, REQ_INFER

LIVENESS_CHECK_S = 1.0
POLL_S = float(os.environ.get("SHMSERVE_FRONTEND_SPIN_US", "200")) / 1e6
# With nothing in flight after an answer: how long the loop stays hot for the client's next request.
IDLE_POLL_S = float(os.environ.get("SHMSERVE_FRONTEND_IDLE_SPIN_US", "500")) / 1e6
# Requests to a model whose answers take longer than this on average are waited for asleep.
POLL_WAIT_S = float(os.environ.get("SHMSERVE_FRONTEND_POLL_WAIT_US", "1000")) / 1e6


class BrokerError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _broker_error(e: Exception) -> BrokerError:
    if isinstance(e, Backpressure):
        return BrokerError(503, f"the server is overloaded ({e}); retry later")
    return BrokerError(503, str(e))


class BrokerLink:
    def __init__(self, server_id: str, arena_bytes: int, max_inflight: int = DEFAULT_SLOTS) -> None:
        self.server_id = server_id
        self.arena_bytes = arena_bytes
        self.max_inflight = max_inflight  # requests in flight on the channel; past it: 503
        self._conn: Connection | None = None
        # (untyped: uvloop's remove_reader may answer None where asyncio's stub says bool, and the
        # compiled module checks what a typed call returns)
        self._loop: Any = None
        self._timer: asyncio.TimerHandle | None = None
        self._polling = False
        self._progress = 0.0  # perf_counter of the last submission or answer while polling
        self._answer_s: dict[str, float] = {}  # per model: running average of its answer times
        self._polled_in_flight = 0  # requests in flight whose answers are polled for
        self._cores = CoreCheck()  # no polling while others want every core

    def connection(self) -> Connection:
        conn = self._conn
        if conn is not None and conn.alive:
            return conn
        self._drop()
        loop = asyncio.get_running_loop()
        try:
            conn = Connection(self.server_id, arena_bytes=self.arena_bytes, slots=self.max_inflight, loop_driven=True)
        except ServerUnavailable as e:
            raise BrokerError(503, f"the server is not available: {e}") from None
        loop.add_reader(conn.fileno(), self._on_readable)
        allow_tracing_by(conn.broker_pid)  # its workers borrow our clients' sockets for direct answers
        self._conn, self._loop = conn, loop
        self._timer = loop.call_later(LIVENESS_CHECK_S, self._check)
        return conn

    def current(self) -> Connection | None:
        """The connection requests went out on last (None before the first, or after a loss)."""
        return self._conn

    def _on_readable(self) -> None:
        conn = self._conn
        if conn is not None:
            conn.on_readable(arm=not self._polling)  # a poller stays awake: no wake-ups wanted

    def _poll(self) -> None:
        conn, loop = self._conn, self._loop
        keep = False
        try:
            if conn is not None:
                now = time.perf_counter()
                if conn.complete_ready():
                    self._progress = now
                window = POLL_S if self._polled_in_flight else 0.0 if conn.in_flight else IDLE_POLL_S
                keep = now - self._progress < window and not self._cores.crowded()
        finally:
            # Whatever happened, either poll again or go back to being woken: a poller that
            # stopped with its flag left awake would never hear of an answer again.
            if keep and loop is not None:
                os.sched_yield()  # a runnable process on this core (a worker, a client) goes first
                loop.call_soon(self._poll)
            else:
                self._polling = False
                if conn is not None:
                    conn.on_readable()  # what slipped in is completed, then the flag is armed

    def _check(self) -> None:
        conn = self._conn
        if conn is None or self._loop is None:
            return
        conn.complete_ready()  # direct answers of connections that sent nothing since (first: see below)
        if conn.check_server():
            self._timer = self._loop.call_later(LIVENESS_CHECK_S, self._check)

    def _drop(self) -> None:
        self._polled_in_flight = 0  # the requests in flight went with the connection
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._conn is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._conn.fileno())
            self._conn.close()
            self._conn = None

    def submit(self, kind: int, doc: dict, tensors: Any, callback: Callable[[Completion], None],
               on_response: Callable[[Completion], None] | None = None, model: str | None = None) -> None:
        """Send a request; ``callback`` runs on the loop with its completion (and must release it).
        With ``model``, its answer times decide whether the loop polls for this answer."""
        conn = self.connection()
        poll = self._polls_for(model)
        if model is not None:
            callback = self._timed(model, poll, callback)
        try:
            conn.submit(kind, doc, tensors, callback, on_response=on_response, polling=poll)
        except (Backpressure, ServerUnavailable) as e:
            raise _broker_error(e) from None
        if poll:
            self._polling_for(conn, model)

    def submit_prepared(self, prefix: bytes, route: dict | tuple[str, str], chunks: list, size: int,
                        callback: Callable[[Completion], None], model: str, sent_ns: int, direct: bytes = b"") -> int:
        """``submit`` of an inference descriptor serialized up to its send time
        (``Connection.prepared_prefix``), as ``Connection.submit_prepared`` takes it; returns its slot.

        With a ``direct`` trailer the worker may write the answer to the HTTP client itself: the
        loop does not poll for it (it may learn of it only at the connection's next request,
        ``reap``), nor is the worker asked to poll for the next request: several clients are being
        served, so the next request is another client's and comes after its own round trip (the
        worker's polling measured the same rate for 26-31 us more CPU per request)."""
        conn = self.connection()
        poll = not direct and self._polls_for(model)
        try:
            if direct:
                return conn.submit_prepared(prefix, route, chunks, size, self._timed(model, False, callback, sent_ns),
                                            sent_ns, False, direct)
            slot = conn.submit_prepared(prefix, route, chunks, size, self._timed(model, poll, callback), sent_ns, poll)
        except (Backpressure, ServerUnavailable) as e:
            raise _broker_error(e) from None
        if poll:
            self._polling_for(conn, model)
        return slot

    def rerun(self, conn: Connection, slot: int, tensors: bytes | memoryview, prefix: bytes, route: dict | tuple[str, str],
              callback: Callable[[Completion], None], model: str, sent_ns: int, last_sent_ns: int) -> bool:
        """``Connection.rerun`` on ``conn`` if it is still ours; False if nothing was sent. The
        last answer's time goes into the model's average, as its completion would have put it."""
        if conn is not self._conn:
            return False
        try:
            sent_at = conn.rerun(slot, tensors, len(prefix), sent_ns, self._timed(model, False, callback, sent_ns),
                                 route)
        except (Backpressure, ServerUnavailable) as e:
            raise _broker_error(e) from None
        if sent_at < 0:
            return False
        self._took(model, max(0, sent_at - last_sent_ns) / 1e9)
        return True

    def reap(self, slot: int) -> None:
        """Complete what is answered; if the request in ``slot`` (sent with a direct trailer) is
        not among it, have the worker wake the loop when it is."""
        conn = self._conn
        if conn is not None:
            conn.complete_ready()
            if not conn.want_wake(slot):
                conn.complete_ready()  # it completed between the two looks

    def reserve(self, prefix: bytes, body: int, route: dict) -> tuple[Connection, Reservation]:
        """A request block for a body still arriving (``Connection.reserve``), on the connection
        that ``send_reserved`` must be given back."""
        conn = self.connection()
        try:
            return conn, conn.reserve(prefix, body, route)
        except (Backpressure, ServerUnavailable) as e:
            raise _broker_error(e) from None

    def send_reserved(self, conn: Connection, reservation: Reservation, callback: Callable[[Completion], None],
                      model: str) -> None:
        """``submit`` of a reserved block whose tensor bytes are all in place."""
        if conn is not self._conn:  # the server went away since: the block went with its arena
            conn.discard(reservation)
            raise BrokerError(503, f"the shmserve server '{self.server_id}' went away while the request arrived")
        poll = self._polls_for(model)
        try:
            conn.send_reserved(reservation, self._timed(model, poll, callback), polling=poll)
        except (Backpressure, ServerUnavailable) as e:
            raise _broker_error(e) from None
        if poll:
            self._polling_for(conn, model)

    def _polls_for(self, model: str | None) -> bool:
        """Whether the loop polls for the answer: not for a model whose answers come late."""
        return POLL_S > 0 and (model is None or self._answer_s.get(model, 0.0) < POLL_WAIT_S) and \
            not self._cores.crowded()

    def _polling_for(self, conn: Connection, model: str | None) -> None:
        """A request whose answer the loop polls for was sent: start or prolong the polling."""
        self._polled_in_flight += model is not None
        self._progress = time.perf_counter()
        if not self._polling:
            self._polling = True
            conn.stay_awake()
            self._loop.call_soon(self._poll)  # type: ignore[union-attr]

    def _timed(self, model: str, polled: bool, callback: Callable[[Completion], None], sent_ns: int = 0
               ) -> Callable[[Completion], None]:
        """``callback``, after the answer's time went into the model's average. (A direct answer
        is timed from ``sent_ns`` to when its worker wrote it: the loop may learn of it late.)"""
        sent = time.perf_counter()

        def timed(completion: Completion) -> None:
            took = time.perf_counter() - sent
            if completion.sent_at:
                took = max(0, completion.sent_at - sent_ns) / 1e9
            self._took(model, took)
            if polled:  # (never below 0: a dropped connection's count was reset)
                self._polled_in_flight = max(0, self._polled_in_flight - 1)
            callback(completion)
        return timed

    def _took(self, model: str, seconds: float) -> None:
        """One more answer time in the model's running average."""
        average = self._answer_s.get(model, seconds)
        self._answer_s[model] = average + (seconds - average) * 0.125

    async def call(self, kind: int, doc: dict, tensors: Any = ()) -> Completion:
        fut: asyncio.Future = asyncio.get_running_loop().create_future()

        def resolve(completion: Completion) -> None:
            if fut.done():  # the HTTP client went away; free the answer nobody will read
                completion.release()
            else:
                fut.set_result(completion)

        self.submit(kind, doc, tensors, resolve)
        return await fut

    def stream(self, doc: dict, tensors: Any) -> "asyncio.Queue[tuple[bool, Completion]]":
        """Submit a streaming request; the queue yields (final, completion) in order."""
        queue: asyncio.Queue = asyncio.Queue()
        self.submit(REQ_INFER, doc, tensors, lambda c: queue.put_nowait((True, c)),
                    on_response=lambda c: queue.put_nowait((False, c)))
        return queue

    async def control(self, doc: dict) -> tuple[int, Any]:
        completion = await self.call(REQ_CONTROL, doc)
        try:
            return completion.status, completion.doc()
        finally:
            completion.release()

    def close(self) -> None:
        self._drop()
