"""Sleeping on a word of shared memory until another process changes it: Linux's futex.

The receivers of waker.py sleep on their own sleeping flag, not on a POSIX semaphore. A named
semaphore is a file in /dev/shm that every producer must be able to write, and glibc keeps its
state in it (the count, the number of waiters, whether it is process-shared): a client that
zeroes or truncates it (shm/truncation_guard.py) leaves it unable to wake anyone for good. The
flag is rewritten by its receiver before each sleep, so whatever a client writes into it costs
at most one sleep's timeout. A futex on a shared mapping is keyed by file and offset, so every
process that maps the segment waits and wakes on the same word.

Called through ctypes (libc's ``syscall``), which lets go of the GIL while the thread sleeps.
"""
from __future__ import annotations

import ctypes
import errno
import platform

import numpy as np

_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221, "s390x": 238,
              "i686": 240, "i386": 240, "armv7l": 240, "armv8l": 240,
              "riscv64": 98}
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # without FUTEX_PRIVATE_FLAG: between processes


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _syscall() -> tuple[ctypes._CFuncPtr, int]:
    machine = platform.machine().lower()
    if machine not in _SYS_FUTEX:
        raise OSError(errno.ENOSYS, f"shmserve knows no futex system call number for {machine}")
    call = ctypes.CDLL(None, use_errno=True).syscall
    call.restype = ctypes.c_long
    # No argtypes: converting each argument through them costs more than the system call. Every
    # argument is then given as a ctypes object or a small int (which goes as a C int).
    return call, _SYS_FUTEX[machine]


_call, _NR = _syscall()


class FutexWord:
    """One 32-bit word of a mapping to sleep on and to wake its sleeper through. The mapping
    must outlive this object (a waker's segment does: its flag view holds it)."""

    def __init__(self, buf: memoryview, offset: int) -> None:
        self._address = ctypes.c_void_p(int(np.frombuffer(buf, dtype=np.uint8, count=1, offset=offset).ctypes.data))
        self._timeout = _Timespec()
        self._timeout_ref = ctypes.byref(self._timeout)

    def wait(self, expected: int, timeout: float) -> None:
        """Sleep while the word holds ``expected``, at most ``timeout`` seconds; returns at once
        when it holds something else, and on a wake, a signal or the timeout alike."""
        if timeout > 1e9:  # (and infinity): no timeout
            _call(_NR, self._address, FUTEX_WAIT, expected, None, None, 0)
            return
        timeout = max(0.0, timeout)
        whole = int(timeout)
        self._timeout.tv_sec = whole
        self._timeout.tv_nsec = int((timeout - whole) * 1e9)
        _call(_NR, self._address, FUTEX_WAIT, expected, self._timeout_ref, None, 0)

    def wake(self) -> None:
        """Wake the word's sleeper, if any (one: each word has one receiver)."""
        _call(_NR, self._address, FUTEX_WAKE, 1, None, None, 0)
