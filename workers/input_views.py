"""Copy-on-write views of large inputs that lie in shared arenas, for models that may write into them.

Triton's Python stub gives a model its own copies of its inputs, so that ``x += 1`` on an input
changes nothing the client (or another model) reads. A copy of 16 MiB costs a worker 1.2-2.5 ms
here. Instead, the worker keeps one private mapping (``MAP_PRIVATE``) of each arena segment that
large inputs lie in (a frontend's or local client's request blocks, another worker's output arena
for an ensemble step, the broker's) and gives the model numpy views over it: once its page tables
are filled a view costs nothing, and the first write into a page makes the kernel copy that page
for this process alone (copy on write), so the segment itself is never changed.

The request blocks are reused once their clients have their answers. So before the worker tells
the round's clients (``settle``, from ``Worker._flush_counts``), each view given out is looked at:

- let go by the model (the common case): the pages it wrote, which ``/proc/self/pagemap`` shows as
  anonymous, are dropped (``MADV_DONTNEED``), so the mapping shows the segment there again;
- still held (a model keeps an input past ``execute``, or answers later through its response
  sender): every page under it is made private now (``MADV_POPULATE_WRITE``: copy on keep), so
  it keeps the bytes it had whatever the client writes there next, as a copy would, and the
  mapping is retired (no new view is made in it; it is unmapped when the last kept array dies).

A page shared by two blocks (blocks are 64-byte aligned) is private already when a model wrote
into the other block's view in this round: a view whose first or last page is private is not
made (the input is copied), since it would show that page as it was when it was copied.

Not mapped, copied instead: inputs under ``VIEW_MIN_BYTES``, where the copy is cheaper (below);
inputs in a client's registered region (``shm/region_io.py``: its owner may truncate it, which
drops even the pages a private mapping copied on write, so a model's view would change under it);
inputs of streaming requests and
decoupled models (used after the round, they would be copied at keep anyway); and every input of
a model seen writing into a quarter of a view's pages (each written page costs a fault and a page
copy, and the next request's view a fault again: 5x the copy for a model that writes it all).

Measured on the 2-core VM, loaded (``tools/bench_input_views.py``: worker thread CPU per input,
the model reading all of it; three runs): 512 KiB: view 48-94 us, copy 37-59; 1 MiB: 74-139
against 71-114; 2 MiB: 160-174 against 182-227; 4 MiB: 280-371 against 378-527; 16 MiB:
1,316-1,494 against 2,264-2,552. The view's cost
is mostly the pagemap look (about 25 us a MiB), so the crossover lies between 1 and 2 MiB. The
first time a range of the mapping is used its pages fault in (16 MiB: 2.9-3.3 ms, more than the
copy), once per arena round. One fresh private mapping per request instead would pay that every
time: 0.5 us a page to fill and unmap, no cheaper than the copy at any size here.
"""
from __future__ import annotations

import logging
import mmap
import os
import sys
import threading
import weakref
from collections import OrderedDict

import numpy as np

from shmserve.shm.names import SHM_DIR, is_client_segment
from shmserve.shm.segment import SegmentCache
from shmserve.shm.tensors import DTYPES
from shmserve.shm.truncation_guard import guard_mapping

# Inputs smaller than this are copied: below it the copy costs less than the pagemap look (measured
# above: the crossover lies between 1 and 2 MiB on the 2-core VM).
VIEW_MIN_BYTES = 2 << 20
MADV_POPULATE_WRITE = 23  # Linux 5.14; not in Python 3.11's mmap module
PAGE = mmap.PAGESIZE
MAX_MAPPINGS = 64  # segments mapped privately at once (LRU)
MAX_RETIRED = 8  # retired mappings a model keeps alive before its inputs are copied instead
WRITER_SHARE = 4  # a model that wrote a quarter of a view's pages gets copies from then on

log = logging.getLogger("shmserve.worker")

_PRESENT, _SWAPPED, _FILE = np.uint64(1 << 63), np.uint64(1 << 62), np.uint64(1 << 61)


class _PrivateMap(mmap.mmap):
    """A private mapping whose truncation guard hears ``closing`` before it is unmapped. mmap
    unmaps in its dealloc and only then calls back the weak reference that ends the guard
    (``guard_mapping``), and it is unmapped when its last view dies, which no caller sees: a guard
    made to zero the range (a client's segment) would stay live over a range another mapping may
    take meanwhile, and a fault there would replace that mapping by zero pages. ``__del__`` runs
    before the dealloc."""

    def __del__(self) -> None:
        guard = self.__dict__.get("guard")
        if guard is not None:
            guard.closing()


class _Mapping:
    """One segment mapped privately, whole."""

    __slots__ = ("name", "mm", "buf", "addr", "size", "guard", "__weakref__")

    def __init__(self, name: str, fd: int, size: int) -> None:
        self.name = name
        self.size = size
        self.mm = _PrivateMap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.buf = memoryview(self.mm)
        self.addr = np.frombuffer(self.mm, np.uint8, count=1).ctypes.data
        # (its owner may truncate it: shm/truncation_guard.py; a client's segment is zeroed here
        # then, not grown back, and mapped anew by the next view)
        self.guard = self.mm.guard = guard_mapping(self.mm, fd, size, shared=False, zero=is_client_segment(name))


class InputViews:
    """The private mappings of one worker, and the views given out since the last ``settle``."""

    def __init__(self, segments: SegmentCache, pagemap: int, min_bytes: int = VIEW_MIN_BYTES) -> None:
        self._segments = segments
        self._pagemap = pagemap
        self.min_bytes = min_bytes
        self._maps: OrderedDict[str, _Mapping] = OrderedDict()
        self._lock = threading.Lock()  # a segment may be forgotten from a model's thread
        # (mapping, root array, first byte, end) of each view given out since the last settle
        self._given: list[tuple[_Mapping, weakref.ref, int, int]] = []
        self._retired: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()
        segments.forgetting.append(self.forget)

    @classmethod
    def open(cls, segments: SegmentCache) -> "InputViews | None":
        """None where the kernel lacks what the views need (pagemap flags, MADV_POPULATE_WRITE):
        inputs are copied there."""
        try:
            pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        views = cls(segments, pagemap)
        if not views._works():
            segments.forgetting.remove(views.forget)
            os.close(pagemap)
            return None
        return views

    # -- giving views ------------------------------------------------------------------------------
    def array(self, name: str, off: int, size: int, datatype: str, shape: list[int]) -> np.ndarray | None:
        """A private view of tensor bytes ``off`` to ``off + size`` of segment ``name`` (bounds
        checked by the caller against the segment), or None: then the caller copies."""
        if size < self.min_bytes or datatype == "BYTES" or len(self._retired) >= MAX_RETIRED:
            return None
        m = self._mapping(name)
        try:
            if m is None or off + size > m.size or len(self._written(m, off, off + size, edges=True)):
                return None
        except OSError:
            return None
        arr = np.ndarray(shape, DTYPES[datatype], m.buf[off:off + size])
        self._given.append((m, weakref.ref(arr), off, off + size))
        return arr

    def _mapping(self, name: str) -> _Mapping | None:
        with self._lock:
            m = self._maps.get(name)
            if m is not None and m.guard.zeroed:  # (its client truncated it meanwhile)
                del self._maps[name]
            elif m is not None:
                self._maps.move_to_end(name)
                return m
        seg = self._segments.get(name)  # (what the caller's bounds were checked against)
        try:
            # (for writing: the truncation guard must be able to grow the file back)
            fd = os.open(SHM_DIR + name, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if st.st_size != seg.size or st.st_uid != seg.uid:
                return None  # not the object the cache mapped
            m = _Mapping(name, fd, seg.size)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)  # (mmap holds its own)
        with self._lock:
            self._maps[name] = m
            while len(self._maps) > MAX_MAPPINGS:
                self._maps.popitem(last=False)
        return m

    # -- settling, before the clients reuse their blocks ----------------------------------------------
    def settle(self) -> None:
        """Reset the pages models wrote in the views they let go of; make the views they keep
        private and retire their mappings (see the module's text)."""
        given, self._given = self._given, []
        by_map: dict[int, list[tuple[_Mapping, weakref.ref, int, int]]] = {}
        for g in given:
            by_map.setdefault(id(g[0]), []).append(g)
        for views in by_map.values():
            m = views[0][0]
            kept = [(start, end) for _, ref, start, end in views if ref() is not None]
            try:
                if kept:
                    self._retire(m, kept)
                    continue
                for _, _, start, end in views:
                    self._reset(m, start, end)
            except OSError as e:  # (an arena its owner truncated: nothing more is shown from it)
                log.warning("input views of %s: %s; no more views in that mapping", m.name, e)
                self.forget(m.name)

    def _reset(self, m: _Mapping, start: int, end: int) -> None:
        pages = self._written(m, start, end)
        if not len(pages):
            return
        if len(pages) * WRITER_SHARE >= (end - start) // PAGE and self.min_bytes != sys.maxsize:
            # A page written costs a fault and its copy, and the next request's view a fault
            # again: a model that writes into much of its inputs is cheaper served with copies.
            self.min_bytes = sys.maxsize
            log.info("the model writes into its inputs: they are copied from now on")
        # runs of consecutive written pages, one madvise each
        breaks = np.flatnonzero(np.diff(pages) != 1)
        firsts = np.concatenate(([pages[0]], pages[breaks + 1]))
        lasts = np.concatenate((pages[breaks], [pages[-1]]))
        base = (m.addr + start) // PAGE * PAGE - m.addr
        for first, last in zip(firsts.tolist(), lasts.tolist()):
            m.mm.madvise(mmap.MADV_DONTNEED, base + first * PAGE, (last - first + 1) * PAGE)

    def _retire(self, m: _Mapping, kept: list[tuple[int, int]]) -> None:
        """Copy on keep: each kept view's pages made private, the rest of the mapping dropped."""
        spans = sorted((start // PAGE * PAGE, -(-end // PAGE) * PAGE) for start, end in kept)
        for start, end in spans:
            m.mm.madvise(MADV_POPULATE_WRITE, start, end - start)
        with self._lock:
            if self._maps.get(m.name) is m:
                del self._maps[m.name]
        pos = 0
        for start, end in spans + [(m.size, m.size)]:
            if start > pos:
                m.mm.madvise(mmap.MADV_DONTNEED, pos, start - pos)
            pos = max(pos, end)
        self._retired.add(m.mm)  # unmapped with its last kept array (mmap's own finalizer)

    def _written(self, m: _Mapping, start: int, end: int, edges: bool = False) -> np.ndarray:
        """Indexes (from the first page of ``start``) of the pages in ``start:end`` that are this
        process's own (written, or swapped out); only the first and last page with ``edges``."""
        first = (m.addr + start) // PAGE
        last = (m.addr + end - 1) // PAGE
        if edges and last - first > 1:
            entries = np.frombuffer(os.pread(self._pagemap, 8, first * 8) + os.pread(self._pagemap, 8, last * 8),
                                    np.uint64)
            pages = np.array([0, last - first])
        else:
            entries = np.frombuffer(os.pread(self._pagemap, (last - first + 1) * 8, first * 8), np.uint64)
            pages = np.arange(len(entries))
        own = ((entries & _PRESENT) != 0) & ((entries & _FILE) == 0) | ((entries & _SWAPPED) != 0)
        return pages[own]

    # -- lifetime ----------------------------------------------------------------------------------
    def forget(self, name: str) -> None:
        """Segment ``name`` is gone from the cache (its client left): stop mapping it here (views
        still alive keep their mapping until they die)."""
        with self._lock:
            self._maps.pop(name, None)

    def close(self) -> None:
        with self._lock:
            self._maps.clear()
        if self.forget in self._segments.forgetting:
            self._segments.forgetting.remove(self.forget)
        if self._pagemap >= 0:
            os.close(self._pagemap)
            self._pagemap = -1

    def _works(self) -> bool:
        """Whether a private page written here shows in pagemap, and POPULATE_WRITE and
        DONTNEED behave, on a small object of our own."""
        fd = os.memfd_create("shmserve-probe", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, 2 * PAGE)
            os.pwrite(fd, b"\x07" * (2 * PAGE), 0)
            m = _Mapping("probe", fd, 2 * PAGE)
            try:
                m.buf[0] = 1
                m.mm.madvise(MADV_POPULATE_WRITE, PAGE, PAGE)
                written = self._written(m, 0, 2 * PAGE).tolist()
                m.mm.madvise(mmap.MADV_DONTNEED, 0, 2 * PAGE)
                ok = written == [0, 1] and m.buf[0] == 7 and not len(self._written(m, 0, 2 * PAGE))
                m.buf.release()
                m.mm.close()
                return ok
            except (OSError, ValueError):
                return False
        except OSError:
            return False
        finally:
            os.close(fd)
