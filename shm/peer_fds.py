"""Writing to a socket another process of this server holds open (Linux ``pidfd_getfd``).

The HTTP frontend lets a worker write a small answer straight to the client's socket: the
frontend then neither wakes for the answer nor copies it (see ``docs/architecture.md``, "Direct
HTTP answers"). The worker borrows the socket for the one write: ``pidfd_getfd`` duplicates the
frontend's descriptor, the duplicate is checked to be the very socket the request came on (its
inode; the number may have been reused by a later connection), written to without blocking,
and closed at once, so that the frontend alone decides when the connection ends.

Borrowing needs the right to trace the holder: the same user, and under Yama's ptrace scope 1
the holder's leave (``allow_tracing_by``). Where it is refused (seccomp, other users, kernels
before 5.6), ``write`` answers -1 and the answer goes the usual way.

The borrow, check, send and close are one call of the C helper ``shm._peer_send`` where it was
built (2 us less of the worker's time per answer than the same steps through ctypes and ``os``);
an install without extensions (SHMSERVE_PURE_PYTHON=1) takes the ctypes path.
"""
from __future__ import annotations

import ctypes
import errno
import os

try:
    from shm._peer_send import send_borrowed
except ImportError:  # a plain-Python install (setup.py)
    send_borrowed = None

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
    """The descriptors of peer processes, borrowed one write at a time."""

    def __init__(self) -> None:
        self._pidfds: dict[int, int] = {}  # pid -> its pidfd, or -1: borrowing from it was refused

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
        if send_borrowed is not None:
            pidfd = self._pidfd(pid)
            if pidfd < 0:
                return -1
            sent = send_borrowed(pidfd, fd, ino, data)  # < 0: -errno of pidfd_getfd
            if sent >= 0:
                return sent
            return -1 if self._failed(pid, -sent) == -2 else 0
        dup = self.borrow(pid, fd, ino)
        if dup < 0:
            return -1 if dup == -2 else 0
        try:
            # < 0: EAGAIN (its buffer is full), EPIPE/ECONNRESET (the client left)
            return max(0, _send(dup, data, len(data), _SEND_FLAGS))
        finally:
            os.close(dup)

    def forget(self, pid: int) -> None:
        pidfd = self._pidfds.pop(pid, None)
        if pidfd is not None and pidfd >= 0:
            os.close(pidfd)

    def close(self) -> None:
        for pid in list(self._pidfds):
            self.forget(pid)
