"""The broker: the single owner of server state, running one loop on one doorbell (its sleeping flag, shm/waker.py).

Everything that must change state arrives as a record on a ring in shared memory (client requests,
worker messages, connects) followed by a post on the doorbell; the loop drains the rings, acts,
and sleeps again until the next post or its nearest timer. No threads touch state, no asyncio.

``Broker`` owns the parts and hands each record to the part whose job it is:

- connects: ``Clients.on_connects`` (clients.py)
- a client's inference request: ``Intake.infer`` (intake.py), then ``Scheduler.enqueue`` and
  ``Scheduler.send_batch`` (scheduler.py) onto the worker's inbox, or ``Ensembles`` (ensemble.py)
- a client's control request: ``ControlHandler.handle`` (control.py); an explicit load from a
  cloud repository syncs its folder first (cloud_sync.py) and returns through
  ``ControlHandler.start_synced_loads``
- a worker's outbox: ``Lifecycle.on_worker_messages`` (lifecycle.py); a finished batch gives
  back its rate-limiter resources (rate_limiter.py), and the dispatch pass that follows starts
  what waited for them
- a finished ensemble step: ``Ensembles.on_completions``
- a worker that exited or hung: ``Supervisor`` (supervisor.py), at housekeeping
"""
from __future__ import annotations

import logging
import math
import os
import signal
import time

from shmserve.shm.access import server_readers
from shmserve.shm.channel import BrokerSegment, connect_name
from shmserve.shm.control_messages import decode as decode_control
from shmserve.shm.extents import broker_arenas
from shmserve.parent_death import ORPHANED
from shmserve.shm import liveness, space
from shmserve.shm.liveness import BROKER_TICKET
from shmserve.shm.names import SHM_DIR, object_name, unlink_all
from shmserve.shm.protocol import REQ_BYE, REQ_CANCEL, REQ_CONTROL, REQ_INFER
from shmserve.shm.ring import RingCorrupt
from shmserve.shm.truncation_guard import Repairs
from shmserve.shm.untrusted import RING_KINDS, Garbage, Record, check_record, read_descriptor
from shmserve.shm.waker import READ_ONLY_WAKE_BOUND_S
from shmserve.signature import InvalidRequest

from .canary import SNAPSHOT_EVERY_S
from .catalog import Catalog
from .clients import Clients
from .control import ControlHandler
from .ensemble import Ensembles
from .instances import Instances
from .intake import EXITING, Intake
from .journal import Journal
from .lifecycle import Lifecycle
from .models import Client
from .options import STARTUP_FAILED, BrokerOptions
from .rate_limiter import RateLimiter
from .region_users import lane_holds, regions_in_use
from .regions import Regions
from .response_cache import create_store
from .routes import Routes
from .scheduler import Scheduler
from .statistics import Statistics
from .supervisor import Supervisor

log = logging.getLogger("shmserve.broker")

HOUSEKEEPING_S = 1.0  # client liveness, restart back-off; a worker's death wakes us at once (SIGCHLD)
HUNG_CHECK_S = 0.1  # how often canaries and executions (against execution_timeout_s) are looked at
SETTLE_S = 0.01  # how often regions unregistered while in use are looked at (lane requests ring no bell)


def _size_now(name: str) -> int | str:
    """The size of shm object ``name`` now, for a log line."""
    try:
        return os.stat(SHM_DIR + name).st_size
    except OSError:
        return "?"


class Broker:
    def __init__(self, opts: BrokerOptions) -> None:
        self.opts = opts
        self.seg = BrokerSegment.create(opts.server_id, opts.broker_arena_bytes, server_readers())
        for uid in self.seg.unmade_connects:
            log.error("the local clients of uid %d cannot connect: %s exists already, made by another user, and "
                      "the server may not remove it (remove it, then restart the server)", uid,
                      connect_name(opts.server_id, uid, False))
        # Its answers: the arena in its segment, then extents it grows (shm/extents.py).
        self.answers = broker_arenas(self.seg, opts.server_id, opts.broker_arena_cap_bytes)
        space.make_lock(opts.server_id)  # before any worker segment is counted (shm/space.py)
        self.journal = Journal(opts.server_id)  # what a broker before this one was asked to change
        self.cache = create_store(opts.server_id, opts.response_cache_bytes)  # workers attach it; ensembles use it
        self.catalog = Catalog()
        self.instances = Instances(opts)
        # Byte 0 of our segment's file: clients in any PID namespace see that we live (shm/liveness.py).
        self.tickets = liveness.watch(opts.server_id)
        self.tickets.hold(BROKER_TICKET)
        self.clients = Clients(self.seg, opts.server_id, self.tickets, self.answers)
        self.regions = Regions(self.seg, self.journal)
        self.routes = Routes(self.seg, self.catalog, self.instances)
        self.limiter = RateLimiter(opts.rate_limit, opts.rate_limit_resources)
        self.scheduler = Scheduler(self.seg, self.clients, self.instances, self.limiter)
        self.lifecycle = Lifecycle(opts, self.catalog, self.instances, self.routes, self.clients, self.journal,
                                   self.limiter)
        self.supervisor = Supervisor(self.instances, self.lifecycle, self.routes, self.clients, self.limiter)
        self.statistics = Statistics(self.answers, self.catalog, self.instances, self.regions, self.cache)
        self.control = ControlHandler(opts, self.seg, self.catalog, self.lifecycle, self.routes, self.statistics,
                                      self.regions, self.journal)
        self.statistics.serve(opts)
        self.ensembles = Ensembles(opts.server_id, self.seg, self.answers, self.catalog, self.clients, self.scheduler,
                                   self.instances, self.cache)
        self.intake = Intake(self.catalog, self.regions, self.clients, self.scheduler, self.ensembles)
        self.child_exited = False  # set by SIGCHLD: check the workers now
        self.orphaned = False  # set by ORPHANED: the launcher died (parent_death.py)
        self._last_housekeeping = 0.0
        self._last_watch = 0.0  # canaries and execution timeouts were last looked at
        self._repairs = Repairs()  # truncations of what it maps undone (shm/truncation_guard.py)

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> int:
        self.lifecycle.start(self.seg.waker)
        waker = self.seg.waker
        # (clients of other users wake it without lowering its flag: waker.py)
        bound = READ_ONLY_WAKE_BOUND_S if server_readers() else math.inf
        while self.lifecycle.running:
            waker.sleep(min(self._next_timer(), bound), self._has_work)
            self._pump()
            now = time.monotonic()
            if self.child_exited or now - self._last_housekeeping >= HOUSEKEEPING_S:
                self.child_exited = False
                self._last_housekeeping = now
                self._housekeeping()
        return self.shutdown()

    def request_stop(self, orphaned: bool = False) -> None:
        """Stop serving; ``orphaned``: the launcher is gone, so stop at once (no frontend is left
        to wait for answers) and remove every object of the server, which the launcher would."""
        self.orphaned = self.orphaned or orphaned
        self.lifecycle.stop()  # readiness (server and models) says no from now on; shutdown() refuses the rest

    def _in_flight(self) -> int:
        """Requests the drain waits for: queued or running in the broker's versions, on workers'
        direct lanes, and ensembles in progress."""
        count = sum(mv.in_flight() for mv in self.catalog.serving_and_retiring())
        count += sum(inst.lanes_unfinished() for _, inst in self.instances.workers.values())
        return count + (1 if self.ensembles.active() else 0)

    def _has_work(self) -> bool:
        if self.seg.connects_pending() or self.ensembles.has_completions():
            return True
        for client in self.clients.by_name.values():
            if client.seg.requests.pending():
                return True
        for _, inst in self.instances.workers.values():
            if inst.seg.outbox.pending():
                return True
        return False

    def _pump(self) -> None:
        """Drain every ring, then send what the schedulers let go and run the periodic checks."""
        if self.seg.connects_pending():
            self.clients.on_connects()
        if self.ensembles.active():
            self.ensembles.on_completions()
        self._take_worker_messages()
        for client in list(self.clients.by_name.values()):
            if client.seg.requests.pending():
                self._on_client_requests(client)
        for mv in self.catalog.serving_and_retiring():
            if self.scheduler.has_queued(mv):
                self.scheduler.dispatch(mv)
        if self.regions.any_leaving():  # unregistered regions: forgotten once no request uses them
            self._settle_regions()
        if self.catalog.retiring:
            self.lifecycle.progress_retirement()
        if self.lifecycle.updates.busy():
            self.lifecycle.updates.progress()
        if self.lifecycle.watcher is not None:
            self.lifecycle.apply_repository_changes()
        if self.lifecycle.cloud is not None and self.lifecycle.cloud.has_synced():
            self.control.start_synced_loads()
        now = time.monotonic()
        if now - self._last_watch >= HUNG_CHECK_S:  # periodic checks, not per request
            self._last_watch = now
            self.routes.judge_canaries(now)
            if self.supervisor.kill_hung_instances():
                self.child_exited = True

    def _take_worker_messages(self) -> None:
        for mv, inst in list(self.instances.workers.values()):
            if inst.seg.outbox.pending():
                self.lifecycle.on_worker_messages(mv, inst)

    def _next_timer(self) -> float:
        """How long the loop may sleep: until housekeeping, a restart, a draining version's check,
        a repository change, or a batcher's delay or timeout."""
        timeout = HOUSEKEEPING_S
        if any(c.policy.fraction > 0 for c in self.catalog.canaries.values()):
            timeout = min(timeout, SNAPSHOT_EVERY_S)
        if any(mv.exec_timeout_s for mv, _ in self.instances.workers.values()):
            timeout = min(timeout, HUNG_CHECK_S)
        if self.regions.any_leaving():
            timeout = min(timeout, SETTLE_S)
        now = time.monotonic()
        for due in (self.lifecycle.next_timer(), self.supervisor.next_timer(now),
                    self.scheduler.next_timer(self.catalog.serving(), now), self.ensembles.next_timer()):
            if due is not None:
                timeout = min(timeout, due)
        return timeout

    def _housekeeping(self) -> None:
        self._repair_shared_memory()
        self.supervisor.check_workers()
        self.answers.tidy()  # a retired extent of our arena whose answers were all read is unlinked
        if self.cache is not None:
            self.cache.recover()  # a worker that died holding the cache's lock
        self._refuse_reported_clients()
        self._refuse_truncating_clients()
        # Step outputs of workers now gone (reloaded, restarted) are never read again: unmap them.
        self.ensembles.segments.drop_unlinked(object_name(self.opts.server_id, "worker", ""))
        self.ensembles.segments.drop_unlinked(object_name(self.opts.server_id, "broker", "0.arena."))  # retired
        # Files of regions unregistered since (an ensemble's or the cache's reads opened them).
        self.ensembles.segments.regions.keep_only({(r.key, r.ino) for r in self.regions.system.regions.values()})
        for client in list(self.clients.by_name.values()):
            if not self.clients.tickets.held(client.ticket):
                log.info("client %s (pid %d) died; reclaiming its channel", client.name, client.pid)
                self._drop_client(client, died=True)
        if not self.lifecycle.startup_done:
            self.lifecycle.check_startup()

    def _repair_shared_memory(self) -> None:
        """Grow back what a client truncated and rewrite the header it changed, so that new
        clients can map broker.0 and connect; said once a second at most."""
        repairs = self._repairs.since_last()
        if self.seg.restamp():
            repairs.append("broker.0's header written again")
        if repairs:
            log.warning("shared memory the broker maps was changed by a client: %s (a local client of a "
                        "--local-client-users user may write these objects)", "; ".join(repairs))

    # -- clients --------------------------------------------------------------------------------
    def _on_client_requests(self, client: Client) -> None:
        """The records on a client's request ring, each checked before use (shm/untrusted.py); the
        first that is garbage disconnects the client, and the records behind it are dropped."""
        try:
            raws = client.seg.requests.drain()
            layout = client.seg.layout
            for raw in raws:
                rec = check_record(layout, raw, RING_KINDS)
                if rec.kind == REQ_INFER:
                    self.intake.infer(client, rec)
                elif rec.kind == REQ_CONTROL:
                    self._control(client, rec)
                elif rec.kind == REQ_CANCEL:
                    if not self.scheduler.cancel(self.catalog.serving_and_retiring(), client, rec.slot):
                        self.ensembles.cancel(client, rec.slot)
                elif rec.kind == REQ_BYE:
                    self._drop_client(client, died=False)
                    return
        except (RingCorrupt, Garbage) as e:
            self._refuse_client(client, f"its request ring: {e}")

    def _refuse_client(self, client: Client, what: str) -> None:
        """Disconnect a live client that wrote garbage: as if it had died (its lane, queued
        requests and registrations dropped, its segment unlinked), its pending requests
        cancelled, and its library told (``Clients.refuse``)."""
        if client.name not in self.clients.by_name:
            return
        log.warning("disconnected client %s (pid %d), which wrote garbage into shared memory: %s", client.name,
                    client.pid, what)
        self.clients.refuse(client)
        self._drop_client(client, died=True, owner_alive=True)

    def _refuse_truncating_clients(self) -> None:
        """Clients (of any user) that truncated their own segment: the broker's and workers'
        mappings of it are zeroed rather than grown back (shm/truncation_guard.py), so nothing
        written there reaches the client any more, whose requests would hang."""
        for client in list(self.clients.by_name.values()):
            if client.seg.seg.truncated:
                self._refuse_client(client, f"it truncated its segment (to {_size_now(client.seg.seg.name)} "
                                            f"bytes of {client.seg.seg.size})")

    def _refuse_reported_clients(self) -> None:
        """Clients a worker found garbage from on their lanes (``WorkerSegment.report_garbage``)."""
        for _, inst in list(self.instances.workers.values()):
            for lane, cookie, fault in inst.seg.garbage_reports():
                name = self.clients.lanes[lane]
                client = self.clients.by_name.get(name) if name is not None else None
                if client is not None and client.seg.cookie == cookie and client.lane == lane:
                    self._refuse_client(client, f"its lane on worker {inst.name} ({fault.text}; see that worker's log)")

    def _control(self, client: Client, rec: Record) -> None:
        doc, _ = read_descriptor(client.seg.seg.buf, rec)  # Garbage: the caller disconnects the client
        slot = rec.slot
        if self.regions.any_leaving():  # its sender may have the answers of their regions' last users:
            self._take_worker_messages()  # batches done (a worker says so before it answers them)
            self._settle_regions()
        try:
            status, answer = self.control.handle(client, slot, decode_control(doc))
            if self.regions.any_leaving():  # an unregister: regions nobody uses go before the answer
                self._settle_regions()
        except InvalidRequest as e:
            status, answer = e.status, {"error": str(e)}
        except (ValueError, KeyError, TypeError) as e:  # (MalformedControl among them)
            status, answer = 400, {"error": f"malformed control request: {e}"}
        except Exception as e:  # noqa: BLE001 - a bug in one control operation must not take the broker down
            log.exception("control request failed")
            status, answer = 500, {"error": f"internal error in the control request: {e!r}"}
        if status:  # 0: the handler answers later (e.g. a load in progress)
            self.clients.reply(client, slot, status, answer)

    def _settle_regions(self) -> None:
        self.regions.settle(regions_in_use(self.catalog.serving_and_retiring(), self.ensembles),
                            lane_holds(self.instances))

    def _drop_client(self, client: Client, died: bool, owner_alive: bool = False) -> None:
        """Forget a client that said goodbye, or that ``died`` (then its library's regions are
        unlinked here too, unless it was refused alive, ``owner_alive``); its segment's names are
        unlinked either way (``Clients.remove``). Its pending
        requests are cancelled first, since nobody waits for them any more: workers drop what
        they have not run, and a running model sees ``is_cancelled()``."""
        client.seg.cancel_pending()
        for mv in self.catalog.serving_and_retiring():
            self.scheduler.drop_client(mv, client)
        self.regions.forget_client(client.name, died and not owner_alive)
        if self.ensembles.cache is not None:
            self.ensembles.cache.forget_client(client.name)
        self.ensembles.drop_client(client)
        self.statistics.edges.forget(client.ticket)
        self.clients.remove(client)
        self.instances.wake_all()  # let them unmap the client's segment now

    # -- the end --------------------------------------------------------------------------------
    def shutdown(self) -> int:
        """Finish in-flight work within the exit timeout, stop workers, remove our objects."""
        deadline = time.monotonic() + (0 if self.orphaned else self.opts.exit_timeout_s)
        # New requests come to the broker, which refuses them (intake.py), but our workers' BLS
        # calls: they are part of requests in flight.
        self.intake.exempt_pids = {inst.proc.pid for _, inst in self.instances.workers.values()}
        self.intake.refusal = EXITING
        self.routes.draining = True
        self.routes.publish()
        waiting = self._in_flight()
        if waiting and not self.orphaned:
            log.info("stopping: waiting up to %g s for %d request(s) in flight", self.opts.exit_timeout_s, waiting)
        while time.monotonic() < deadline and self._in_flight() and not self.orphaned:
            self.seg.waker.sleep(0.01, self._has_work)
            self._pump()
            if self.child_exited:  # a worker that dies now fails its requests at once
                self.child_exited = False
                self.supervisor.check_workers()
        left = self._in_flight()
        if self.orphaned:  # (the launcher died, before the drain or during it)
            log.error("the launcher died: stopping at once with %d request(s) in flight and removing the server's "
                      "shared memory", left)
        elif left:
            log.warning("stopping with %d request(s) still in flight after %g s (--exit-timeout-secs)", left,
                        self.opts.exit_timeout_s)
        self.lifecycle.close()
        # Workers get what is left of the exit timeout (a stuck one is killed at its end), so the
        # server is gone within --exit-timeout-secs, as Triton is; orphaned: nothing is left to answer.
        self.instances.stop_all(graceful=not self.orphaned, deadline=deadline)
        for client in list(self.clients.by_name.values()):
            client.seg.close()
        self.control.trace.close()  # closes the trace files' JSON arrays
        served = self.catalog.serving()
        self.catalog.models.clear()
        for mv in served:
            self.lifecycle.discard_model_dir(mv.model_dir)
        if self.cache is not None:
            self.cache.close()
            self.cache.unlink()
        self.answers.close()  # (unlinks its grown extents)
        self.seg.close()
        self.seg.unlink()
        if self.orphaned:
            unlink_all(self.opts.server_id)  # the frontends' objects and the journal too: nobody restarts us
        return STARTUP_FAILED if self.lifecycle.startup_failed else 0


def main(opts: BrokerOptions) -> int:
    try:
        broker = Broker(opts)
    except space.NoRoom as e:  # another program filled /dev/shm: the launcher tries again, with back-off
        log.error("cannot start: %s", e)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: broker.request_stop())
    signal.signal(signal.SIGINT, lambda *_: broker.request_stop())
    signal.signal(ORPHANED, lambda *_: broker.request_stop(orphaned=True))
    # A dying worker interrupts the doorbell wait, so its requests fail and it restarts at once.
    signal.signal(signal.SIGCHLD, lambda *_: setattr(broker, "child_exited", True))
    return broker.run()
