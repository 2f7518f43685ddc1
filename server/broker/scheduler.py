"""Scheduling and dispatch: a version's queue, its dynamic batcher or its sequence batcher, and
the batches sent to its workers.

Each version has one scheduler, chosen by its config: the default one (a FIFO queue; each
request goes alone to the least-loaded ready instance), Triton's dynamic batcher
(``shmserve/batching.py``) or its sequence batcher (``sequencer.py``). A batch is a JSON document
in the broker's arena listing the requests' resolved entries; its offset goes on the worker's
inbox ring and the worker is rung. The worker answers each request in the client's slot itself
and reports the batch done on its outbox (``lifecycle.Lifecycle.on_worker_messages``).

A rate-limited version (``rate_limiter.py``) forms its batches the same way, but an instance
takes one only when the rate limiter gives it the turn and its resources; each one at a time.
"""
from __future__ import annotations

import time

import orjson

from shmserve.batching import Pending, QueueFull, waited_ns
from shmserve.shm.answer import AnswerDescriptor, refusal
from shmserve.shm.arena import no_room_text
from shmserve.shm.channel import BrokerSegment
from shmserve.shm.protocol import CANCELLED_STATUS, W_BATCH, cancelled_error, manifest_room, write_manifest
from shmserve.signature import InvalidRequest, request_tag

from .clients import Clients
from .instances import Instances
from .models import Client, Instance, ModelVersion
from .rate_limiter import RateLimiter


class Scheduler:
    def __init__(self, seg: BrokerSegment, clients: Clients, instances: Instances, limiter: RateLimiter) -> None:
        self.seg = seg
        assert seg.arena is not None  # the broker's segment, which it created
        self.arena = seg.arena
        self.clients = clients
        self.instances = instances
        self.limiter = limiter
        self.next_batch = 1  # batch ids: a worker names the batch it finished

    def enqueue(self, mv: ModelVersion, pend: Pending) -> None:
        """Queue a request for its version's scheduler, or answer why it cannot be queued."""
        client, slot, now = pend.client, pend.slot, pend.arrived
        if mv.sequencer is not None:
            try:
                mv.sequencer.enqueue(pend, mv.instances, now)
            except InvalidRequest as e:  # counted nowhere, as Triton 2.51 counts what its scheduler refuses
                self.clients.reply(client, slot, e.status, refusal(str(e), mv.version))
                return
        elif mv.batcher is not None:
            try:
                mv.batcher.enqueue(pend, now)
            except QueueFull as e:  # (likewise)
                self.clients.reply(client, slot, e.status,
                                   refusal(request_tag(pend.entry.get("id", "")) + str(e), mv.version))
                return
        else:
            mv.queue.append(pend)
        self.dispatch(mv)

    @staticmethod
    def has_queued(mv: ModelVersion) -> bool:
        """Whether ``dispatch`` may have something to send (a sequence batcher always may)."""
        return bool(mv.queue) or (mv.batcher is not None and len(mv.batcher) > 0) or mv.sequencer is not None

    def dispatch(self, mv: ModelVersion) -> None:
        """Send what ``mv``'s scheduler lets go now to its free instances (under the rate limiter:
        what the limiter lets go now, across every rate-limited version)."""
        now = time.monotonic()
        mv.dispatched = now
        self._expire(mv, now)
        if mv.rate_limited:
            self._dispatch_limited(now)
        elif mv.sequencer is not None:
            self._dispatch_sequences(mv, now)
        else:
            self._dispatch_queue(mv, now)

    def _expire(self, mv: ModelVersion, now: float) -> None:
        """Requests past their queue timeout fail (for a sequence: in the backlog); idle sequences
        lose their slots."""
        if mv.batcher is not None:
            expired = mv.batcher.expire(now)
            if expired:
                # Triton's reason for a queue timeout, and their time in the server as its failures' duration
                mv.stats.fail("REJECTED", len(expired), waited_ns(expired, now))
                self.clients.fail_pending(expired, 503, "Request timeout expired", mv.version)
        elif mv.sequencer is not None:
            expired = mv.sequencer.expire(now)
            if expired:  # a backlogged sequence's wait timed out: Triton's text, status and reason
                mv.stats.fail("REJECTED", len(expired), waited_ns(expired, now))
                self.clients.fail_pending(expired, 503, "timeout of the corresponding sequence has been expired",
                                          mv.version)

    def _dispatch_queue(self, mv: ModelVersion, now: float) -> None:
        """The default queue or the dynamic batcher: batches to the least-loaded instances."""
        while mv.queue or (mv.batcher is not None and len(mv.batcher)):
            inst = mv.pick_instance()
            if inst is None:
                # Ask the busy instances to ring us when they finish; the loop's has-work check
                # re-reads their outboxes after the fence in sleep(), so a finish that raced this
                # is not missed.
                self.instances.want_wakeup(mv)
                return
            taken = self._take(mv, inst, now)
            if taken is None:
                return  # the batcher waits for more; the loop's timer brings us back when the delay ends
            self.send_batch(mv, inst, *taken)

    def _dispatch_sequences(self, mv: ModelVersion, now: float) -> None:
        for inst in mv.instances:
            if not inst.ready or len(inst.outstanding) >= mv.pipeline_depth:
                continue
            taken = self._take(mv, inst, now)
            if taken is not None:
                self.send_batch(mv, inst, *taken)
        if len(mv.sequencer):
            # Requests still queued: a finish may let them go. Not only a full instance's: an END
            # sent frees its slot for a backlogged sequence, which no dispatch would give it
            # until the broker woke for something else (housekeeping's second).
            self.instances.want_wakeup(mv)

    def _take(self, mv: ModelVersion, inst: Instance, now: float) -> tuple[list[Pending], dict | None] | None:
        """The next batch of ``mv`` for ``inst`` (with the sequences it is to forget), or None
        when its scheduler sends nothing now."""
        if mv.sequencer is not None:
            batch = mv.sequencer.next_batch(inst, mv.instances, now)
            releases = mv.sequencer.take_releases(inst)
            if not batch and not releases:
                return None
            return batch or [], {"release": releases} if releases else None
        if mv.batcher is not None:
            batch = mv.batcher.next_batch(now)
            return (batch, None) if batch else None
        return ([mv.queue.popleft()], None) if mv.queue else None

    def _dispatch_limited(self, now: float) -> None:
        """Rate-limited versions share resources by name across models: the limiter picks, one at
        a time, which idle instance with work executes next, until it picks none; each execution
        holds its resources until its batch is done (``Lifecycle.on_worker_messages``)."""
        limiter = self.limiter
        versions = [mv for mv in limiter.limited() if self._has_work(mv)]
        tried: set[int] = set()
        while True:
            waiting = [(mv, inst) for mv in versions for inst in self._idle(mv)
                       if inst.num not in tried and (mv.sequencer is None or mv.sequencer.has_work_for(inst))]
            turn = limiter.choose(waiting)
            if turn is None:
                break
            mv, inst, lender = turn
            tried.add(inst.num)
            taken = self._take(mv, inst, now)
            if taken is None:
                continue  # its batcher waits for more: the next in line may go
            batch, extra = taken
            batch_id = self.send_batch(mv, inst, batch, extra)
            if batch_id and batch:
                limiter.acquire(mv, inst, batch_id, lender)
        still_waiting = False
        for mv in limiter.limited():
            if mv.sequencer is not None:  # sequences to forget go to idle instances without a turn
                for inst in self._idle(mv):
                    releases = mv.sequencer.take_releases(inst)
                    if releases:
                        self.send_batch(mv, inst, [], {"release": releases})
            if self._has_work(mv):
                still_waiting = True
                self.instances.want_wakeup(mv)
        if still_waiting:
            for holder in limiter.holders():  # a finish anywhere may free what the waiting need
                holder.seg.want_wakeup = True

    @staticmethod
    def _has_work(mv: ModelVersion) -> bool:
        return bool(mv.queue) or any(s is not None and len(s) > 0 for s in (mv.batcher, mv.sequencer))

    @staticmethod
    def _idle(mv: ModelVersion) -> list[Instance]:
        """Instances of a rate-limited version that may take a batch: one execution at a time each."""
        if mv.batcher is not None and mv.batcher.preserve_ordering and any(i.outstanding for i in mv.instances):
            return []  # one batch at a time keeps responses in request order
        return [inst for inst in mv.instances if inst.ready and not inst.outstanding]

    def send_batch(self, mv: ModelVersion, inst: Instance, batch: list[Pending], extra: dict | None = None) -> int:
        """Write the batch into the broker's batch arena (batches.0, which no client can write)
        and put it on the instance's inbox; its id, or 0 when it could not be sent (its requests
        are answered with 503)."""
        doc = {"requests": [p.entry for p in batch]}
        if extra:
            doc.update(extra)
        data = orjson.dumps(doc)
        arena, batches = self.seg.batch_arena, self.seg.batches
        assert arena is not None and batches is not None  # (the broker made them)
        off = arena.alloc(manifest_room(len(data)), inst.proc.pid)
        if off < 0:
            self.clients.fail_pending(batch, 503, no_room_text(arena, "the broker's arena is full"))
            return 0
        write_manifest(batches.buf, off, data)
        batch_id = self.next_batch
        self.next_batch += 1
        inst.outstanding[batch_id] = batch
        if not inst.seg.inbox.put(W_BATCH, len(batch), off, len(data), batch_id):
            inst.outstanding.pop(batch_id)
            arena.free(off)
            self.clients.fail_pending(batch, 503, f"instance '{inst.name}' inbox is full; retry later")
            return 0
        inst.seg.waker.notify()
        return batch_id

    def cancel(self, versions: list[ModelVersion], client: Client, slot: int) -> bool:
        """Drop ``client``'s cancelled request in ``slot`` from the queue holding it and answer it
        with Triton's cancelled error; False when no queue here holds it (it runs on a worker,
        which sees the slot's cancelled word, or it was answered). A sequence's request ends its
        sequence, as in Triton: those queued behind it that lack START are refused as late ones."""
        for mv in versions:
            pend = next((p for p in mv.queue if p.client is client and p.slot == slot), None)
            if pend is not None:
                mv.queue.remove(pend)
            elif mv.batcher is not None and len(mv.batcher):
                pend = mv.batcher.take_out(client, slot)
            elif mv.sequencer is not None and len(mv.sequencer):
                pend, refused = mv.sequencer.cancel(client, slot, mv.instances, time.monotonic())
                for p, e in refused:
                    self.clients.reply(p.client, p.slot, e.status, refusal(str(e), mv.version))
                if pend is not None:
                    self.dispatch(mv)  # (a START queued behind it may begin its sequence now)
            if pend is not None:
                mv.stats.fail("CANCELED", 1, waited_ns([pend], time.monotonic()))
                # (the version's scheduler had it: its trace names the version, as Triton's)
                self.clients.reply(client, slot, CANCELLED_STATUS,
                                   AnswerDescriptor(error=cancelled_error(pend.entry.get("id", "")), version=mv.version))
                return True
        return False

    @staticmethod
    def drop_client(mv: ModelVersion, client: Client) -> None:
        """Forget the queued requests of a client that went away."""
        if mv.queue:
            mv.queue = type(mv.queue)(p for p in mv.queue if p.client is not client)
        for sched in (mv.batcher, mv.sequencer):
            if sched is not None:
                sched.drop_client(client)

    @staticmethod
    def next_timer(versions: list[ModelVersion], now: float) -> float | None:
        """Seconds until a batcher's delay or a queue timeout ends (None: nothing is waiting); a
        batch that was due when its version was last dispatched waits for an instance (or its
        resources) instead, whose finish wakes the broker."""
        timers = [mv.batcher.next_timer(now, mv.dispatched) for mv in versions if mv.batcher is not None]
        timers += [mv.sequencer.next_timer(now) for mv in versions if mv.sequencer is not None]
        return min((t for t in timers if t is not None), default=None)
