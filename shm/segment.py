"""A named POSIX shared-memory segment mapped into this process, and a cache of mappings.

Mappings are made with ``mmap`` over the descriptor posix_ipc opens; numpy views are taken over
``Segment.buf`` so tensor bytes are never copied to cross a process boundary. A client's
registered region is mapped apart, under the truncation guard, and copied (``region_io.py``).

A tmpfs page is taken when it is first touched, and a touch that finds /dev/shm full is a SIGBUS
that kills the process, whoever filled it (space.py counts the server's own objects, not
another program's). So no page is touched before it is taken with ``populate``: a segment's
fixed parts (headers, rings, slots, tables) when it is made, an arena's pages as its head first
reaches them (arena.py). A full /dev/shm is then an error where the page was wanted (a 503, a
refused load, a client's exception), never a signal.
"""
from __future__ import annotations

import mmap
import os
import threading
from collections import OrderedDict
from typing import Callable

import posix_ipc

from .access import grant, other_writers
from .names import is_client_segment, unlink_shm
from .region_io import RegionFiles
from .space import HOW_TO_RAISE, NoRoom, mib, take_pages
from .truncation_guard import MappingGuard, guard_mapping


class Segment:
    """One mapped segment. ``create`` owns the name (and unlinks it); ``attach`` only maps it."""

    def __init__(self, name: str, size: int, mm: mmap.mmap, owner: bool, uid: int = -1,
                 guard: MappingGuard | None = None) -> None:
        self.name = name
        self.size = size
        self.uid = uid if uid >= 0 else os.geteuid()  # the object's owner, as fstat said when mapped
        self._mmap = mm
        self.buf = memoryview(mm)
        self.owner = owner
        self.closed = False  # close() was called: ``buf`` may be released, ``view`` may fail
        self._guard = guard or MappingGuard()  # the file's truncation guard (truncation_guard.py)

    def view(self) -> memoryview:
        """A view of the whole mapping that stays valid after ``close`` (which then leaves the
        mapping in place until the view dies): for an answer a caller may still be reading when
        the segment is dropped from a cache. ValueError once the mapping is gone."""
        return memoryview(self._mmap)

    def populate(self, start: int, end: int) -> bool:
        """Take the tmpfs pages of bytes ``start`` to ``end`` now, before anything is written there;
        False when /dev/shm has no room for them (module docstring). Pages taken already cost a
        walk of their page tables, a few microseconds a MiB."""
        return take_pages(self._mmap, self.name, start, min(end, self.size))

    def read(self, start: int, end: int) -> bytes:
        """A copy of the bytes from ``start`` to ``end``: one step through the map (a slice of
        ``buf`` and ``bytes`` of that are two, and took twice as long)."""
        return self._mmap[start:end]

    @classmethod
    def create(cls, name: str, size: int, readers: tuple[int, ...] = (), readers_write: bool = True,
               taken: int | None = None) -> "Segment":
        """A new segment of mode 0600 that ``readers`` (other users, access.py) may open too
        (only for reading, without ``readers_write``), its first ``taken`` bytes populated (all
        by default; an arena's start where one follows). NoRoom where /dev/shm cannot hold those."""
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
        try:
            mm = mmap.mmap(shm.fd, size)
            seg = cls(name, size, mm, owner=True)
            eager = size if taken is None else taken
            if not seg.populate(0, eager):
                seg.close()
                raise NoRoom(f"/dev/shm is full: {name} could not take the {mib(eager)} it starts with; "
                             f"{HOW_TO_RAISE}")
            # Only now may readers open it: one that truncated it while its pages were taken made
            # that look like a full /dev/shm. Guarded once they may (truncation_guard.py).
            grant(shm.fd, readers, readers_write)
            seg._guard = guard_mapping(mm, shm.fd, size, restorable=True)
        except BaseException:
            shm.close_fd()
            shm.unlink()
            raise
        shm.close_fd()
        return seg

    @classmethod
    def create_anew(cls, name: str, size: int, readers: tuple[int, ...] = (), taken: int | None = None) -> "Segment":
        """``create``, after removing an object of that name a crashed predecessor left. One
        the server may not remove (another user's, in a sticky /dev/shm; a directory) stays, and
        creating raises ``posix_ipc.ExistentialError``."""
        try:
            unlink_shm(name)
        except (OSError, posix_ipc.Error):
            pass
        return cls.create(name, size, readers, taken=taken)

    @property
    def zeroed(self) -> bool:
        """A mapping guarded with ``zero``: whether a touch met a truncation of its object, so
        that its pages here are zeros of this process's (it must be mapped anew)."""
        return self._guard.zeroed

    @property
    def truncated(self) -> bool:
        """A mapping guarded with ``zero`` (``attach``): whether its object was truncated since,
        and so (where a touch met the truncation) its pages here are zeros of this process's."""
        return self._guard.truncated

    @classmethod
    def attach(cls, name: str, readonly: bool = False, owner_only: bool = False, zero: bool = False,
               size: int | None = None) -> "Segment":
        """Map ``name``. ``owner_only``: it must be an object no one but its owner (and this
        process's user) could have written, so that its owner is who made it (``uid``): a
        client's segment, whose owner is who the client is (PermissionError otherwise).
        ``zero``: a truncation by its owner (another user) is not grown back, the mapping is
        zeroed instead (``truncated``; shm/truncation_guard.py): an object only its owner's own
        requests use, a client's segment. ``size``: the size this process's user made it, mapped
        at that size and grown back first if another user it lets write it truncated it (the
        worker's map of a user's lanes)."""
        shm = posix_ipc.SharedMemory(name, flags=0, read_only=readonly)
        try:
            st = os.fstat(shm.fd)
            if owner_only and (why := other_writers(shm.fd, st, (os.geteuid(),))):
                raise PermissionError(f"{name} is not its owner's (uid {st.st_uid}) alone: {why}")
            if size is not None and st.st_size < size and st.st_uid == os.geteuid():
                os.ftruncate(shm.fd, size)
            size = st.st_size if size is None else size
            if size == 0:  # (mmap refuses it: made by someone else and not sized yet, or truncated)
                raise ConnectionError(f"{name} is empty")
            access = mmap.ACCESS_READ if readonly else mmap.ACCESS_WRITE
            mm = mmap.mmap(shm.fd, size, access=access)
            # What this process only reads is written by the server alone: nobody to truncate it.
            try:
                guard = MappingGuard() if readonly else guard_mapping(mm, shm.fd, size, restorable=True,
                                                                      required=owner_only, zero=zero)
            except OSError:
                mm.close()
                raise
        finally:
            shm.close_fd()
        return cls(name, size, mm, owner=False, uid=st.st_uid, guard=guard)

    def close(self) -> None:
        """Unmap; views still alive keep the mapping until they die (BufferError is expected)."""
        self.closed = True
        self._guard.closing()  # (before the unmap: the range may be another mapping's after it)
        try:
            self.buf.release()
            self._mmap.close()
        except BufferError:
            return  # guarded until the last view lets the mapping go
        self._guard.release()

    def unlink(self) -> None:
        unlink_shm(self.name)


class SegmentCache:
    """Lazily attached segments by name, bounded so long-lived processes do not hoard mappings;
    and the registered regions' files (``regions``, ``region_io.py``)."""

    def __init__(self, limit: int = 256) -> None:
        self._items: OrderedDict[str, Segment] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()
        self.regions = RegionFiles(limit)
        # Called with each name dropped, so that other mappings of it (workers/input_views.py) go too.
        self.forgetting: list[Callable[[str], None]] = []

    def _forgot(self, names: list[str]) -> None:
        for name in names:
            for forget in self.forgetting:
                forget(name)

    def get(self, name: str, readonly: bool = False) -> Segment:
        """The mapping of ``name`` (a segment of the server's or a client's arena); ``readonly``:
        mapped for reading only where it is first mapped (an object this process may only read)."""
        seg = self._items.get(name)
        if seg is not None and not seg.zeroed:
            return seg
        with self._lock:
            seg = self._items.get(name)
            if seg is not None and seg.zeroed:  # (its client truncated it: mapped anew, whatever it is now)
                del self._items[name]
                seg.close()
                self._forgot([name])
                seg = None
            if seg is None:
                seg = Segment.attach(name, readonly, zero=is_client_segment(name))
                self._items[name] = seg
                while len(self._items) > self._limit:
                    _, old = self._items.popitem(last=False)
                    old.close()
                    self._forgot([old.name])
            return seg

    def drop(self, name: str) -> None:
        with self._lock:
            seg = self._items.pop(name, None)
        if seg is not None:
            seg.close()
            self._forgot([name])

    def drop_unlinked(self, prefix: str) -> None:
        """Unmap the segments named ``prefix...`` whose object is gone from /dev/shm (a client
        that left unlinks its segment), so their memory is not pinned here."""
        with self._lock:
            gone = [n for n in self._items if n.startswith(prefix) and not os.path.exists("/dev/shm" + n)]
            segs = [self._items.pop(n) for n in gone]
        for seg in segs:
            seg.close()
        self._forgot(gone)

    def clear(self) -> None:
        with self._lock:
            items = list(self._items.values())
            self._items.clear()
        self.regions.clear()
        for seg in items:
            seg.close()
        self._forgot([seg.name for seg in items])
