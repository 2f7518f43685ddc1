"""Reading and writing a client's registered system region through its file descriptor.

A client may ``ftruncate`` its region at any moment. Touching a mapped page past the new end of
a tmpfs object raises SIGBUS, which no Python code survives, and any check of the size before
the touch races with the next truncation. ``pread``/``pwrite`` on a descriptor cannot fault: a
read past the end comes back short, so the request fails and its process serves on. So no
process of the server maps a client's region: inputs are read with ``preadv`` into memory of
the reader's own (a copy, where a mapping gave a view), outputs written with ``pwrite``, and
nothing keeps a size the object no longer has.

A file is opened by key and kept while its inode is the one the broker registered: a region
registered again (a new inode published) is opened anew, and a key that now names another
object than the registered one (or none) is refused at each request, never followed (nobody
checked that object) nor silently served from the old one kept open.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import posix_ipc

from .names import SHM_DIR


class StaleRegion(ValueError):
    """A client's region changed under a request: replaced by another object, or truncated (a 400)."""


def _shown(key: str, region: str | None) -> str:
    return f"shared memory region '{region}'" if region else f"shared memory object '{key}'"


def _check_still_named(key: str, ino: int, region: str | None) -> None:
    """Refuse a region whose key names another object than the one registered, or none."""
    try:
        found = os.stat(SHM_DIR + key).st_ino
    except FileNotFoundError:
        raise StaleRegion(f"{_shown(key, region)} was removed since it was registered (no object '{key}' "
                          f"exists now)") from None
    if found != ino:
        raise StaleRegion(_replaced(key, region))


def _replaced(key: str, region: str | None) -> str:
    return (f"{_shown(key, region)} was replaced since it was registered (its key '{key}' names another "
            f"object now); register it again")


def output_room_text(name: str, room: int, needed: int) -> str:
    """Triton's refusal of an output larger than the room its request gave it in a region."""
    return (f"shared memory size specified with the request for output '{name}' ({room} bytes) should be at "
            f"least {needed} bytes to hold the results")


class RegionFile:
    """One registered region's object, open for reading and writing at offsets."""

    __slots__ = ("key", "ino", "fd")  # the descriptor is closed when the last holder lets go

    def __init__(self, key: str, ino: int, fd: int) -> None:
        self.key = key
        self.ino = ino
        self.fd = fd

    @classmethod
    def open(cls, key: str, ino: int, region: str | None = None) -> "RegionFile":
        """Open ``key``, refusing it unless it is still the object registered (inode ``ino``)."""
        shm = posix_ipc.SharedMemory(key, flags=0)
        fd = shm.fd
        try:
            found = os.fstat(fd).st_ino
        except BaseException:
            os.close(fd)
            raise
        if found != ino:
            os.close(fd)
            raise StaleRegion(_replaced(key, region))
        return cls(key, ino, fd)

    def read(self, off: int, size: int, region: str | None = None) -> np.ndarray:
        """The ``size`` bytes at ``off``, in a new array of this process's own."""
        out = np.empty(size, dtype=np.uint8)
        self.read_into(memoryview(out), off, region)  # type: ignore[arg-type] # (numpy's stubs lack Buffer)
        return out

    def read_into(self, dst: memoryview, off: int, region: str | None = None) -> None:
        """Fill ``dst`` from ``off``; StaleRegion if the object ends before."""
        done, n = 0, len(dst)
        while done < n:
            got = os.preadv(self.fd, [dst[done:]], off + done)
            if got <= 0:
                self._truncated(off + n, region)
            done += got

    def write(self, off: int, data: Any, region: str | None = None) -> None:
        """Write ``data`` (any contiguous buffer) at ``off``. The object's end is checked first, so
        a truncated region is refused rather than grown back (a truncation racing the write can
        still be undone by it, up to the registered size: that costs only its own client)."""
        src = memoryview(data).cast("B")
        n = len(src)
        if os.fstat(self.fd).st_size < off + n:
            self._truncated(off + n, region)
        done = 0
        while done < n:
            wrote = os.pwrite(self.fd, src[done:], off + done)
            if wrote <= 0:
                raise OSError(f"could not write into {_shown(self.key, region)}")
            done += wrote

    def _truncated(self, end: int, region: str | None) -> None:
        size = os.fstat(self.fd).st_size
        raise StaleRegion(f"{_shown(self.key, region)} was truncated since it was registered: the request uses "
                          f"bytes up to {end} of '{self.key}', which holds {size} now; register it again")

    def __del__(self) -> None:
        # Closed only once nothing holds it: a thread still reading through a file that another
        # one dropped must not find its descriptor number reused for something else.
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class RegionFiles:
    """The registered regions' files this process has opened, by key, bounded in number."""

    def __init__(self, limit: int = 256) -> None:
        self._items: OrderedDict[str, RegionFile] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()  # model threads (stream senders) place outputs too

    def get(self, key: str, ino: int, region: str | None = None) -> RegionFile:
        """The open object of ``key`` registered with inode ``ino``; opened anew when the region
        was registered again (another inode)."""
        f = self._items.get(key)
        if f is not None and f.ino == ino:
            _check_still_named(key, ino, region)  # not the object kept open, once the key names another
            return f
        with self._lock:
            f = self._items.get(key)
            if f is None or f.ino != ino:
                f = RegionFile.open(key, ino, region)
                self._items[key] = f  # (the file it replaces closes once no thread uses it)
                while len(self._items) > self._limit:
                    self._items.popitem(last=False)
            return f

    def read(self, t: dict) -> np.ndarray:
        """A private copy of the bytes of entry tensor ``t`` (``seg``, ``ino``, ``off``, ``size``)."""
        return self.get(t["seg"], t["ino"], t.get("region")).read(t["off"], t["size"], t.get("region"))

    def write(self, t: dict, data: Any) -> None:
        """Write ``data`` where entry tensor ``t`` says (an output placed in a region)."""
        self.get(t["seg"], t["ino"], t.get("region")).write(t["off"], data, t.get("region"))

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
