"""Wake-ups between processes that cost nothing while the receiver is busy.

Each receiver owns a *sleeping* flag in shared memory next to its semaphore (or FIFO). Before it
blocks it raises the flag, fences, and looks for work once more; a producer writes its record,
fences, and posts only if the flag is raised. A busy receiver thus gets no post at all, and a
post (a futex wake: about 30 us of the poster's time on this kind of machine, plus the receiver's
wake-up) is paid only when somebody really sleeps. The fences make the flag/record exchange safe
(a store-load pair would otherwise be reordered on x86); an uncontended lock gives a full barrier.

A FIFO receiver is for asyncio loops: ``loop.add_reader`` on the FIFO wakes the loop directly, with
no extra thread hop.
"""
from __future__ import annotations

import errno
import math
import os
import threading
import time
from typing import Callable

import posix_ipc

AWAKE, SLEEPING = 0, 1
_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier (the lock's atomic exchange), so flag and ring accesses keep order."""
    _fence_lock.acquire()
    _fence_lock.release()


def drain(sem: posix_ipc.Semaphore) -> None:
    """Take every pending post, without raising an exception per empty try."""
    while sem.value > 0:
        try:
            sem.acquire(0)
        except posix_ipc.BusyError:
            return


def flag_view(buf: memoryview, offset: int) -> memoryview:
    """The 32-bit flag at ``offset`` (a memoryview: an item read costs a third of numpy's, and
    producers read the flag on every request)."""
    return buf[offset:offset + 4].cast("I")


class Waker:
    """One receiver's wake-up channel, used from either side."""

    def __init__(self, flag: memoryview, sem: posix_ipc.Semaphore | None = None, fifo_path: str | None = None) -> None:
        self.flag = flag
        self.sem = sem
        self.fifo_path = fifo_path
        self._fifo_fd: int | None = None

    # -- producer side --------------------------------------------------------------------------
    def notify(self) -> None:
        fence()
        if self.flag[0] == SLEEPING:
            self.flag[0] = AWAKE
            self.post()

    def post(self) -> None:
        """Wake unconditionally (start-up messages, shutdown)."""
        if self.sem is not None:
            self.sem.release()
            return
        if self.fifo_path is None:
            return  # a receiver that polls for itself (the broker's own client)
        fd = self._fifo_fd
        if fd is None:
            try:
                fd = self._fifo_fd = os.open(self.fifo_path, os.O_WRONLY | os.O_NONBLOCK)  # type: ignore[arg-type]
            except OSError:  # the reader is gone; nobody to wake
                return
        try:
            os.write(fd, b"\0")
        except BlockingIOError:  # the FIFO is full of wake-ups already
            pass
        except OSError as e:
            if e.errno in (errno.EPIPE, errno.EBADF):
                self.close()

    # -- receiver side --------------------------------------------------------------------------
    def sleep(self, timeout: float, has_work: Callable[[], bool], spin: "SpinPolicy | None" = None) -> None:
        """Block until notified or ``timeout``, unless work arrived meanwhile.

        With a ``spin`` policy, first poll for work as long as it allows (yielding the CPU between
        polls): on a VM a wake-up of an idle CPU costs tens of microseconds on both sides, which
        polling avoids when the next record follows closely.
        """
        if spin is not None:
            started = time.perf_counter()
            if spin.poll(has_work, started, timeout):  # never past the caller's timer (a batch delay)
                return
        self.flag[0] = SLEEPING
        fence()
        if has_work():
            self.flag[0] = AWAKE
            return
        assert self.sem is not None
        if spin is not None:
            timeout = max(0.0, timeout - (time.perf_counter() - started))  # the polling counts
        try:
            self.sem.acquire(timeout)
        except (posix_ipc.BusyError, posix_ipc.SignalError):
            pass
        self.flag[0] = AWAKE
        drain(self.sem)
        if spin is not None:
            spin.observe(time.perf_counter() - started)

    def arm(self, has_work: Callable[[], bool]) -> bool:
        """FIFO receivers: declare sleep; True if work slipped in and must be handled first."""
        self.flag[0] = SLEEPING
        fence()
        if has_work():
            self.flag[0] = AWAKE
            return True
        return False

    def close(self) -> None:
        if self._fifo_fd is not None:
            try:
                os.close(self._fifo_fd)
            except OSError:
                pass
            self._fifo_fd = None


class SpinPolicy:
    """When to poll before sleeping: only while recent waits were shorter than ``max_s``.

    Polling saves both sides of a wake-up (the producer's post and the sleeper's return from the
    futex, tens of microseconds each on a VM) when the next record comes within microseconds, as
    in a closed loop of one caller. Under load waits are long or absent, the average rises past
    ``max_s`` and nothing is spent polling; an idle receiver never polls after its first wait.
    """

    def __init__(self, max_s: float) -> None:
        self.max_s = max_s
        self.average = 0.0  # of recent waits, seconds

    def observe(self, waited_s: float) -> None:
        self.average += (min(waited_s, 10 * self.max_s) - self.average) * 0.125

    def budget(self) -> float:
        return self.max_s if 0 < self.max_s and self.average < self.max_s else 0.0

    def poll(self, done: Callable[[], bool], started: float, limit: float = math.inf) -> bool:
        """Poll ``done`` within the budget (and ``limit`` seconds); True once it holds (the wait
        is then observed)."""
        budget = min(self.budget(), limit)
        if budget <= 0:
            return False
        deadline = started + budget
        while True:
            if done():
                self.observe(time.perf_counter() - started)
                return True
            if time.perf_counter() >= deadline:
                return False
            os.sched_yield()


def make_fifo(path: str) -> int:
    """Create the FIFO and open it for reading (O_RDWR keeps it from ever reporting EOF)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    os.mkfifo(path, 0o600)
    return os.open(path, os.O_RDWR | os.O_NONBLOCK)


def read_all(fd: int) -> None:
    """Empty the FIFO; one read suffices unless it came back full."""
    try:
        while len(os.read(fd, 4096)) == 4096:
            pass
    except BlockingIOError:
        pass
