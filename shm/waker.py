"""Wake-ups between processes that cost nothing while the receiver is busy.

Each receiver owns a *sleeping* flag in shared memory. Before it blocks it raises the flag,
fences, and looks for work once more; a producer writes its record, fences, and wakes it only if
the flag is raised. A broker's or worker's flag lies where clients of other users may only read it (``tables.0``,
``control.<n>``): such a client could otherwise lower it under a sleeping receiver and so hold
back everyone's wake-ups. A busy receiver thus gets no wake-up call at all, and one (a futex wake:
tens of microseconds of the waker's and the receiver's time on this kind of machine) is paid only
when somebody really sleeps. The fences make the flag/record exchange safe (a store-load pair
would otherwise be reordered on x86); an uncontended lock gives a full barrier.

The receiver sleeps on the flag word itself (futex.py): a producer that lowers it and wakes the
word cannot be missed, since the sleep only begins while the word still says SLEEPING. Every
process of the server's user maps the broker's and workers' flags writable; a client of another
user maps them read-only and only wakes the word, a wake-up that the instant before the wait
can lose: a receiver such clients may wake sleeps at most ``READ_ONLY_WAKE_BOUND_S`` at a time. The word
after it holds a post (``post``: start-up messages, shutdown, another thread's news) made while the
receiver was awake, which its next sleep returns for at once.

A FIFO receiver is for asyncio loops: ``loop.add_reader`` on the FIFO wakes the loop directly, with
no extra thread hop.
"""
from __future__ import annotations

import errno
import math
import os
import stat
import threading
import time
from typing import Callable

from .access import grant
from .futex import FutexWord

AWAKE, SLEEPING = 0, 1
POSTED_AT = 4  # after the flag: a post made while the receiver was awake
# The longest a broker or worker sleeps while clients of other users may wake it: their wake-up
# does not lower the flag (they may only read it), so one made in the instant between the
# receiver's last look for work and its wait is lost, and costs at most this.
READ_ONLY_WAKE_BOUND_S = 0.05
_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier (the lock's atomic exchange), so flag and ring accesses keep order."""
    _fence_lock.acquire()
    _fence_lock.release()


def flag_view(buf: memoryview, offset: int) -> memoryview:
    """The 32-bit flag at ``offset`` (a memoryview: an item read costs a third of numpy's, and
    producers read the flag on every request)."""
    return buf[offset:offset + 4].cast("I")


class Waker:
    """One receiver's wake-up channel, used from either side."""

    def __init__(self, flag: memoryview, futex: FutexWord | None = None, posted: memoryview | None = None,
                 fifo_path: str | None = None, fifo_owner: int | None = None) -> None:
        self.flag = flag
        self.futex = futex
        self.posted = posted
        self.fifo_path = fifo_path
        self.fifo_owner = fifo_owner  # whose FIFO it must be (its segment's owner); None: our own
        self._fifo_fd: int | None = None

    @classmethod
    def on_word(cls, buf: memoryview, offset: int) -> "Waker":
        """A receiver that sleeps on its flag at ``offset`` of ``buf``, the post word after it."""
        return cls(flag_view(buf, offset), futex=FutexWord(buf, offset), posted=flag_view(buf, offset + POSTED_AT))

    # -- producer side --------------------------------------------------------------------------
    def notify(self) -> None:
        fence()
        if self.flag[0] == SLEEPING:
            if not self.flag.readonly:  # (a producer that may only read the flag wakes, the receiver lowers it)
                self.flag[0] = AWAKE
            self._wake()

    def post(self) -> None:
        """Wake unconditionally (start-up messages, shutdown): a receiver awake now does not
        sleep at its next ``sleep`` either."""
        if self.futex is not None:
            assert self.posted is not None
            self.posted[0] = 1
            fence()
            self.flag[0] = AWAKE
            self.futex.wake()
            return
        self._wake()

    def _wake(self) -> None:
        if self.futex is not None:
            self.futex.wake()
            return
        if self.fifo_path is None:
            return  # a receiver that polls for itself (the broker's own client)
        fd = self._fifo_fd
        if fd is None:
            fd = open_fifo(self.fifo_path, self.fifo_owner)
            if fd is None:  # the reader is gone (or left something else there): nobody to wake
                return
            self._fifo_fd = fd
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
        posted = self.posted
        assert self.futex is not None and posted is not None
        self.flag[0] = SLEEPING
        fence()
        if has_work() or posted[0]:
            self.flag[0] = AWAKE
            posted[0] = 0
            return
        if spin is not None:
            timeout = max(0.0, timeout - (time.perf_counter() - started))  # the polling counts
        self.futex.wait(SLEEPING, timeout)
        self.flag[0] = AWAKE
        posted[0] = 0
        if spin is not None:
            spin.waited(time.perf_counter() - started)  # a short wait brings the polling back

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


# The kernel's run queue, or (tests only) a file in its format that a test writes: a host shared
# with other work cannot promise an idle core, and a test of what polling does with one needs it.
LOADAVG = os.environ.get("SHMSERVE_TEST_LOADAVG", "/proc/loadavg")


class RunQueue:
    """Whether this host has an idle core, from the kernel's count of runnable tasks (the fourth
    field of /proc/loadavg, "running/total"), read at most every ``REFRESH_S``.

    A read costs about 4 us, so a poller that asks on every pass pays a small fraction of a
    microsecond per pass amortized. The count includes the reader itself, and in a closed loop of
    one client its partner poller too (the frontend polls while the worker works, and the other
    way round): a core counts as idle while at most ``cores + 1`` tasks are runnable. Any more and
    a task waits for a core that polling would take from it. The count is the whole host's, so it
    is compared with the host's cores (``os.cpu_count``), not this process's affinity.
    """

    REFRESH_S = 0.002

    def __init__(self, path: str = LOADAVG, cores: int | None = None) -> None:
        self.cores = cores or os.cpu_count() or 1
        self._fd = -1
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # no /proc: always idle, as before this check existed
            pass
        self._read_at = -math.inf
        self._idle = True
        self.runnable = 0  # at the last read (0: unknown)

    def idle_core(self) -> bool:
        now = time.perf_counter()
        if now - self._read_at >= self.REFRESH_S:
            self._read_at = now
            self._refresh()
        return self._idle

    def _refresh(self) -> None:
        if self._fd < 0:
            return
        try:
            field = os.pread(self._fd, 128, 0).split()[3]
            self.runnable = int(field[:field.index(b"/")])
        except (OSError, IndexError, ValueError):  # unreadable or malformed: poll as before
            self._idle = True
            return
        self._idle = self.runnable <= self.cores + 1


_run_queue: RunQueue | None = None


def run_queue() -> RunQueue:
    """The process's one reader of the run queue (one descriptor, one cached answer)."""
    global _run_queue
    if _run_queue is None:
        _run_queue = RunQueue()
    return _run_queue


class SpinPolicy:
    """How long to poll before sleeping; every poller uses one (the local client waiting for its
    answer, a worker for its polling client's next request, a frontend's link for its answers).

    Polling saves both sides of a wake-up (the producer's post and the sleeper's return from the
    futex, tens of microseconds each on a VM) when the next record comes within microseconds, as
    in a closed loop of one caller. It pays only then, and only with a core to spare:

    - the budget is ``max_s`` while the running average of recent waits (each counted as at most
      ten times ``max_s``, weight 1/8) is below ``max_s``, and 0 otherwise. An idle receiver stops
      polling after its first long wait, and a closed loop whose waits lie just under ``max_s``
      keeps polling through the one that runs over: halving the budget after each empty poll
      instead cut the next polls below the loop's usual wait, so one late request cost the next
      three their poll (1.5x the p50 of a closed loop of one HTTP client on 2 cores);
    - nobody polls while the run queue says no core is idle (``RunQueue``): with more runnable
      tasks than cores a poller's CPU is CPU that somebody else waits for. The poll stops as soon
      as a refreshed count says so.

    The counters say what polling did, for tests and profiles: ``found`` (polls that found work),
    ``missed`` (polls that gave up), ``busy`` (polls not started or cut short for lack of an idle
    core).
    """

    def __init__(self, max_s: float, queue: RunQueue | None = None) -> None:
        self.max_s = max(0.0, max_s)
        self.average = 0.0  # of recent waits, seconds
        self._queue = queue if queue is not None else run_queue() if self.max_s > 0 else None
        self.found = self.missed = self.busy = 0

    def budget(self) -> float:
        """What the recent waits say a poll may take (seconds), whatever the host's load."""
        return self.max_s if self.average < self.max_s else 0.0

    def allowance(self) -> float:
        """How long to poll now: the budget, or 0 while no core is idle."""
        budget = self.budget()
        if budget <= 0:
            return 0.0
        if not self._queue.idle_core():  # type: ignore[union-attr]
            self.busy += 1
            return 0.0
        return budget

    def idle_core(self) -> bool:
        return self._queue is None or self._queue.idle_core()

    def waited(self, waited_s: float) -> None:
        """Work came after ``waited_s`` (found polling, or after a sleep)."""
        self.average += (min(waited_s, 10 * self.max_s) - self.average) * 0.125

    def gave_up(self) -> None:
        """A poll found nothing within its budget (the wait itself is counted once work comes)."""
        self.missed += 1

    def poll(self, done: Callable[[], bool], started: float, limit: float = math.inf) -> bool:
        """Poll ``done`` within the allowance (and ``limit`` seconds); True once it holds."""
        allowance = self.allowance()
        if allowance <= 0:
            return False
        deadline = started + min(allowance, limit)
        queue = self._queue
        while True:
            if done():
                self.found += 1
                self.waited(time.perf_counter() - started)
                return True
            now = time.perf_counter()
            if now >= deadline:
                if now - started >= allowance:  # (not when the caller's timer ended it)
                    self.gave_up()
                return False
            if not queue.idle_core():  # type: ignore[union-attr]
                self.busy += 1
                return False
            os.sched_yield()


def make_fifo(path: str, readers: tuple[int, ...] = ()) -> int:
    """Create the FIFO (``readers``: other users who may open it, access.py) and open it for
    reading (O_RDWR keeps it from ever reporting EOF)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    os.mkfifo(path, 0o600)
    grant(path, readers)
    return os.open(path, os.O_RDWR | os.O_NONBLOCK)


def open_fifo(path: str, owner: int | None) -> int | None:
    """The FIFO at ``path`` opened for writing, or None. Only a FIFO of ``owner`` (the user of the
    segment it wakes): the path lies in a folder anyone writes, and a client could have put a link
    or another file under its name, which a process of the server's user must never write to."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    st = os.fstat(fd)
    if not stat.S_ISFIFO(st.st_mode) or st.st_uid != (os.geteuid() if owner is None else owner):
        os.close(fd)
        return None
    return fd


def read_all(fd: int) -> None:
    """Empty the FIFO; one read suffices unless it came back full."""
    try:
        while len(os.read(fd, 4096)) == 4096:
            pass
    except BlockingIOError:
        pass
