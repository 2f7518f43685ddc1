"""The frontend's link to the broker: one shm ``Connection`` on the asyncio loop.

Producers wake the frontend through a FIFO the loop watches with ``add_reader``, so completions
run on the loop itself: no waiter thread, no ``call_soon_threadsafe`` hop. A timer checks once a
second that the broker lives; if it restarts, the next request opens a fresh connection and
requests in flight get a 503 instead of hanging. The timer runs again whatever a check raised
(out of descriptors, say): a check that stopped for good once left every later request waiting
on a broker that had been replaced. ``problem`` tells liveness when the checks stopped succeeding.

Polling (``--poll-us``, ``poll_s`` here): after each submission or answer the loop keeps polling
for the next answer for up to ``poll_s`` instead of sleeping: a callback that completes what is
done, yields the CPU and schedules itself again, so sockets are still served between polls. A
client in a closed loop sends its next request within that time too, and the loop sees it
without a wake-up from epoll. While the loop polls, producers see it awake and skip the FIFO
write, and its requests ask the worker to poll for the next one as well (``REQ_POLLING``), so
requests that follow closely cross no sleep between our processes in either direction.

Polling pays only when the answer comes soon and a core is idle: the loop keeps a running average
of how long each model's answers take, and a request to a model whose answers take longer than
``poll_s`` on average neither starts nor prolongs the polling, and is not sent with the worker's
polling hint. How long the loop polls is the shared policy's (shm/waker.py ``SpinPolicy``), which
hears of the answer times of the models polled for (polled or not): its budget is none while they
average longer than ``poll_s`` and comes back when they come quickly again, and nothing is polled
while no core is idle. ``poll_s`` 0 never polls.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Callable, TypeVar

from shmserve.shm.channel import DEFAULT_SLOTS
from shmserve.shm.completion import Completion
from shmserve.shm.control_messages import ControlMessage
from shmserve.shm.connection import (ArenaBusy, Backpressure, Connection, RequestTooLarge, Reservation, ServerUnavailable,
                                     SlotsTaken)
from shmserve.shm.descriptor import InferRequest
from shmserve.shm.protocol import REQ_CONTROL, REQ_INFER
from shmserve.shm.streams import SpillRoom, StreamEvents
from shmserve.shm.truncation_guard import Repairs
from shmserve.shm.waker import SpinPolicy

log = logging.getLogger("shmserve.frontend")

LIVENESS_CHECK_S = 1.0
# How long the broker check may go without succeeding before this frontend reports it cannot serve.
CHECK_STALE_S = 5.0
# A request sent on a connection: (the connection, where its tensor bytes start), which is what
# ``BrokerLink.cancel`` names it by.
Sent = tuple[Connection, int]


async def completion_of(fut: "asyncio.Future[Completion]", sent: Sent | None = None) -> Completion:
    """The completion the request's callback sets on ``fut``. A caller cancelled while it waits
    (a gRPC client's deadline or cancel) cancels the request ``sent`` if it is still in flight;
    if its answer had come (a task cancelled just after its future got its result never reads
    it), frees that answer instead: unread, its block would pin the producer's arena and the
    request's block this frontend's, for good, and ``sent``'s block may already carry another
    request that a cancel would hit."""
    try:
        return await fut
    except asyncio.CancelledError:
        if fut.done() and not fut.cancelled():
            fut.result().release()
        elif sent is not None:
            BrokerLink.cancel(sent)
        raise


class BrokerError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Overloaded(BrokerError):
    """No room for the request now: the link's slots or its arena are taken (``Backpressure``)."""


class ArenaWait(Overloaded):
    """The arena will have room in a moment (``ArenaBusy``): the caller may wait and send again."""


# How long a request waits for room in a fragmented (not full) arena before it is refused.
ARENA_WAIT_S = 1.0

T = TypeVar("T")


async def when_room(attempt: Callable[[], T]) -> T:
    """``attempt()`` (a send), tried again each millisecond for up to ``ARENA_WAIT_S`` while it
    raises ``ArenaWait``: the arena has room by volume but not yet in one piece (a block held ahead
    comes back within moments), so a 503 then would refuse a request the server can take. A full
    arena (overload) is refused at once; the last ``ArenaWait`` is the caller's to answer."""
    deadline = time.monotonic() + ARENA_WAIT_S
    while True:
        try:
            return attempt()
        except ArenaWait:
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.001)


def _broker_error(e: Exception) -> BrokerError:
    if isinstance(e, RequestTooLarge):
        return BrokerError(400, f"{e} (--frontend-arena-mb)")
    why = str(e).removesuffix("; retry later")  # (said once, at the end)
    if isinstance(e, SlotsTaken):  # (the frontend's slots, shared by all its clients: say which flag sets them)
        return Overloaded(503, f"the server is overloaded ({e.slots} requests in flight in this frontend, its "
                               f"--http-max-inflight); retry later")
    if isinstance(e, ArenaBusy):
        return ArenaWait(503, f"the server is overloaded ({why}); retry later")
    if isinstance(e, Backpressure):
        return Overloaded(503, f"the server is overloaded ({why}); retry later")
    if isinstance(e, OSError) and not isinstance(e, ConnectionError):  # out of descriptors, say
        return BrokerError(503, f"the frontend cannot reach the server now ({e}); retry later")
    return BrokerError(503, str(e))


class BrokerLink:
    def __init__(self, server_id: str, arena_bytes: int, max_inflight: int = DEFAULT_SLOTS, poll_us: int = 0) -> None:
        self.server_id = server_id
        self.arena_bytes = arena_bytes
        self.max_inflight = max_inflight  # requests in flight on the channel; past it: 503
        # What the streams' clients have not read yet, copied out of the arenas (shm/streams.py)
        self.spill = SpillRoom(arena_bytes, "--frontend-arena-mb")
        self.poll_s = poll_us / 1e6
        self._conn: Connection | None = None
        self._loop: Any = None
        self._timer: asyncio.TimerHandle | None = None
        self._polling = False
        self._spin = SpinPolicy(self.poll_s)  # how long to poll, and whether a core is idle for it
        self._progress = 0.0  # perf_counter of the last submission or answer
        self._answer_s: dict[str, float] = {}  # per model: running average of its answer times
        self._polled_in_flight = 0  # requests in flight whose answers are polled for
        self._checked = 0.0  # monotonic time of the last broker check that succeeded
        self._check_error = ""  # what the failing checks since then raised
        self._repairs = Repairs()  # truncations of what this frontend maps undone (shm/truncation_guard.py)

    def connection(self) -> Connection:
        conn = self._conn
        if conn is not None and conn.alive:
            return conn
        self._drop()
        loop = asyncio.get_running_loop()
        try:
            conn = Connection(self.server_id, arena_bytes=self.arena_bytes, slots=self.max_inflight, loop_driven=True,
                              poll_us=round(self.poll_s * 1e6))
        except ServerUnavailable as e:
            raise BrokerError(503, f"the server is not available: {e}") from None
        except OSError as e:
            raise _broker_error(e) from None
        loop.add_reader(conn.fileno(), self._on_readable)
        self._conn, self._loop = conn, loop
        self._checked, self._check_error = time.monotonic(), ""
        self._timer = loop.call_later(LIVENESS_CHECK_S, self._check)
        return conn

    def open_early(self) -> None:
        """Make this frontend's client segment at start rather than at its first request: the
        launcher counted it in /dev/shm's room at start, and the broker's room check for a load
        counts only segments that exist, so one made later could take room a load was given."""
        try:
            self.connection()
        except BrokerError as e:  # the broker not there (yet), or no room: the first request connects
            why = "it stopped or is restarting, " if e.status == 503 and "not available" in str(e) else ""
            log.warning("not connected to the broker at start (%s%s); the first request will connect", why, e)

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
                    self._spin.found += 1  # (its time goes to the policy with every answer's, _took)
                    self._progress = now
                # (not for answers that come late: nothing in flight is polled for)
                if conn.in_flight and not self._polled_in_flight:
                    keep = False
                elif now - self._progress >= self._spin.budget():
                    self._spin.gave_up()  # nothing came within the budget: poll less next time
                    keep = False
                else:
                    keep = self._spin.idle_core()
                    self._spin.busy += not keep
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
        """Is the broker still the one connected to? Scheduled again while the connection lives,
        whatever the check raised (it is then unknown: look again in a second)."""
        conn, loop = self._conn, self._loop
        self._timer = None
        if conn is None or loop is None:
            return
        try:
            alive = conn.check_server()
        except Exception as e:  # noqa: BLE001 - out of descriptors, say: the next check may succeed
            alive = True
            if not self._check_error:
                log.warning("cannot check the broker connection (tried again every %g s): %s", LIVENESS_CHECK_S, e)
            self._check_error = str(e) or type(e).__name__
        else:
            if self._check_error:
                log.warning("the broker connection can be checked again")
            self._checked, self._check_error = time.monotonic(), ""
        if undone := self._repairs.since_last():  # (said as the broker and workers say theirs)
            log.warning("shared memory this frontend maps was truncated by a client: %s (a local client of a "
                        "--local-client-users user may write these objects)", "; ".join(undone))
        if alive and conn is self._conn:
            self._timer = loop.call_later(LIVENESS_CHECK_S, self._check)

    def problem(self) -> str | None:
        """Why this link cannot serve, if it cannot: its broker checks have not succeeded for
        ``CHECK_STALE_S`` (they fail, or their timer stopped). None while not connected."""
        conn = self._conn
        if conn is None or not conn.alive:
            return None
        late = time.monotonic() - self._checked
        if late <= CHECK_STALE_S:
            return None
        why = f": {self._check_error}" if self._check_error else ""
        return f"the frontend could not check its broker connection for {late:.0f} s{why}"

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

    def submit(self, kind: int, doc: InferRequest | ControlMessage, tensors: Any, callback: Callable[[Completion], None],
               on_response: Callable[[Completion], None] | None = None, model: str | None = None) -> Sent:
        """Send a request; ``callback`` runs on the loop with its completion (and must release it).
        With ``model``, its answer times decide whether the loop polls for this answer."""
        conn = self.connection()
        poll = self._polls_for(model)
        if model is not None:
            callback = self._timed(model, poll, callback)
        try:
            start = conn.submit(kind, doc, tensors, callback, on_response=on_response, polling=poll)
        except (Backpressure, RequestTooLarge, OSError) as e:  # (ServerUnavailable is a ConnectionError)
            raise _broker_error(e) from None
        if poll:
            self._polling_for(conn, model)
        return conn, start

    @staticmethod
    def cancel(sent: Sent) -> None:
        """The HTTP client went away: cancel its request (``Connection.cancel``). Its callback
        still runs when the answer comes and frees it."""
        conn, start = sent
        conn.cancel(start)

    def reserve(self, doc: InferRequest, body: int) -> tuple[Connection, Reservation]:
        """A request block for a body still arriving (``Connection.reserve``), on the connection
        that ``send_reserved`` must be given back."""
        conn = self.connection()
        try:
            return conn, conn.reserve(doc, body)
        except (Backpressure, RequestTooLarge, OSError) as e:  # (ServerUnavailable is a ConnectionError)
            raise _broker_error(e) from None

    def send_reserved(self, conn: Connection, reservation: Reservation, callback: Callable[[Completion], None],
                      model: str) -> Sent:
        """``submit`` of a reserved block whose tensor bytes are all in place."""
        if conn is not self._conn:  # the server went away since: the block went with its arena
            conn.discard(reservation)
            raise BrokerError(503, f"the shmserve server '{self.server_id}' went away while the request arrived")
        poll = self._polls_for(model)
        try:
            start = conn.send_reserved(reservation, self._timed(model, poll, callback), polling=poll)
        except (Backpressure, RequestTooLarge, OSError) as e:  # (ServerUnavailable is a ConnectionError)
            raise _broker_error(e) from None
        if poll:
            self._polling_for(conn, model)
        return conn, start

    def _polls_for(self, model: str | None) -> bool:
        """Whether the loop polls for the answer (called once per submission): not for a model
        whose answers come late, nor while the policy says polling does not pay or no core is idle."""
        if self.poll_s <= 0:
            return False
        spin = self._spin
        now = time.perf_counter()
        if self._polling:
            spin.found += 1  # the loop was polling when this request came
        # (the policy hears of answer times only (_took): the time since the last answer is the
        # client's own, and a client slower than --poll-us would end the polling)
        self._progress = now
        return (model is None or self._answer_s.get(model, 0.0) < self.poll_s) and spin.allowance() > 0

    def _polling_for(self, conn: Connection, model: str | None) -> None:
        """A request whose answer the loop polls for was sent: start or prolong the polling."""
        self._polled_in_flight += model is not None
        self._progress = time.perf_counter()
        if not self._polling:
            self._polling = True
            conn.stay_awake()
            self._loop.call_soon(self._poll)  # type: ignore[union-attr]

    def _timed(self, model: str, polled: bool, callback: Callable[[Completion], None]) -> Callable[[Completion], None]:
        """``callback``, after the answer's time went into the model's average."""
        sent = time.perf_counter()

        def timed(completion: Completion) -> None:
            self._took(model, time.perf_counter() - sent)
            if polled:  # (never below 0: a dropped connection's count was reset)
                self._polled_in_flight = max(0, self._polled_in_flight - 1)
            callback(completion)
        return timed

    def _took(self, model: str, seconds: float) -> None:
        """One more answer time in the model's running average."""
        average = self._answer_s.get(model, seconds)
        self._answer_s[model] = average = average + (seconds - average) * 0.125
        if average < self.poll_s:
            # A model polled for: its answer counts, polled or not (fed by polled answers alone,
            # one slow answer would end the polling for good). A slow model's never do: they
            # would end the polling for the quick models beside it.
            self._spin.waited(seconds)

    async def call(self, kind: int, doc: InferRequest | ControlMessage, tensors: Any = ()) -> Completion:
        fut: asyncio.Future = asyncio.get_running_loop().create_future()

        def resolve(completion: Completion) -> None:
            if fut.done():  # the HTTP client went away; free the answer nobody will read
                completion.release()
            else:
                fut.set_result(completion)

        self.submit(kind, doc, tensors, resolve)
        return await completion_of(fut)

    def stream(self, doc: InferRequest, tensors: Any) -> StreamEvents:
        """Submit a streaming request; its events come in order, the final one last. The reader
        takes them with ``next`` and must ``close`` them when it stops, at the end or early (a
        client that went away). Those it is slow to take wait in ``spill``, not in the arenas."""
        events = StreamEvents(asyncio.Queue(), self.spill)
        events.request = self.submit(REQ_INFER, doc, tensors, lambda c: events.put(True, c),
                                  on_response=lambda c: events.put(False, c))
        return events

    async def control(self, message: ControlMessage) -> tuple[int, Any]:
        completion = await self.call(REQ_CONTROL, message)
        try:
            return completion.status, completion.answer.control_document()
        finally:
            completion.release()

    def close(self) -> None:
        self._drop()
