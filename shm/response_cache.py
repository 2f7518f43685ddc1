"""The response cache's store: one shared-memory segment every process of a server can use.

``--cache-config local,size=<bytes>`` makes the broker create ``/shmserve.<id>.cache.0`` of that
size; each worker of a model with ``response_cache { enable: true }`` attaches it. Keys are
16-byte digests (the worker computes them, ``workers/response_cache.py``); values are opaque
payloads. A semaphore of the same name is the lock around every lookup and insert, held for an
index probe and one copy, never across a model's execution.

Layout: a 128-byte header, an index (open addressing with linear probing, 16 bytes a slot: the
digest's first word and the entry's offset + 1), then the log. Entries lie in the log one after
another, each a 32-byte header (length, digest, payload length) and its payload, 64-byte
aligned; the log is circular, and writing at its head evicts the oldest entries in the way.
The index has a slot per 256 bytes and is kept at most half full (short probe runs): a cache of
many tiny answers holds size / 512 of them, evicting the oldest beyond.

How close to LRU: eviction takes the oldest *written* entry; a hit on an entry in the older half
of the log writes it again at the head. So an entry hit at least once while half the cache's
bytes were written is never evicted, and an entry not hit goes before every entry written or
refreshed after it. Unlike exact LRU, hits among the newer half do not reorder those entries,
and a refresh may evict the oldest entry before an insert would have. An entry larger than the
log is not stored.

A process that dies holding the lock would stop every other: the broker looks once a second
(``recover``) and, when the lock has stayed taken by a dead process (or by none) since its last
look, empties the cache and releases the lock. Meanwhile lookups and inserts give up after
``LOCK_WAIT_S``, and requests run as if the cache missed.
"""
from __future__ import annotations

import logging
import os
import struct
import time
from typing import NamedTuple

import posix_ipc

from .names import object_name, pid_alive, unlink_semaphore
from .segment import Segment

log = logging.getLogger("shmserve.cache")

MIN_BYTES = 1024  # room for the header, a 16-slot index and a log (Triton 2.51 refuses below about 200 bytes)
LOCK_WAIT_S = 0.2
_MAGIC = 0x52434348454D5300  # marks a finished header (any constant)
_HEADER = 128  # fifteen words used
_ENTRY = 32  # an entry's header: total length, digest (two words), payload length
_ALIGN = 64
_BYTES_PER_SLOT = 256  # an index slot per this many bytes of cache (16 bytes each: about 6%)
_KEY = struct.Struct("<QQ")  # a digest as the two words the log and the index hold
# header words
_W_MAGIC, _W_LOG, _W_SLOTS, _W_HEAD, _W_TAIL, _W_USED, _W_COUNT, _W_HOLDER, _W_OPS = range(9)
# the cache's own counters, for Triton's global nv_cache_* metrics (kept across a recovery)
_W_LOOKUPS, _W_HITS, _W_EVICTIONS, _W_LOOKUP_NS, _W_INSERT_NS = range(9, 14)
# the entries the index holds (the log's count also holds the old copies of entries written anew)
_W_INDEXED = 14


class CacheTotals(NamedTuple):
    """What Triton's global ``nv_cache_*`` metrics say of the cache."""

    entries: int
    util: float  # the log's bytes in use, of its capacity
    lookups: int
    hits: int
    misses: int
    evictions: int
    lookup_us: int  # lookups' time, the lock's wait included
    insertion_us: int


def layout(size: int) -> tuple[int, int]:
    """(index slots, log bytes) of a cache of ``size`` bytes (header and index included)."""
    slots = 16
    while slots * 2 * _BYTES_PER_SLOT <= size:
        slots *= 2
    log_off = (_HEADER + slots * 16 + _ALIGN - 1) & ~(_ALIGN - 1)
    return slots, (size - log_off) & ~(_ALIGN - 1)


class CacheStore:
    """One process's view of the cache segment (``create`` in the broker, ``attach`` elsewhere)."""

    def __init__(self, seg: Segment, sem: posix_ipc.Semaphore) -> None:
        self.seg = seg
        self.sem = sem
        self.words = seg.buf[:_HEADER].cast("Q")
        self.slots = self.words[_W_SLOTS]
        self.mask = self.slots - 1
        self.index = seg.buf[_HEADER:_HEADER + self.slots * 16].cast("Q")
        self.log_off = (_HEADER + self.slots * 16 + _ALIGN - 1) & ~(_ALIGN - 1)
        self.capacity = self.words[_W_LOG]
        self.log = seg.buf[self.log_off:self.log_off + self.capacity]
        self.log_words = self.log.cast("Q")
        self.max_entries = self.slots // 2  # the index stays at most half full: probe runs stay short
        self.pid = os.getpid()
        self._stuck_at = -1  # broker: the lock count when the lock was last seen held by nobody alive

    @classmethod
    def create(cls, server_id: str, size: int) -> "CacheStore":
        if size < MIN_BYTES:
            raise ValueError(f"a response cache of {size} bytes is too small: at least {MIN_BYTES}")
        name = object_name(server_id, "cache", 0)
        slots, capacity = layout(size)
        seg = Segment.create_anew(name, size, taken=size - capacity)  # (the log's pages as entries reach them)
        words = seg.buf[:_HEADER].cast("Q")
        words[_W_LOG] = capacity
        words[_W_SLOTS] = slots
        words[_W_MAGIC] = _MAGIC  # last: attach refuses a segment without it
        words.release()
        unlink_semaphore(name)
        return cls(seg, posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=1))

    @classmethod
    def attach(cls, server_id: str) -> "CacheStore":
        name = object_name(server_id, "cache", 0)
        seg = Segment.attach(name)
        if seg.size < _HEADER or int.from_bytes(seg.buf[:8], "little") != _MAGIC:
            seg.close()
            raise ConnectionError(f"{name} is not a response cache")
        return cls(seg, posix_ipc.Semaphore(name))

    # -- the lock ---------------------------------------------------------------------------------
    def _lock(self, wait: float) -> bool:
        try:
            self.sem.acquire(wait)
        except posix_ipc.BusyError:
            if wait:
                log.warning("the response cache stayed locked for %.1f s; this request runs uncached", wait)
            return False
        self.words[_W_HOLDER] = self.pid
        self.words[_W_OPS] += 1
        return True

    def _unlock(self) -> None:
        self.words[_W_HOLDER] = 0
        self.sem.release()

    def recover(self) -> bool:
        """Broker, once a second: release the lock if a dead process (or, for a whole second, no
        process) holds it, emptying the cache it may have left half changed. True if it did."""
        if self.sem.value > 0:
            self._stuck_at = -1
            return False
        holder, ops = int(self.words[_W_HOLDER]), int(self.words[_W_OPS])
        if holder and pid_alive(holder):
            self._stuck_at = -1
            return False
        if self._stuck_at != ops:  # look again next time: it may be a holder between two stores
            self._stuck_at = ops
            return False
        self._stuck_at = -1
        self._clear()
        self.words[_W_HOLDER] = 0
        self.sem.release()
        log.warning("the response cache was left locked by process %d, which is gone; emptied it", holder)
        return True

    # -- lookup and insert ------------------------------------------------------------------------
    def lookup(self, key: bytes, wait: float = LOCK_WAIT_S) -> bytes | None:
        """A copy of the payload stored under ``key`` (a 16-byte digest), or None (also when the
        lock stays taken for ``wait`` seconds: the broker, which serves everyone, passes 0)."""
        k0, k1 = _KEY.unpack(key)
        start = time.monotonic_ns()
        if not self._lock(wait):
            return None
        w = self.words
        try:
            w[_W_LOOKUPS] += 1
            off, slot = self._find(k0, k1)
            if off < 0:
                return None
            w[_W_HITS] += 1
            lw = self.log_words
            n = lw[(off >> 3) + 3]
            payload = self.seg.read(self.log_off + off + _ENTRY, self.log_off + off + _ENTRY + n)
            if (off - w[_W_TAIL]) % self.capacity < w[_W_USED] // 2:  # in the older half: write it anew
                self._delete(slot)
                self._append(k0, k1, (payload,), n)
            return payload
        finally:
            w[_W_LOOKUP_NS] += time.monotonic_ns() - start
            self._unlock()

    def fits(self, n: int) -> bool:
        """Whether a payload of ``n`` bytes can be stored at all."""
        return _ENTRY + n <= self.capacity

    def insert(self, key: bytes, parts: list, n: int, wait: float = LOCK_WAIT_S) -> bool:
        """Store ``parts`` (bytes-like, ``n`` bytes together) under ``key``; False when the key is
        there already, the entry is larger than the cache, or the lock stayed taken ``wait`` s."""
        if not self.fits(n):
            return False
        k0, k1 = _KEY.unpack(key)
        start = time.monotonic_ns()
        if not self._lock(wait):
            return False
        try:
            if self._find(k0, k1)[0] >= 0:
                return False  # another instance stored the same answer meanwhile
            return self._append(k0, k1, parts, n)
        finally:
            self.words[_W_INSERT_NS] += time.monotonic_ns() - start
            self._unlock()

    def forget(self, key: bytes, wait: float = LOCK_WAIT_S) -> None:
        """Drop ``key`` from the index (its payload did not read as an answer: the next answer
        stored under it replaces it); its bytes stay in the log until the log passes them."""
        k0, k1 = _KEY.unpack(key)
        if not self._lock(wait):
            return
        try:
            off, slot = self._find(k0, k1)
            if off >= 0:
                self._delete(slot)
        finally:
            self._unlock()

    # -- the log and the index (lock held) --------------------------------------------------------
    def _find(self, k0: int, k1: int) -> tuple[int, int]:
        """(offset in the log, index slot) of the entry of this digest; (-1, free slot) if none."""
        index, lw, mask = self.index, self.log_words, self.mask
        i = k0 & mask
        while True:
            stored = index[2 * i + 1]
            if stored == 0:
                return -1, i
            if index[2 * i] == k0:
                off = stored - 1
                if lw[(off >> 3) + 1] == k0 and lw[(off >> 3) + 2] == k1:
                    return off, i
            i = (i + 1) & mask

    def _delete(self, i: int) -> None:
        """Empty index slot ``i``, moving later entries of its probe run back (no tombstones)."""
        index, mask = self.index, self.mask
        j = i
        while True:
            j = (j + 1) & mask
            if index[2 * j + 1] == 0:
                break
            home = index[2 * j] & mask
            # the entry at j may move to i unless its home lies cyclically in (i, j]
            if (i < j and i < home <= j) or (i > j and (home > i or home <= j)):
                continue
            index[2 * i] = index[2 * j]
            index[2 * i + 1] = index[2 * j + 1]
            i = j
        index[2 * i] = 0
        index[2 * i + 1] = 0
        self.words[_W_INDEXED] -= 1

    def _append(self, k0: int, k1: int, parts: tuple | list, n: int) -> bool:
        """Write an entry at the head, evicting the oldest entries in its way; False where /dev/shm
        has no page left for it (segment.py: a write there would be a SIGBUS)."""
        total = (_ENTRY + n + _ALIGN - 1) & ~(_ALIGN - 1)
        w, lw, cap = self.words, self.log_words, self.capacity
        while w[_W_COUNT] >= self.max_entries:
            self._evict_oldest()
        while True:
            head, tail, used = w[_W_HEAD], w[_W_TAIL], w[_W_USED]
            if used == 0:
                w[_W_HEAD] = w[_W_TAIL] = head = 0
            if head > tail or used == 0:  # free: [head, end) and [0, tail)
                if cap - head >= total:
                    break
                lw[head >> 3] = 0  # skip the end of the log: a zero length sends readers to 0
                w[_W_USED] = used + cap - head
                w[_W_HEAD] = 0
                continue
            if head < tail and tail - head >= total:
                break
            self._evict_oldest()
        # Its pages, and those of the next entry's first word (a wrap writes a zero there).
        if not self.seg.populate(self.log_off + head, self.log_off + min(cap, head + total + 8)):
            return False
        base = head >> 3
        lw[base], lw[base + 1], lw[base + 2], lw[base + 3] = total, k0, k1, n
        pos = self.log_off + head + _ENTRY
        buf = self.seg.buf
        for part in parts:
            size = len(part)
            buf[pos:pos + size] = part
            pos += size
        w[_W_HEAD] = 0 if head + total == cap else head + total
        w[_W_USED] += total
        w[_W_COUNT] += 1
        index, mask = self.index, self.mask
        i = k0 & mask  # the digest is not indexed (looked for under the lock): its first free slot
        while index[2 * i + 1]:
            i = (i + 1) & mask
        index[2 * i] = k0
        index[2 * i + 1] = head + 1
        w[_W_INDEXED] += 1
        return True

    def _evict_oldest(self) -> None:
        w, lw, cap = self.words, self.log_words, self.capacity
        tail = w[_W_TAIL]
        total = lw[tail >> 3]
        if total == 0:  # the skipped end of the log
            w[_W_USED] -= cap - tail
            w[_W_TAIL] = 0
            return
        # Its index slot is the one that holds its offset (an entry written anew elsewhere has
        # none for its old copy): on the probe run from the digest's home slot.
        index, mask, stored = self.index, self.mask, tail + 1
        i = lw[(tail >> 3) + 1] & mask
        while True:
            found = index[2 * i + 1]
            if found == stored:
                self._delete(i)
                break
            if found == 0:
                break
            i = (i + 1) & mask
        w[_W_TAIL] = 0 if tail + total == cap else tail + total
        w[_W_USED] -= total
        w[_W_COUNT] -= 1
        w[_W_EVICTIONS] += 1

    def _clear(self) -> None:
        w = self.words
        w[_W_HEAD] = w[_W_TAIL] = w[_W_USED] = w[_W_COUNT] = w[_W_INDEXED] = 0
        self.seg.buf[_HEADER:_HEADER + self.slots * 16] = bytes(self.slots * 16)

    def entries(self) -> int:
        """Entries a lookup can find (an entry written anew counts once, as Triton counts it)."""
        return int(self.words[_W_INDEXED])

    def totals(self) -> "CacheTotals":
        """The cache's own counts, read without the lock (each word is written whole)."""
        w = self.words
        lookups, hits = int(w[_W_LOOKUPS]), int(w[_W_HITS])
        return CacheTotals(int(w[_W_INDEXED]), int(w[_W_USED]) / self.capacity, lookups, hits, lookups - hits,
                           int(w[_W_EVICTIONS]), int(w[_W_LOOKUP_NS]) // 1000, int(w[_W_INSERT_NS]) // 1000)

    def close(self) -> None:
        for view in (self.log_words, self.log, self.index, self.words):
            view.release()
        self.sem.close()
        self.seg.close()

    def unlink(self) -> None:
        unlink_semaphore(self.seg.name)
        self.seg.unlink()
