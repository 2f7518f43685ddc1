"""The launcher as the server's child subreaper (Linux's ``PR_SET_CHILD_SUBREAPER``): a process
whose parent dies is given to the launcher rather than to init.

A worker whose broker died gets SIGTERM (``shmserve/parent_death.py``) and exits within its
grace (``workers/worker.py`` ``ORPHAN_GRACE_S``). One that cannot act on it (a stopped process, a
model stuck in C code that never returns to the interpreter) would otherwise live on, holding
the server's shared memory and maybe a GPU's, after the broker that owned it was replaced, and
after the whole server stopped. The launcher reaps whatever it adopts (a model's own
subprocesses too, once their worker died) and kills a worker of its server still alive
``KILL_AFTER_S`` after it was adopted, or when the server stops.
"""
from __future__ import annotations

import logging
import os
import signal
import time

from shmserve.shm.names import title_of

log = logging.getLogger("shmserve.launcher")

PR_SET_CHILD_SUBREAPER = 36
KILL_AFTER_S = 10.0  # past a worker's own grace after its broker died


def become_subreaper() -> bool:
    """Adopt this process's orphaned descendants; False where the kernel has no such thing, or
    does not list a process's children in /proc (what it adopted could then not be reaped: init
    or the container's tini keeps reaping orphans instead)."""
    if not os.access(f"/proc/self/task/{os.getpid()}/children", os.R_OK):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1) == 0
    except (OSError, AttributeError):
        return False


def _children() -> set[int]:
    """This process's children, from /proc (each thread's list: a child belongs to the thread
    that made it); empty where /proc does not list them."""
    out: set[int] = set()
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                out.update(int(pid) for pid in f.read().split())
    except OSError:
        pass
    return out


def _reaped(pid: int) -> bool:
    """Whether the child ``pid`` has exited (it is reaped now) or is no child of ours any more."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:
        return True


class Adopted:
    """The launcher's adopted children: reaped when they exit, killed when they are workers of
    this server that outlived their broker."""

    def __init__(self, server_id: str) -> None:
        self.server_id = server_id
        self.since: dict[int, float] = {}  # pid -> when it was first seen adopted
        self.looked: set[int] = set()  # those looked at once their time was up (killed, or not a worker)

    def _worker(self, pid: int) -> str:
        """The title of ``pid`` if it is a worker of this server (``workers/__main__.py``)."""
        title = title_of(pid)
        return title if title.startswith("shmserve worker ") and title.endswith(f"(server {self.server_id})") else ""

    def check(self, own: set[int]) -> None:
        """Reap adopted children that exited; kill a worker adopted ``KILL_AFTER_S`` ago. ``own``:
        the launcher's own children (``subprocess.Popen`` reaps those)."""
        now = time.monotonic()
        adopted = _children() - own
        gone: set[int] = set()
        for pid in adopted:
            if _reaped(pid):
                gone.add(pid)
                continue
            first = self.since.setdefault(pid, now)
            if now - first >= KILL_AFTER_S and pid not in self.looked:
                self.looked.add(pid)
                title = self._worker(pid)
                if title:
                    log.warning("%s (pid %d) outlived its parent by %.0f s (a worker whose broker died, stopped "
                                "or stuck where its SIGTERM cannot reach it; or a process its model forked): "
                                "killed", title, pid, now - first)
                    self._kill(pid)  # (reaped at the next check)
        for pid in list(self.since):
            if pid not in adopted or pid in gone:
                self.since.pop(pid, None)
                self.looked.discard(pid)

    def kill_workers(self, own: set[int], wait_s: float = 5.0) -> None:
        """At the server's stop: kill every adopted worker of this server left, and reap them
        (for up to ``wait_s``: one in an uninterruptible wait, a hung driver call, dies later)."""
        killed = set()
        for pid in _children() - own:
            title = self._worker(pid)
            if title:
                log.warning("%s (pid %d) outlived its parent: killed as the server stops", title, pid)
                self._kill(pid)
                killed.add(pid)
        deadline = time.monotonic() + wait_s
        while killed and time.monotonic() < deadline:
            killed = {pid for pid in killed if not _reaped(pid)}
            if killed:
                time.sleep(0.02)

    @staticmethod
    def _kill(pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
