"""Shared memory this process maps survives its truncation by another process.

A user named by ``--local-client-users`` may write some objects the server's processes map (its
own segment, ``broker.0``, a ``worker.<n>``, the extents of their arenas), so it may also
``ftruncate`` them, and the next touch of a lost page would be a SIGBUS that ends the broker or a
worker. POSIX shared memory
cannot be sealed against that; ``truncation_guard.c`` (a SIGBUS handler, loaded with ctypes) grows
each guarded file back to its size instead, and the touch goes on over a zero page. A truncation
then only zeroes the end of an object, as its writer could anyway, and readers check what they read.
Where the writer has also filled /dev/shm, so that a page it gave back cannot be had again, the
page is replaced by a private zero page of this process, and the object's page is put back by the
periodic ``restore`` once there is room (for a ``Segment``, which says when it unmaps).

``guard_mapping`` registers a mapping of an object another user may write (``Segment`` asks for
each one it makes); the library is built from the C file when the package is installed
(setuptools, an optional extension: no compiler, no guard, and ``available()`` says so).
"""
from __future__ import annotations

import ctypes
import errno
import importlib.util
import logging
import mmap
import os
import threading
import weakref
from typing import Callable

import numpy as np

from .access import writable_by_others

log = logging.getLogger("shmserve.shm")

_LIBRARY = f"{__package__}._truncation_guard"


def _load() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec(_LIBRARY)
    if spec is None or spec.origin is None:
        return None
    lib = ctypes.CDLL(spec.origin)
    lib.guard_install.restype = ctypes.c_int
    lib.guard_add.argtypes = (ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int)
    lib.guard_add.restype = ctypes.c_int
    lib.guard_close.argtypes = (ctypes.c_int,)
    lib.guard_close.restype = None
    lib.guard_remove.argtypes = (ctypes.c_int,)
    lib.guard_remove.restype = None
    lib.guard_zeroed.argtypes = (ctypes.c_int,)
    lib.guard_zeroed.restype = ctypes.c_int
    lib.guard_shrunk.argtypes = (ctypes.c_int,)
    lib.guard_shrunk.restype = ctypes.c_int
    lib.guard_regrown.restype = ctypes.c_ulong
    lib.guard_replaced.restype = ctypes.c_ulong
    lib.guard_restored.restype = ctypes.c_ulong
    lib.guard_waiting.restype = ctypes.c_int
    lib.guard_restore.restype = ctypes.c_int
    return lib


_lib = _load()
_RESTORABLE, _ZEROED = 1, 2  # guard_add's mode bits (GUARD_* in the C file)
_install_lock = threading.Lock()
_installed = False
_failure_said = False


def available() -> bool:
    """Whether the handler could be built when the package was installed (a C compiler)."""
    return _lib is not None


def regrown() -> int:
    """How many times this process grew a truncated object back (0 without the library)."""
    return int(_lib.guard_regrown()) if _lib is not None else 0


def replaced() -> int:
    """How many pages /dev/shm had no room for this process replaced by private zero pages."""
    return int(_lib.guard_replaced()) if _lib is not None else 0


def restored() -> int:
    """How many of the replaced pages were put back (the object's own again)."""
    return int(_lib.guard_restored()) if _lib is not None else 0


def restore() -> int:
    """Grow back now every guarded file found shorter than its size (a process's periodic check:
    an object must be whole for whoever maps it next, not only when this process touches it),
    and put back the object's pages that were replaced where there is room again; how many
    files were grown back."""
    return int(_lib.guard_restore()) if _lib is not None and _installed else 0


def waiting() -> int:
    """How many replaced pages wait for room to be put back: what this process and the others
    write there meanwhile misses the other side, wake-ups included, so a process that looks
    seldom looks each second until then."""
    return int(_lib.guard_waiting()) if _lib is not None else 0


class Repairs:
    """What the guard undid in this process since the last look, for a periodic log line."""

    def __init__(self) -> None:
        self._seen = (regrown(), replaced(), restored())

    def since_last(self) -> list[str]:
        """Restore what is shrunk or replaced now; what was undone since the last call, in words
        (empty when nothing was)."""
        restore()
        now = (regrown(), replaced(), restored())
        grown, swapped, back = (a - b for a, b in zip(now, self._seen))
        self._seen = now
        said = [f"{grown} truncated object(s) grown back"] if grown else []
        if swapped:
            said.append(f"{swapped} page(s) /dev/shm had no room for replaced by private zero pages")
        if back:
            said.append(f"{back} replaced page(s) put back")
        return said


class Guard:
    """One guarded file: grown back to ``size`` on a SIGBUS while this lives (or until ``release``)."""

    def __init__(self, slot: int) -> None:
        self._slot = slot

    @property
    def zeroed(self) -> bool:
        """Whether a truncation met replaced the mapping by zero pages (a guard made to zero)."""
        return self._slot >= 0 and _lib is not None and bool(_lib.guard_zeroed(self._slot))

    @property
    def shrunk(self) -> bool:
        """Whether the file is shorter now than when guarded."""
        return self._slot >= 0 and _lib is not None and bool(_lib.guard_shrunk(self._slot))

    def closing(self) -> None:
        """The mapping is about to be unmapped: its address range may be another mapping's soon,
        so no replaced page of it is put back from now on."""
        if self._slot >= 0 and _lib is not None:
            _lib.guard_close(self._slot)

    def release(self) -> None:
        slot, self._slot = self._slot, -1
        if slot >= 0 and _lib is not None:
            _lib.guard_remove(slot)

    def __del__(self) -> None:
        self.release()


def _guard_fd(fd: int, size: int, start: int, prot: int, flags: int, mode: int) -> Guard | None:
    """Guard the file open as ``fd`` (which must be open for writing) at ``size`` bytes, mapped at
    ``start`` with ``prot`` and ``flags``; the library keeps its own duplicate of ``fd``. None
    without the library, or when the guard cannot be had (said once: out of descriptors, or 16384
    guarded)."""
    global _installed, _failure_said
    if _lib is None or size <= 0:
        return None
    if not _installed:
        with _install_lock:
            if not _installed:
                failed = _lib.guard_install()
                if failed:
                    raise OSError(failed, f"cannot install the SIGBUS handler: {os.strerror(failed)}")
                _installed = True
    slot = _lib.guard_add(fd, size, ctypes.c_void_p(start), prot, flags, mode)
    if slot < 0:
        if not _failure_said:
            _failure_said = True
            why = "16384 are guarded already" if -slot == errno.ENOSPC else os.strerror(-slot)
            log.warning("a shared-memory object is mapped without its truncation guard (%s): a client that "
                        "truncates it ends this process", why)
        return None
    return Guard(slot)


def others_may_write(fd: int) -> bool:
    """Whether a user besides this process's may write (and so truncate) the object open as
    ``fd``: its owner is another user, its mode lets group or others write, or its ACL names a
    user who may (``--local-client-users``). Only those are guarded: each guard holds a descriptor."""
    st = os.fstat(fd)
    return st.st_uid != os.geteuid() or bool(st.st_mode & 0o022) or writable_by_others(fd)


class MappingGuard:
    """The guard of one mapping (``guard_mapping``), or none where nobody else may write the file."""

    def __init__(self, guard: Guard | None = None, release: Callable[[], None] = lambda: None) -> None:
        self._guard = guard
        self.release = release  # ends the guard at once (after the unmap)

    @property
    def guarded(self) -> bool:
        return self._guard is not None

    @property
    def zeroed(self) -> bool:
        """``guard_mapping(..., zero=True)``: whether a truncation met replaced the whole mapping by
        zero pages, so that what was copied from or into it since is not the object's."""
        return self._guard is not None and self._guard.zeroed

    @property
    def truncated(self) -> bool:
        """``zeroed``, or (a truncation no touch met yet) the file is shorter than when mapped."""
        return self._guard is not None and (self._guard.zeroed or self._guard.shrunk)

    def closing(self) -> None:
        """Say before unmapping: no page is put back into the range from now on."""
        if self._guard is not None:
            self._guard.closing()


def guard_mapping(mm: mmap.mmap, fd: int, size: int, shared: bool = True, restorable: bool = False,
                  always: bool = False, required: bool = False, zero: bool = False) -> MappingGuard:
    """Guard the file behind ``mm`` (mapped for writing, ``shared`` or private) while the
    mapping lives, if another user may write it (``always``: whoever may: a client's registered
    region, which its owner may truncate even when that is the server's user); ``restorable``:
    the caller calls ``closing`` before it unmaps, so a replaced page may be put back. The
    guard's ``release`` ends it at once (once ``mm`` is closed: a mapping a view keeps alive
    stays guarded until it dies). ``required``: OSError rather than an unguarded mapping when the
    library is there but the guard cannot be had (a client's segment: better one client refused
    than the process's end). ``zero``: a truncation is not grown back, at a
    fault or by ``restore``; at a fault the whole mapping is replaced by zero pages instead
    (``MappingGuard.zeroed``), for an object only its client's own requests use (a region, the
    client's segment): grown back page by page, a copy racing a truncation in a loop took a fault
    per page, each waiting on the truncating process. Such an object is guarded whoever may write
    it: a client of the server's own user truncating its segment killed the broker too."""
    if _lib is None or not (always or zero or others_may_write(fd)):
        return MappingGuard()
    start = int(np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data)
    flags = mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE
    mode = (_RESTORABLE if restorable else 0) | (_ZEROED if zero else 0)
    guard = _guard_fd(fd, size, start, mmap.PROT_READ | mmap.PROT_WRITE, flags, mode)
    if guard is None:
        if required:
            raise OSError(errno.EMFILE, "its truncation guard cannot be had (out of descriptors, or 16384 guarded)")
        return MappingGuard()
    return MappingGuard(guard, weakref.finalize(mm, guard.release))
