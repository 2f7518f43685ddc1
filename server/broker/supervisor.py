"""Worker deaths: an instance that exits or hangs fails its requests and is restarted.

A dying worker interrupts the broker's sleep (SIGCHLD), so its requests fail at once: those the
broker had sent it, and those clients put on its lanes directly. It is restarted with a back-off
that grows while it keeps dying. An execution longer than the model's ``execution_timeout_s``
kills the instance, and the same path takes over.
"""
from __future__ import annotations

import logging
import signal
import time

import numpy as np

from shmserve.batching import waited_ns
from shmserve.shm.protocol import SLOT_PENDING
from shmserve.shm.stats import BUSY_SINCE, VersionTotals

from .clients import Clients
from .instances import Instances, StartFailed
from .lifecycle import Lifecycle
from .models import Instance, ModelVersion, State
from .rate_limiter import RateLimiter
from .routes import Routes

log = logging.getLogger("shmserve.broker")

RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)
STABLE_RUN_S = 60.0  # an instance that ran this long restarts at once when it dies
GONE_MEMORY_S = 60.0  # how long requests that land on an exited worker's lane are still answered


class Supervisor:
    def __init__(self, instances: Instances, lifecycle: Lifecycle, routes: Routes, clients: Clients,
                 limiter: RateLimiter) -> None:
        self.instances = instances
        self.limiter = limiter
        self.lifecycle = lifecycle
        self.routes = routes
        self.clients = clients
        self.restarts: list[tuple[float, ModelVersion, Instance]] = []  # (when, version, exited instance)
        self.gone: dict[int, tuple[float, VersionTotals, int, str, str]] = {}  # exited worker -> when,
        # its counts, answer (status, text to a request never taken, text to one taken)

    def check_workers(self) -> None:
        """Handle every worker that exited, start the restarts that are due, answer stragglers."""
        for num, (mv, inst) in list(self.instances.workers.items()):
            code = inst.proc.poll()
            if code is not None:
                self._on_exit(mv, inst, code)
        for when, mv, old in list(self.restarts):
            if when <= time.monotonic():
                self.restarts.remove((when, mv, old))
                # A retiring version still gets its instance back while requests wait for it
                # (they were queued while it restarted): draining must serve them, not time out.
                wanted = mv.state != State.UNLOADING or mv.in_flight()
                if wanted and self.lifecycle.running and old in mv.instances:
                    self._restart(mv, old)
        self._sweep_gone()

    def _restart(self, mv: ModelVersion, old: Instance) -> None:
        """Restart ``old``; one that cannot start is tried again with back-off, as one that died
        while restarting (its version serves if another instance does), never failing the broker."""
        try:
            self.instances.restart(mv, old)
        except StartFailed as e:
            old.restarts += 1
            delay = RESTART_BACKOFF_S[min(old.restarts, len(RESTART_BACKOFF_S) - 1)]
            log.error("%s; trying again in %g s", e, delay)
            self.restarts.append((time.monotonic() + delay, mv, old))

    def _on_exit(self, mv: ModelVersion, inst: Instance, code: int) -> None:
        self.lifecycle.on_worker_messages(mv, inst)  # it may have said why before it went
        self.limiter.forget(inst)  # what its execution held goes back
        self.instances.reap(inst, mv)
        # Routes first, answers second: a client that gets its failure and sends again at
        # once must already see the routes without this worker.
        self.routes.publish()
        swept = self._fail_direct(inst, mv, code)
        if mv.state == State.UNLOADING or not self.lifecycle.running:
            return
        if inst.removed or inst.added:  # a live instance change took it away, or it failed to join
            self.lifecycle.updates.gone(mv, inst, code)
            return
        if not inst.ready and mv.state != State.READY:  # its first load: the version fails
            self.lifecycle.fail_version(mv, f"failed to load '{mv.name}' version {mv.version}: instance "
                                            f"'{inst.name}' exited with code {code} while loading")
            self.lifecycle.settle_loads()
            return
        # A version that served keeps its state when an instance dies, or fails to restart: it is
        # tried again with back-off, and the version is ready whenever one instance serves.
        lost = [p for batch in inst.outstanding.values() for p in batch]
        if mv.sequencer is not None:  # its sequences and their state died with it
            lost += mv.sequencer.forget_instance(inst)
        msg = death_message(mv, inst, code)
        # Back-off: an instance that keeps dying is restarted less and less often.
        delay = 0.0 if time.monotonic() - inst.started > STABLE_RUN_S else \
            RESTART_BACKOFF_S[min(inst.restarts, len(RESTART_BACKOFF_S) - 1)]
        if inst.ready:
            log.error("model '%s' version %d instance '%s' %s; %d request(s) failed; restarting it %s", mv.name,
                      mv.version, inst.name, death_cause(inst, code), len(lost) + swept,
                      f"in {delay:g} s (back-off)" if delay else "now")
        else:  # a restart that failed (said why in death_note); its version serves if another instance does
            log.error("model '%s' version %d instance '%s' %s; trying again", mv.name, mv.version, inst.name,
                      inst.death_note or f"exited with code {code} while restarting")
        self.clients.fail_pending(lost, 500, msg)
        mv.stats.fail("BACKEND", len(lost), waited_ns(lost, time.monotonic()))
        mv.stats.worker_restarts += 1
        inst.ready = False
        inst.outstanding.clear()
        self.restarts.append((time.monotonic() + delay, mv, inst))

    def next_timer(self, now: float) -> float | None:
        """Seconds until the next restart is due (None: none is planned)."""
        return max(0.0, min(when for when, _, _ in self.restarts) - now) if self.restarts else None

    def kill_hung_instances(self) -> bool:
        """Kill instances whose running execution passed their model's execution_timeout_s; the
        exit path fails their requests (with this reason) and restarts them. True when one was
        killed (the loop then checks the workers at once)."""
        killed = False
        now = time.monotonic_ns()
        for num, (mv, inst) in list(self.instances.workers.items()):
            if not mv.exec_timeout_s or inst.death_note:
                continue
            since = int(inst.seg.stats.scalars[BUSY_SINCE])
            if since and now - since > mv.exec_timeout_s * 1e9 and inst.proc.poll() is None:
                inst.death_note = (f"exceeded its execution timeout of {mv.exec_timeout_s:g} s "
                                   f"(parameter execution_timeout_s) and was restarted")
                log.error("model '%s' version %d instance '%s' %s", mv.name, mv.version, inst.name,
                          inst.death_note)
                inst.proc.kill()
                killed = True
        return killed

    def _fail_direct(self, inst: Instance, mv: ModelVersion, code: int) -> int:
        """Fail the requests whose slots name a worker that exited (direct ones, and forwarded ones
        it still answered after their batch: workers/stream.py, ``_keep``); how many of its own.

        A client that read the routes just before they changed may still put a request on the
        gone worker's lane after this sweep; worker numbers are never reused, so the broker
        remembers gone workers for a while and sweeps again at every check.
        """
        if (mv.state == State.UNLOADING or inst.removed) and code == 0:
            why = "was unloaded" if mv.state == State.UNLOADING else f"instance '{inst.name}' was removed"
            status = 503
            message = f"model '{mv.name}' version {mv.version} {why} before the request ran; retry"
            # A request the worker took ran: a decoupled model's stream left open (it may have sent
            # responses already), which a retry would answer twice.
            ran = (f"model '{mv.name}' version {mv.version} instance '{inst.name}' stopped before its model "
                   f"sent the request's final response")
        else:
            status, message = 500, death_message(mv, inst, code)
            ran = message
        # Only the version's counts: keeping the version would keep its instances and their mapped
        # segments for GONE_MEMORY_S after every reload (0.7 MB of the broker's memory each).
        self.gone[inst.num] = (time.monotonic(), mv.stats, status, message, ran)
        return self._sweep_gone().get(inst.num, 0)

    def _sweep_gone(self) -> dict[int, int]:
        """Fail every pending request whose slot names a gone worker; how many, by worker."""
        now = time.monotonic()
        for num in [n for n, (at, *_) in self.gone.items() if now - at > GONE_MEMORY_S]:
            del self.gone[num]
        failed: dict[int, int] = {}
        if not self.gone:
            return failed
        for client in list(self.clients.by_name.values()):
            for slot in np.flatnonzero(client.seg.slot_states == SLOT_PENDING).tolist():
                num = client.seg.target(slot) - 1
                gone = self.gone.get(num)
                if gone is not None:
                    _, stats, status, msg, ran = gone
                    if client.seg.taken(slot):  # it ran: a 500, not a 503 that clients and balancers retry
                        status, msg = 500, ran
                    self.clients.reply(client, slot, status, {"error": msg})
                    stats.fail("BACKEND" if status == 500 else "OTHER", 1)
                    failed[num] = failed.get(num, 0) + 1
        return failed


def death_cause(inst: Instance, code: int) -> str:
    """How an instance's process ended: "was killed by SIGKILL", "exited unexpectedly (...)"."""
    if inst.death_note:
        return inst.death_note
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited unexpectedly (exit code {code})"


def death_message(mv: ModelVersion, inst: Instance, code: int) -> str:
    """Why an instance's requests failed, as their clients read it."""
    return (f"model '{mv.name}' version {mv.version} instance '{inst.name}' {death_cause(inst, code)}; "
            f"the request was not completed")
