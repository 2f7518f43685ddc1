"""Reading and writing a client's registered system region.

A client may ``ftruncate`` its region at any moment, and touching a mapped page past the new end
of a tmpfs object raises SIGBUS, which no Python code survives. So a process of the server maps a
region only under the truncation guard (``truncation_guard.py``, whoever owns the region): at
a truncation met mid-copy the guard replaces the whole mapping by zero pages, so the copy runs on
over them at memory speed however often the client truncates (grown back page by page, a copy of
16 MiB racing truncations in a loop took 20 s of the broker's or a worker's time), and is then
refused as truncated (a 400): that costs only the client that truncated. The next copy maps the
object anew. Inputs are copied out of the mapping into memory of the reader's own and
outputs copied into it: a ``memcpy`` each, where ``pread``/``pwrite`` took twice its CPU (tmpfs
handles each 4 KiB page of those on its own). The object's size is looked at before each copy,
so a region found shorter than the request needs is refused (a 400), as before the mapping.
Where the guard library was not built (no C compiler at install), a region is read with
``preadv`` and written with ``pwrite`` through its descriptor, which cannot fault.

A file is opened by key and kept while its inode is the one the broker registered: a region
registered again (a new inode published) is opened anew, and a key that now names another
object than the registered one (or none) is refused at each request, never followed (nobody
checked that object) nor silently served from the old one kept open.
"""
from __future__ import annotations

import errno
import mmap
import os
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import posix_ipc

from . import truncation_guard
from .names import SHM_DIR
from .space import HOW_TO_RAISE, NoRoom
from .truncation_guard import MappingGuard, guard_mapping


MAX_OUTGROWN = 8  # smaller mappings of a grown region still in use, past which the descriptor serves


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


class _Mapping:
    """A guarded mapping of a region's object, whole as it was when mapped."""

    __slots__ = ("mm", "bytes", "guard")

    def __init__(self, fd: int, size: int) -> None:
        self.mm = mmap.mmap(fd, size)
        # (zeroed, not grown back, at a truncation: a copy racing truncations in a loop costs one fault)
        self.guard = guard_mapping(self.mm, fd, size, restorable=True, always=True, zero=True)
        self.bytes = np.frombuffer(self.mm, dtype=np.uint8)

    def close(self) -> bool:
        """Unmap it; False while a copy in another thread or a model's view still uses it (then it
        is unmapped when the last one lets go, and stays guarded until then)."""
        self.bytes = None  # type: ignore[assignment] # (its export would keep the map)
        self.guard.closing()  # (before the unmap: the range may be another mapping's after it)
        try:
            self.mm.close()
        except BufferError:
            return False
        self.guard.release()
        return True


class RegionFile:
    """One registered region's object, open for reading and writing at offsets: through a guarded
    mapping where the truncation guard is built (``_mapped``), else through the descriptor."""

    # The descriptor and the mappings go when the last holder lets go.
    __slots__ = ("key", "ino", "fd", "_mapping", "_outgrown", "_lock")

    def __init__(self, key: str, ino: int, fd: int) -> None:
        self.key = key
        self.ino = ino
        self.fd = fd
        self._mapping: _Mapping | None = None
        self._outgrown: list[_Mapping] = []  # smaller ones made before, still in use by a copy or a view
        self._lock = threading.Lock()

    def _mapped(self, end: int) -> tuple[np.ndarray, MappingGuard] | None:
        """The object as a guarded mapping and its bytes, if it reaches ``end``: made when first
        asked for, and anew (larger) once the object has grown, the smaller one unmapped once
        nothing uses it (the bytes returned keep it mapped while the caller holds them); None
        where the guard is not built or cannot be had, or too many smaller ones are still in use
        (then the descriptor serves)."""
        mapping = self._mapping
        if mapping is not None:
            got = mapping.bytes
            if got is not None and len(got) >= end and not mapping.guard.zeroed:
                return got, mapping.guard
        if not truncation_guard.available():
            return None
        with self._lock:
            mapping = self._mapping
            if mapping is not None and len(mapping.bytes) >= end and not mapping.guard.zeroed:
                return mapping.bytes, mapping.guard
            self._outgrown = [m for m in self._outgrown if not m.close()]
            size = os.fstat(self.fd).st_size
            if size < end or len(self._outgrown) >= MAX_OUTGROWN:
                return None  # (the caller refuses it as truncated, or reads it through the descriptor)
            try:
                made = _Mapping(self.fd, size)
            except (OSError, ValueError):
                return None
            if not made.guard.guarded:  # (out of descriptors, or of guard slots)
                made.close()
                return None
            if mapping is not None and not mapping.close():
                self._outgrown.append(mapping)
            self._mapping = made
            return made.bytes, made.guard

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

    def view(self, off: int, size: int, region: str | None = None) -> np.ndarray | None:
        """The ``size`` bytes at ``off`` in place, read-only, for a backend that reads its inputs
        in place (the Python backend copies them); None where the region is not mapped (then
        ``read``). StaleRegion if the object ends before."""
        mapped = self._mapped(off + size)
        if mapped is None:
            return None
        if os.fstat(self.fd).st_size < off + size:
            self._truncated(off + size, region)
        view = mapped[0][off:off + size]
        view.flags.writeable = False
        return view

    def read(self, off: int, size: int, region: str | None = None) -> np.ndarray:
        """The ``size`` bytes at ``off``, in a new array of this process's own."""
        out = np.empty(size, dtype=np.uint8)
        self.read_into(memoryview(out), off, region)  # type: ignore[arg-type] # (numpy's stubs lack Buffer)
        return out

    def read_into(self, dst: memoryview, off: int, region: str | None = None) -> None:
        """Fill ``dst`` from ``off``; StaleRegion if the object ends before."""
        done, n = 0, len(dst)
        mapped = self._mapped(off + n)
        if mapped is not None:
            if os.fstat(self.fd).st_size < off + n:
                self._truncated(off + n, region)
            np.copyto(np.frombuffer(dst, dtype=np.uint8), mapped[0][off:off + n])  # (numpy lets the GIL go)
            if mapped[1].zeroed:  # (a truncation met: what was copied is zeros, not the object's)
                self._truncated(off + n, region)
            return
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
        mapped = self._mapped(off + n)
        if mapped is not None:
            # Its pages taken first: a client makes a region with ftruncate, which takes none, and a
            # page /dev/shm had no room for would be replaced by one of this process (the output lost).
            # Only where the range has a hole (posix_fallocate of 16 MiB taken already costs a third
            # of their copy, the look for a hole a few microseconds): a truncation since, or the
            # region never written, left one.
            try:
                hole = os.lseek(self.fd, off, os.SEEK_HOLE)
            except OSError as e:  # (ENXIO: the object ends before off now)
                if e.errno != errno.ENXIO:
                    raise
                self._truncated(off + n, region)
            if hole < off + n:
                try:  # (a truncation since the size was looked at is grown back by it, as by the guard)
                    os.posix_fallocate(self.fd, off, n)
                except OSError as e:
                    if e.errno not in (errno.ENOSPC, errno.ENOMEM):
                        raise
                    raise NoRoom(f"/dev/shm is full: the {n}-byte output cannot be written into "
                                 f"{_shown(self.key, region)}, whose pages were never taken; {HOW_TO_RAISE}") from None
            np.copyto(mapped[0][off:off + n], np.frombuffer(src, dtype=np.uint8))
            if mapped[1].zeroed:  # (a truncation met: the output went into zero pages of this process)
                self._truncated(off + n, region)
            return
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
        for mapping in [*self._outgrown, self._mapping]:
            if mapping is not None:
                mapping.close()
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

    def keep_only(self, registered: set[tuple[str, int]]) -> None:
        """Let go of the files of regions no longer registered ((key, inode) pairs of those
        that are): an object unregistered and unlinked would otherwise stay open here, its
        memory held from /dev/shm, until 256 others pushed it out."""
        with self._lock:
            for key in [k for k, f in self._items.items() if (k, f.ino) not in registered]:
                del self._items[key]  # (closed once no thread reads through it: RegionFile.__del__)

    def view(self, t: dict) -> np.ndarray | None:
        """The bytes of entry tensor ``t`` in place, read-only (``RegionFile.view``), or None."""
        return self.get(t["seg"], t["ino"], t.get("region")).view(t["off"], t["size"], t.get("region"))

    def read(self, t: dict) -> np.ndarray:
        """A private copy of the bytes of entry tensor ``t`` (``seg``, ``ino``, ``off``, ``size``)."""
        return self.get(t["seg"], t["ino"], t.get("region")).read(t["off"], t["size"], t.get("region"))

    def write(self, t: dict, data: Any) -> None:
        """Write ``data`` where entry tensor ``t`` says (an output placed in a region)."""
        self.get(t["seg"], t["ino"], t.get("region")).write(t["off"], data, t.get("region"))

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
