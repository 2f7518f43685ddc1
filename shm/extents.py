"""A worker's output arena as a chain of extents that starts small and grows on demand.

A server with many small models cannot give every instance a large arena up front: /dev/shm is
counted per segment (shm/space.py), and 200 instances of 257 MiB do not fit where 200 of a few
MiB do. So extent 0 is small and lies in the worker's own segment (``--backend-config
python,shm-default-byte-size``); an answer that fits nowhere makes a new extent, its own segment
``worker.<n>.arena.<k>``, at least twice the largest so far and at least the answer's size
(``shm-growth-byte-size`` is the least step), counted against /dev/shm before it is made. The
extents' total is capped by ``--worker-arena-mb``. A grown extent takes new answers until the
next one is made; it is then retired and unlinked once every block in it was given back.

Answers go to extent 0 first, so steady small traffic costs what it did with one arena. A
completion slot (and a stream record) names the extent; a consumer maps an extent by name on
first sight, only if the server's uid owns it and it has the size the worker wrote into its
control object, which no client writes (``map_extent``).
"""
from __future__ import annotations

import os
import threading

import posix_ipc

from . import space
from .access import server_readers
from .arena import ALIGN, BLOCK_HEADER, Arena, no_room_text
from .channel import EXTENT_ENTRIES, MAX_EXTENTS, WorkerSegment
from .names import PREFIX, SHM_DIR, extent_name, unlink_shm
from .segment import Segment, SegmentCache

MIB = 1 << 20
# Triton's python backend's names for the first size and the least growth (--backend-config).
DEFAULT_BYTES_SETTING = "shm-default-byte-size"
GROWTH_BYTES_SETTING = "shm-growth-byte-size"
# Extent 0: steady small traffic cycles through the first SOFT_LIMIT (4 MiB) of any arena
# (shm/arena.py), so a first extent of that size holds what such traffic ever touches.
DEFAULT_START_BYTES = 4 << 20
DEFAULT_GROWTH_BYTES = 1 << 20  # Triton's default; growth at least doubles anyway
MIN_START_BYTES = 64 << 10  # room for a few error documents


class GrowthRefused(Exception):
    """The arena could not grow for an answer: its text is the answer's error (a 503)."""


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


class OutputArenas:
    """Owner side: where a worker's answers are written. ``alloc`` returns (extent, offset);
    ``buf(extent)`` is the mapping to write into. Thread-safe (stream senders run on the model's
    threads); only growth and retirement take the lock."""

    def __init__(self, first: Arena, seg: WorkerSegment, server_id: str, num: int, cap: int, growth: int,
                 instance_name: str = "") -> None:
        self.first = first
        self.first_buf = seg.seg.buf
        self.seg = seg
        self.server_id = server_id
        self.num = num
        self.cap = cap
        self.growth = max(growth, ALIGN)
        self.instance_name = instance_name
        self._grown: dict[int, tuple[Segment, Arena]] = {}  # extent -> its mapping, while not unlinked
        self._current = 0  # the extent that takes answers extent 0 has no room for
        self._retired: list[int] = []
        self._next = 1
        self._lock = threading.Lock()

    # -- the request path --------------------------------------------------------------------------
    def alloc(self, nbytes: int, consumer: int = 0) -> tuple[int, int]:
        """(extent, payload offset) of a new block; raises GrowthRefused when the arena cannot grow."""
        if BLOCK_HEADER + nbytes <= self.first.capacity:  # (an answer larger than extent 0 skips it)
            off = self.first.alloc(nbytes, consumer)
            if off >= 0:
                return 0, off
        return self._alloc_beyond(nbytes, consumer)

    def buf(self, extent: int) -> memoryview:
        return self.first_buf if extent == 0 else self._grown[extent][0].buf

    def free(self, extent: int, off: int) -> None:
        if extent == 0:
            self.first.free(off)
        else:
            grown = self._grown.get(extent)
            if grown is not None:
                grown[1].free(off)

    @property
    def bytes_in_use(self) -> int:
        return self.first.bytes_in_use + sum(a.bytes_in_use for _, a in list(self._grown.values()))

    @property
    def capacity(self) -> int:
        return self.first.capacity + sum(a.capacity for _, a in list(self._grown.values()))

    # -- growth ------------------------------------------------------------------------------------
    def _alloc_beyond(self, nbytes: int, consumer: int) -> tuple[int, int]:
        with self._lock:
            self._unlink_drained()
            current = self._current
            if current:
                off = self._grown[current][1].alloc(nbytes, consumer)
                if off >= 0:
                    return current, off
            grown = self._grow(BLOCK_HEADER + _round_up(max(nbytes, 1), ALIGN), nbytes)
            if grown is None:
                return 0, -1
            extent, arena = grown
            off = arena.alloc(nbytes, consumer)
            if off < 0:  # the extent was sized for it: /dev/shm has no page for it
                raise GrowthRefused(self._refusal(nbytes, no_room_text(arena, "the new extent could not hold it")))
            return extent, off

    def _grow(self, need: int, response: int) -> tuple[int, Arena] | None:
        """A new extent that holds ``need``; None when the cap leaves no room now but would once
        answers are read (back-pressure, as a full arena always was)."""
        largest = max([self.first.capacity] + [a.capacity for _, a in self._grown.values()])
        size = _round_up(max(2 * largest, largest + self.growth, need), MIB)
        used = self.capacity
        if used + size > self.cap:
            size = (self.cap - used) // MIB * MIB  # what the cap leaves, if the answer fits in that
        if size < need:
            if need <= max(self.cap - self.first.capacity, self.first.capacity):
                return None
            raise GrowthRefused(self._refusal(response, f"no room under the cap of the instance's output arena, "
                                                    f"--worker-arena-mb={self.cap >> 20} ({space.mib(used)} in use)"))
        extent = self._next
        if any(e % EXTENT_ENTRIES == extent % EXTENT_ENTRIES for e in self._grown):
            return None  # its entry in the header still describes a live extent: wait for it to drain
        if extent >= MAX_EXTENTS:
            raise GrowthRefused(self._refusal(response, f"it has grown {MAX_EXTENTS - 1} times; raise "
                                                    f"--backend-config=python,{DEFAULT_BYTES_SETTING}"))
        name = extent_name(self.server_id, self.num, extent)
        try:
            with space.counting(self.server_id):  # checked and made with no other growth in between
                space.check(self.server_id, size, f"a {space.mib(size)} output extent of model instance "
                                                  f"'{self.instance_name}'", f" (--worker-arena-mb={self.cap >> 20} "
                                                                             f"caps one instance's extents)")
                seg = Segment.create_anew(name, size, server_readers(), taken=0)
        except space.NoRoom as e:
            raise GrowthRefused(self._refusal(response, f"no room in /dev/shm: {e}")) from None
        except (OSError, posix_ipc.Error) as e:
            raise GrowthRefused(self._refusal(response, f"{name}: {e}")) from None
        self._next += 1
        self.seg.set_extent_size(extent, size)  # before any answer in it is published
        arena = Arena(seg.buf, 0, size, seg.populate)
        self._grown[extent] = (seg, arena)
        if self._current:
            self._retired.append(self._current)
        self._current = extent
        return extent, arena

    def _refusal(self, need: int, why: str) -> str:
        return (f"Failed to increase the shared memory pool size of model instance '{self.instance_name}' "
                f"for a {need}-byte response: {why}")

    def tidy(self) -> None:
        """Unlink retired extents whose blocks were all given back (called once a round)."""
        if self._retired:
            with self._lock:
                self._unlink_drained()

    def _unlink_drained(self) -> None:
        for extent in list(self._retired):
            seg, arena = self._grown[extent]
            if arena.drained():
                self._retired.remove(extent)
                del self._grown[extent]
                seg.unlink()
                seg.close()

    def close(self) -> None:
        """Unlink every grown extent (the worker is leaving; the broker does it too after a crash)."""
        with self._lock:
            for seg, _ in self._grown.values():
                seg.unlink()
                seg.close()
            self._grown.clear()
            self._retired.clear()
            self._current = 0


# -- consumers ------------------------------------------------------------------------------------
def map_extent(cache: SegmentCache, server_id: str, num: int, extent: int, control: Segment) -> Segment:
    """The mapping of worker ``num``'s extent ``extent`` (``control``: its control object,
    mapped), from ``cache``. OSError unless the server's uid owns it and it has the size the
    worker wrote: a name in /dev/shm can be made by anyone, and an answer is read only from the
    server's memory."""
    expected = WorkerSegment.extent_size_in(control.buf, extent)
    name = extent_name(server_id, num, extent)
    if not expected:
        raise OSError(f"{name} is not an extent worker {num} made")
    seg = cache.get(name)
    if seg.uid != control.uid or seg.size != expected:
        cache.drop(name)
        raise OSError(f"{name} is not the server's (uid {seg.uid}, {seg.size} bytes)")
    return seg


def unlink_extents(server_id: str, num: int, folder: str = SHM_DIR) -> int:
    """Remove every extent of worker ``num`` (after it exited); returns how many there were."""
    stem = f"{PREFIX}.{server_id}.worker.{num}.arena."
    try:
        names = [e for e in os.listdir(folder) if e.startswith(stem)]
    except FileNotFoundError:
        return 0
    return sum(unlink_shm("/" + n) for n in names)
