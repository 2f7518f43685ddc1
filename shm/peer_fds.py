"""Writing to a socket another process of this server holds open (Linux ``pidfd_getfd``).

The HTTP frontend lets a worker write a small answer straight to the client's socket: the
frontend then neither wakes for the answer nor copies it (see ``docs/architecture.md``, "Direct
HTTP answers"). The worker borrows the socket: ``pidfd_getfd`` duplicates the frontend's
descriptor, and the duplicate is checked to be the very socket the request came on (its inode;
the number may have been reused by a later connection). It keeps the duplicate for the
connection's next answers, which are then one non-blocking ``send`` each, but for at most
``HOLD_S``: a socket a worker holds stays open after the frontend closes it, so the frontend's
close reaches the client up to that late (an idle connection, closed after the keep-alive
timeout, was given back long before).

Borrowing needs the right to trace the holder: the same user, and under Yama's ptrace scope 1
the holder's leave (``allow_tracing_by``). Where it is refused (seccomp, other users, kernels
before 5.6), ``write`` answers -1 and the answer goes the usual way.

The borrow (with its check) and the send are C calls of the helper ``shm._peer_send`` where it
was built; an install without extensions (SHMSERVE_PURE_PYTHON=1) takes the ctypes path.
"""
from __future__ import annotations

import ctypes
import errno
import math
import os
import time

try:
    from shmserve.shm._peer_send import borrow as c_borrow
    from shmserve.shm._peer_send import send_now as c_send_now
except ImportError:  # a plain-Python install (setup.py)
    c_borrow = c_send_now = None

HOLD_S = 0.1  # how long a worker keeps a borrowed socket (``PeerSockets.release_due``)
_PIDFD_GETFD = 438  # Linux 5.6+, on the architectures with the common syscall table (x86-64, arm64, ...)
_PR_SET_PTRACER = 0x59616D61
_SEND_FLAGS = 0x40 | 0x4000  # MSG_DONTWAIT | MSG_NOSIGNAL: never block, never SIGPIPE
_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_send = _libc.send
_send.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int)
_send.restype = ctypes.c_ssize_t


def allow_tracing_by(pid: int) -> bool:
    """Let ``pid`` and its descendants (the broker and its workers) borrow our descriptors under
    Yama's ptrace scope 1; a no-op elsewhere. False if it was refused."""
    try:
        return _libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0) == 0 or ctypes.get_errno() == errno.EINVAL
    except (AttributeError, OSError):
        return False


class PeerSockets:
    """The sockets of peer processes, borrowed and kept for a while."""

    def __init__(self) -> None:
        self._pidfds: dict[int, int] = {}  # pid -> its pidfd, or -1: borrowing from it was refused
        self._held: dict[tuple[int, int], tuple[int, int]] = {}  # (pid, fd) -> (our duplicate, its inode)
        self._held_since = 0.0  # monotonic time of the first borrow since the last release

    def _pidfd(self, pid: int) -> int:
        """``pid``'s pidfd, opened once; -1 if borrowing from it is refused."""
        pidfd = self._pidfds.get(pid)
        if pidfd is None:
            try:
                pidfd = os.pidfd_open(pid)
            except (OSError, AttributeError):
                pidfd = -1
            self._pidfds[pid] = pidfd
        return pidfd

    def _failed(self, pid: int, code: int) -> int:
        """-2 if ``pidfd_getfd``'s error ``code`` refuses borrowing from ``pid`` (remembered), else -1."""
        if code in (errno.EPERM, errno.ENOSYS, errno.EACCES, errno.ESRCH):
            self.forget(pid)
            if code != errno.ESRCH:
                self._pidfds[pid] = -1  # refused: never again for this process
                return -2
        return -1

    def borrow(self, pid: int, fd: int, ino: int) -> int:
        """A duplicate of ``pid``'s descriptor ``fd`` if it still is the socket with inode ``ino``
        (close it after use); -1 if it is not, -2 if borrowing from ``pid`` is refused."""
        pidfd = self._pidfd(pid)
        if pidfd < 0:
            return -2
        if c_borrow is not None:
            dup = c_borrow(pidfd, fd, ino)
            return dup if dup >= 0 else -1 if dup == -errno.ESTALE else self._failed(pid, -dup)
        dup = _syscall(_PIDFD_GETFD, pidfd, fd, 0)
        if dup < 0:
            return self._failed(pid, ctypes.get_errno())
        try:
            if os.fstat(dup).st_ino == ino:
                return dup
        except OSError:
            pass
        os.close(dup)
        return -1

    def write(self, pid: int, fd: int, ino: int, data: bytes) -> int:
        """Bytes of ``data`` written to the peer's socket without blocking: 0 if none (a full
        buffer, a client gone, the descriptor another socket's by now), -1 if borrowing is refused."""
        key = (pid, fd)
        held = self._held.get(key)
        if held is None or held[1] != ino:
            dup = self.borrow(pid, fd, ino)
            if dup < 0:
                return -1 if dup == -2 else 0
            if held is not None:
                os.close(held[0])  # the number names a later connection now
            elif not self._held:
                self._held_since = time.monotonic()
            held = self._held[key] = (dup, ino)
        if c_send_now is not None:
            return c_send_now(held[0], data)
        # < 0: EAGAIN (its buffer is full), EPIPE/ECONNRESET (the client left)
        return max(0, _send(held[0], data, len(data), _SEND_FLAGS))

    def release_due(self, now: float) -> float:
        """Give back the sockets held for ``HOLD_S`` or longer; returns the seconds until the next
        release is due (``math.inf`` when nothing is held), for the caller's sleep."""
        if not self._held:
            return math.inf
        if now - self._held_since < HOLD_S:
            return HOLD_S - (now - self._held_since)
        self._release(list(self._held))
        return math.inf

    def _release(self, keys: list[tuple[int, int]]) -> None:
        for key in keys:
            dup, _ = self._held.pop(key)
            os.close(dup)

    def forget(self, pid: int) -> None:
        self._release([key for key in self._held if key[0] == pid])
        pidfd = self._pidfds.pop(pid, None)
        if pidfd is not None and pidfd >= 0:
            os.close(pidfd)

    def close(self) -> None:
        self._release(list(self._held))
        for pid in list(self._pidfds):
            self.forget(pid)
