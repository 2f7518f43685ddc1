"""A FIFO allocator over a shared-memory range whose blocks are freed by another process.

The producer (a worker writing outputs, a client writing inputs, the broker writing batch
descriptors) allocates; the consumer frees a block by writing one flag into its header, with no
message and no semaphore. The producer reclaims freed blocks lazily, oldest first, when it next
allocates. Blocks are released in roughly the order they were made, so a FIFO is enough and costs
O(1); a block held for long only delays reuse of the space behind it. A block whose consumer
process died is reclaimed as free. A full arena is back-pressure: ``alloc`` returns -1.

Past ``SOFT_LIMIT`` the head goes back to the start as soon as the space there is free, so steady
small traffic cycles through the first 4 MiB instead of touching (and keeping resident) every page
of a large arena; the rest is used only while that much is in flight. It goes back only while what
is outstanding behind it spans at most an eighth of the space it goes back to (``WRAP_MARGIN``):
after the wrap, nothing can pass the oldest outstanding block, so a block held there (a request
waiting through a model's reload, a large body still arriving) would confine every later request
to the space before it. With no such rule, add_sub requests under reloads got 503s ("no room ... in
the shared-memory arena") once a request had been held through 2,300 others; with a margin of two,
16 HTTP clients sending 600 KB bodies got a few 503s in every 10 s from a 256 MiB arena holding
about 10 MB. A held block far behind the head now sends it on through the rest of the arena.

The arena's pages are taken (``backing``, ``Segment.populate``) a MiB at a time as the head first
reaches them, never touched before: where /dev/shm has filled up meanwhile, ``alloc`` returns -1
with ``starved`` set, and the caller answers "no room" instead of dying of SIGBUS on the write.
The first MiB is taken with the segment (``first_pages``), so small traffic never meets that.
"""
from __future__ import annotations

import collections
import struct
import threading
from typing import Callable

from .liveness import consumer_alive
from .words import store_u32

BLOCK_HEADER = 64  # keeps every payload 64-byte aligned for numpy/torch
ALIGN = 64
_HDR = struct.Struct("<QII")  # total bytes, state, consumer (its liveness ticket, liveness.py)
USED, FREED, SKIP = 1, 2, 3
SOFT_LIMIT = 4 << 20
# The head goes back to the start only where the room before the oldest outstanding block is this
# many times what is outstanding: about that many generations of the requests in flight then pass
# before the head meets a block still held (a large body still arriving, a request in a later batch).
WRAP_MARGIN = 8
BACKING_STEP = 1 << 20  # pages are taken this many bytes at a time as the head first reaches them


def first_pages(arena_bytes: int) -> int:
    """The bytes of an arena's start whose pages are taken with its segment, where the room for
    all of it was checked: small answers, and the error that says a large one found no room, then
    never wait for a page that a /dev/shm filled by someone else since would refuse."""
    return min(arena_bytes, BACKING_STEP)


def no_room_text(arena: "Arena", full: str) -> str:
    """The text of a block ``arena`` refused: ``full`` (the arena's own words), or that /dev/shm is."""
    return ("/dev/shm is full: the server could not take a page for it" if arena.starved else full) + "; retry later"


def free_block(buf: memoryview, payload_offset: int) -> None:
    """Consumer side: give the block back: one store into its header (words.py). Written with
    ``struct.pack_into``, the state read 0 for a moment: a producer that looked then took a block
    still held for free and reused it, and the late FREED marked the block's next answer free
    while its reader still read it (a stream response read as corrupt)."""
    store_u32(buf, payload_offset - BLOCK_HEADER + 8, FREED)


class Arena:
    """Owner side of an arena occupying ``buf[offset:offset+size]``."""

    def __init__(self, buf: memoryview, offset: int, size: int,
                 backing: Callable[[int, int], bool] | None = None) -> None:
        """``backing(start, end)`` takes the pages of those bytes of ``buf`` before the first
        write there, False when it cannot (``Segment.populate``); None: they are taken already."""
        if offset % ALIGN or size % ALIGN:
            raise ValueError("arena offset and size must be 64-byte aligned")
        self._buf = buf
        self._base = offset
        self._size = size
        self._backing = backing
        self._backed = 0 if backing is not None else size  # bytes from the start whose pages are taken
        self.starved = False  # the last refusal was for want of /dev/shm pages, not of room in the arena
        self._head = 0  # next allocation, relative to base
        self._tail = 0  # oldest block not yet reclaimed
        self._used = 0  # bytes between tail and head (including skipped end space)
        self._skipped = 0  # of those, the skipped end space (not in use by anyone)
        # Each outstanding block's bytes and whether it is skipped end space, oldest first: the
        # producer's own record. Only a block's state is read back from the shared header, which
        # a consumer can write: a size written there never steers the reclaim.
        self._blocks: collections.deque[tuple[int, bool]] = collections.deque()
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self._size

    @property
    def bytes_in_use(self) -> int:
        return self._used - self._skipped

    def could_ever_hold(self, nbytes: int) -> bool:
        """Whether a block of ``nbytes`` fits the arena at all, once everything else is freed
        (what ``alloc`` needs for it, header and alignment included)."""
        return (BLOCK_HEADER + max(nbytes, 1) + ALIGN - 1) & ~(ALIGN - 1) <= self._size

    def alloc(self, nbytes: int, consumer: int = 0) -> int:
        """Absolute payload offset in the segment, or -1 when the arena cannot hold it now."""
        need = (BLOCK_HEADER + max(nbytes, 1) + ALIGN - 1) & ~(ALIGN - 1)
        with self._lock:
            if self._used:  # (the common case of nothing outstanding skips two calls)
                self._reclaim(False)
            if self._used:
                at = self._place(need)
            else:
                self._tail = 0
                at = 0 if need <= self._size else -1
            if at < 0:
                self._reclaim(True)  # only now pay for asking whether consumers still live
                at = self._place(need)
                if at < 0:
                    self.starved = False
                    return -1
            # (a block placed at the start after a wrap lies in pages taken before the tail's)
            if at + need + BLOCK_HEADER > self._backed < self._size and not self._take_pages(at + need + BLOCK_HEADER):
                return -1
            _HDR.pack_into(self._buf, self._base + at, need, USED, consumer)
            self._head = at + need
            self._used += need
            self._blocks.append((need, False))
            return self._base + at + BLOCK_HEADER

    def _take_pages(self, end: int) -> bool:
        """Take the pages up to ``end`` (and the next header, written at a wrap), a step at a time."""
        upto = min(self._size, -(-end // BACKING_STEP) * BACKING_STEP)
        assert self._backing is not None
        if not self._backing(self._base + self._backed, self._base + upto):
            self.starved = True
            return False
        self._backed = upto
        return True

    def _place(self, need: int) -> int:
        size, head, tail = self._size, self._head, self._tail
        if self._used == 0:
            self._head = self._tail = 0
            return 0 if need <= size else -1
        if head > tail:
            # The start is free: stay in the first pages, unless a block held far behind would
            # then bound the room (see the module's docstring).
            early = head >= SOFT_LIMIT and need <= tail and WRAP_MARGIN * (head - tail) <= tail
            if head + need <= size and not early:
                return head
            if need <= tail:  # wrap: mark the end as skipped space
                if head < size:
                    _HDR.pack_into(self._buf, self._base + head, size - head, SKIP, 0)
                    self._used += size - head
                    self._skipped += size - head
                    self._blocks.append((size - head, True))
                return 0
            return -1
        # head <= tail with blocks outstanding: free space is [head, tail)
        return head if head + need <= tail else -1

    def _reclaim(self, check_dead: bool) -> None:
        buf, base, size, blocks = self._buf, self._base, self._size, self._blocks
        while blocks:
            total, skipped = blocks[0]
            if not skipped:
                _, state, consumer = _HDR.unpack_from(buf, base + self._tail)
                # Only FREED gives a block back; any other state (a consumer may write garbage
                # there) counts as held, unless its consumer died.
                if state != FREED and not (check_dead and consumer and not consumer_alive(consumer)):
                    break
            else:
                self._skipped -= total
            blocks.popleft()
            self._used -= total
            self._tail += total
            if self._tail >= size:
                self._tail = 0
        if not blocks:
            self._head = self._tail = 0
            self._used = self._skipped = 0

    def in_use_now(self) -> int:
        """``bytes_in_use`` once the freed blocks at its tail are given back: what a producer
        reports while idle (the next allocation would reclaim them; until one comes, the gauge
        would count answers its clients read long ago)."""
        with self._lock:
            if self._used:
                self._reclaim(False)
            return self._used - self._skipped

    def live_bytes(self) -> int:
        """Bytes of the blocks still held (``bytes_in_use`` also counts freed blocks not yet
        reclaimed because an older one is held). Walks the outstanding blocks: for the rare
        caller that must tell a full arena from one cut by a held block."""
        with self._lock:
            buf, base, size = self._buf, self._base, self._size
            pos, live = self._tail, 0
            for total, skipped in self._blocks:
                if not skipped and _HDR.unpack_from(buf, base + pos)[1] != FREED:
                    live += total
                pos += total
                if pos >= size:
                    pos = 0
            return live

    def drained(self) -> bool:
        """Whether every block was given back (or its consumer died): nothing in it is read any more."""
        with self._lock:
            if self._used:
                self._reclaim(True)
            return self._used == 0

    def free(self, payload_offset: int) -> None:
        """Owner frees its own block (same flag as a consumer would write)."""
        free_block(self._buf, payload_offset)
