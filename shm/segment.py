"""A named POSIX shared-memory segment mapped into this process, and a cache of mappings.

Mappings are made with ``mmap`` over the descriptor posix_ipc opens; numpy views are taken over
``Segment.buf`` so tensor bytes are never copied to cross a process boundary.
"""
from __future__ import annotations

import mmap
import os
import threading
from collections import OrderedDict

import posix_ipc

from .names import unlink_shm


class StaleRegion(ValueError):
    """A client's region changed under a request: replaced by another object, or truncated."""


class Segment:
    """One mapped segment. ``create`` owns the name (and unlinks it); ``attach`` only maps it."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, owner: bool, ino: int = 0, fd: int = -1) -> None:
        self.name = name
        self.size = size
        self.ino = ino  # identifies the object: a new object under an old name has another inode
        self._mmap = mm
        self.buf = memoryview(mm)
        self.owner = owner
        self._fd = fd  # kept for client regions: their owner may shrink them under us

    def read(self, start: int, end: int) -> bytes:
        """A copy of the bytes from ``start`` to ``end``: one step through the map (a slice of
        ``buf`` and ``bytes`` of that are two, and took twice as long)."""
        return self._mmap[start:end]

    def check_extent(self, end: int) -> None:
        """Refuse to touch bytes past the object's current end: the mapping is still there, but
        touching a page the object no longer has kills the process with SIGBUS."""
        if self._fd >= 0 and os.fstat(self._fd).st_size < end:
            raise StaleRegion(f"shared memory region '{self.name}' was truncated since it was registered "
                              f"(the request uses bytes up to {end}); register it again")

    @classmethod
    def create(cls, name: str, size: int) -> "Segment":
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
        try:
            mm = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        return cls(name, size, mm, owner=True)

    @classmethod
    def create_anew(cls, name: str, size: int) -> "Segment":
        """``create``, after removing an object of that name a crashed predecessor left."""
        unlink_shm(name)
        return cls.create(name, size)

    @classmethod
    def attach(cls, name: str, readonly: bool = False, keep_fd: bool = False) -> "Segment":
        shm = posix_ipc.SharedMemory(name, flags=0, read_only=readonly)
        try:
            st = os.fstat(shm.fd)
            access = mmap.ACCESS_READ if readonly else mmap.ACCESS_WRITE
            mm = mmap.mmap(shm.fd, st.st_size, access=access)
        except BaseException:
            shm.close_fd()
            raise
        if not keep_fd:
            shm.close_fd()
        return cls(name, st.st_size, mm, owner=False, ino=st.st_ino, fd=shm.fd if keep_fd else -1)

    def close(self) -> None:
        """Unmap; views still alive keep the mapping until they die (BufferError is expected)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            self.buf.release()
            self._mmap.close()
        except BufferError:
            pass

    def unlink(self) -> None:
        unlink_shm(self.name)


class SegmentCache:
    """Lazily attached segments by name, bounded so long-lived processes do not hoard mappings."""

    def __init__(self, limit: int = 256) -> None:
        self._items: OrderedDict[str, Segment] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()

    def get(self, name: str, ino: int = 0, end: int = 0) -> Segment:
        """The mapping of ``name``; with ``ino`` (a registered region), re-mapped if the name now
        names another object (unlinked, created again, registered anew), and checked to still
        hold ``end`` bytes."""
        seg = self._items.get(name)
        if seg is not None and (not ino or seg.ino == ino):
            if ino:
                seg.check_extent(end)
            return seg
        with self._lock:
            seg = self._items.get(name)
            if seg is not None and ino and seg.ino != ino:
                self._items.pop(name).close()
                seg = None
            if seg is None:
                seg = Segment.attach(name, keep_fd=bool(ino))
                self._items[name] = seg
                while len(self._items) > self._limit:
                    _, old = self._items.popitem(last=False)
                    old.close()
            if ino and seg.ino != ino:
                raise StaleRegion(f"shared memory region '{name}' was replaced since it was registered; "
                                  f"register it again")
            if ino:
                seg.check_extent(end)
            return seg

    def drop(self, name: str) -> None:
        with self._lock:
            seg = self._items.pop(name, None)
        if seg is not None:
            seg.close()

    def drop_unlinked(self, prefix: str) -> None:
        """Unmap the segments named ``prefix...`` whose object is gone from /dev/shm (a client
        that left unlinks its segment), so their memory is not pinned here."""
        with self._lock:
            gone = [n for n in self._items if n.startswith(prefix) and not os.path.exists("/dev/shm" + n)]
            segs = [self._items.pop(n) for n in gone]
        for seg in segs:
            seg.close()

    def clear(self) -> None:
        with self._lock:
            items = list(self._items.values())
            self._items.clear()
        for seg in items:
            seg.close()
