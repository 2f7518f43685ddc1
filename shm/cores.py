"""Whether polling would take a core from somebody waiting for one.

The HTTP frontend polls for its answers and for a client's next request instead of sleeping,
because on a VM a wake-up costs tens of microseconds on both sides, and its requests ask the worker
to poll for the next one as well. That pays while a core is spare (one client: p50 0.59x of
Triton's polling, 0.82x asleep, session 17). When every core is wanted (four HTTP clients and the
server on two cores) each spin is taken from a client waiting in a run queue: the two pollers then
burned 172-184 us of server CPU per add_sub request against 138-145 asleep, for the same rate.

The kernel's count of tasks running or waiting for a core (the fourth field of ``/proc/loadavg``)
says it for about a microsecond. The count is the host's, so it is weighed against the host's
cores (``os.cpu_count``, not this process's affinity). A poller counts itself and the process it
waits on (the worker running its request, or the client about to send the next one): past those,
as many tasks as cores means somebody else wants the CPU, and the poller sleeps instead.

The count is a moment's, and one client's closed loop has three of our tasks up at times (the
client, the frontend and the worker polling for its next request), so a stray task would stop a
poll that costs nobody anything. The verdict follows a running average of the counts (1/8 weight;
restarted from the count itself after 10 ms without one, so that a crowded spell long past does
not hold the next requests back): crowded from half a task short of the mark, uncrowded again
below a whole task short of it, so that the poller's own count, which comes and goes with its
polling, does not flip it back and forth. On this 2-core VM the mark is 4: crowded from 3.5,
uncrowded below 3; the average was about 2.7 with one HTTP client and about 4.5 with four.

Local clients do not ask: there the worker is the bottleneck, and a client that sleeps costs it a
semaphore post per answer (four add_sub local clients: 21,000 req/s polling, 15,000 with this
check applied to them and their worker, session 17).

The check is off unless ``SHMSERVE_FRONTEND_CORE_CHECK=1``. It saves the CPU above, but at 4
add_sub clients the rate stayed within the noise of the polling default (0.91-0.99 of it in four
runs), and a batching model's worker is the bottleneck as local clients' is: mlp at 8 clients
(dynamic batching) served 0.87x and 0.81x the rate with the check, with more server CPU per
request (565 against 436 us), and the same rate as before with the check off (1.03x). So it is
for hosts where the CPU matters more than a batching model's rate.
"""
from __future__ import annotations

import math
import os
import time

CPUS = os.cpu_count() or 1  # the host's, as the count is
# SHMSERVE_FRONTEND_CORE_CHECK=1: ask before polling. Off by default: it costs batching models
# (mlp at 8 clients: 0.87x the rate; see the module's docstring).
ENABLED = os.environ.get("SHMSERVE_FRONTEND_CORE_CHECK", "0") == "1"
STALE_S = 0.01  # a count older than this says nothing of now: the average restarts


def _open_loadavg() -> int:
    try:
        return os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # not Linux: no count, and polling stays as its budgets say
        return -1


_LOADAVG = _open_loadavg()


def runnable() -> int:
    """Tasks on this host running or waiting for a core right now (the caller included); -1 where
    the kernel does not say."""
    if _LOADAVG < 0:
        return -1
    try:
        fields = os.pread(_LOADAVG, 128, 0).split()
        return int(fields[3].split(b"/")[0])
    except (OSError, IndexError, ValueError):
        return -1


class CoreCheck:
    """``crowded()``: True while tasks other than the poller and its peer want every core. Counted
    at most every ``interval_s``, so a poll loop can ask on every turn."""

    def __init__(self, own: int = 2, interval_s: float = 20e-6, enabled: bool = ENABLED) -> None:
        self.own = own  # runnable tasks that are the poller's own: itself and the process it waits on
        self.interval_s = interval_s
        self.enabled = enabled
        self.average = 0.0  # of the counts
        self._checked = -math.inf
        self._crowded = False

    def crowded(self) -> bool:
        if not self.enabled:
            return False
        now = time.perf_counter()
        since = now - self._checked
        if since >= self.interval_s:
            self._checked = now
            count = runnable()
            if count >= 0:  # (where the kernel says nothing, the poller polls as its budgets say)
                if since > STALE_S:
                    self.average = float(count)
                else:
                    self.average += (count - self.average) * 0.125
                mark = self.own + CPUS - (1.0 if self._crowded else 0.5)
                self._crowded = self.average >= mark
        return self._crowded
