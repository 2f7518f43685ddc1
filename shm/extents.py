"""An output arena as a chain of extents that starts small and grows on demand: each worker's,
and the broker's (its answers: ensembles' outputs, errors, control documents).

A server with many small models cannot give every instance a large arena up front: /dev/shm is
counted per segment (shm/space.py), and 200 instances of 257 MiB do not fit where 200 of a few
MiB do. So extent 0 is small and lies in the worker's own segment (``--backend-config
python,shm-default-byte-size``); an answer that fits nowhere makes a new extent, its own segment
``worker.<n>.arena.<k>``, at least twice the largest so far and at least the answer's size
(``shm-growth-byte-size`` is the least step), counted against /dev/shm before it is made. The
extents' total is capped by ``--worker-arena-mb``. A grown extent takes new answers until the
next one is made; it is then retired and unlinked once every block in it was given back. Where
the cap leaves no room for a larger answer beside it, one that holds no answer is unlinked at
once (else it would keep that answer out for good).

Answers go to extent 0 first, so steady small traffic costs what it did with one arena. A
completion slot (and a stream record) names the extent; a consumer maps an extent by name on
first sight, only if the server's uid owns it and it has the size its producer wrote where no
client writes: a worker's control object, the broker's tables (``map_extent``).

Where clients of other users may connect (``--local-client-users``), no answer goes to extent 0
(the broker's lies in ``broker.0``, which they map): each user's clients, the server's user's
too, get their answers in extents of their own, which no other client can open (``OutputArenas``): a home extent as large as extent 0, up to
4 MiB, made on the user's first answer, grown the same way beyond it, up to an equal share of the
cap (the server's user counted), so that answers one user's clients keep never fill the cap.

The broker's arena grows the same way (``broker.0.arena.<k>``, up to ``--broker-arena-mb``): an
ensemble's answer larger than its first 64 MiB is served, and answers a client keeps (a local
client's result arrays point into them) pin only the extent they lie in, not every broker answer
of every client.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Callable

import posix_ipc

from . import space
from .access import others, server_readers
from .arena import ALIGN, BLOCK_HEADER, Arena, no_room_text
from .channel import EXTENT_ENTRIES, MAX_EXTENTS, BrokerSegment, WorkerSegment
from .names import PREFIX, SHM_DIR, broker_extent_name, extent_name, try_numbers, unlink_shm, warn_once
from .segment import Segment, SegmentCache

log = logging.getLogger("shmserve.extents")

MIB = 1 << 20
# Triton's python backend's names for the first size and the least growth (--backend-config).
DEFAULT_BYTES_SETTING = "shm-default-byte-size"
GROWTH_BYTES_SETTING = "shm-growth-byte-size"
# Extent 0: steady small traffic cycles through the first SOFT_LIMIT (4 MiB) of any arena
# (shm/arena.py), so a first extent of that size holds what such traffic ever touches.
DEFAULT_START_BYTES = 4 << 20
DEFAULT_GROWTH_BYTES = 1 << 20  # Triton's default; growth at least doubles anyway
MIN_START_BYTES = 64 << 10  # room for a few error documents
SQUATTED_TRIES = 16  # extent names tried for one growth (names another user made first are skipped)


class GrowthRefused(Exception):
    """The arena could not grow for an answer: its text is the answer's error (a 503: retry)."""

    status = 503

    def __init__(self, text: str, shm_full: bool = False) -> None:
        super().__init__(text)
        self.shm_full = shm_full  # for want of /dev/shm pages, not of room under the cap


class AnswerTooLarge(GrowthRefused):
    """An answer larger than the arena's cap could ever hold: no retry helps (a 500, as Triton's
    backend fails an output its shared-memory pool cannot take)."""

    status = 500


def _round_up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


@dataclasses.dataclass(frozen=True)
class Owner:
    """Whose arena grows, as its refusals name it, and how its extents are named and published."""

    name: str  # "model instance 'x'", "the broker"
    arena: str  # "the instance's output arena"
    caps: str  # what the cap bounds: "one instance's extents"
    cap_flag: str  # "--worker-arena-mb"
    more_hint: str  # what to raise when it grew as often as a slot can say
    name_of: Callable[[int], str]  # extent k's object
    publish: Callable[[int, int], None]  # writes extent k's size where consumers check it


@dataclasses.dataclass
class _Pool:
    """The extents that hold one user's answers (or every consumer's, when the producer's own
    segment is not readable by clients of other users)."""

    readers: tuple[int, ...]  # who besides the server may open its extents (access.py)
    share: int  # the most its extents may hold together (``OutputArenas.share_of``)
    home: int = 0  # the extent tried first: 0 (the producer's segment) or the user's first extent
    home_arena: Arena | None = None  # (None for extent 0: ``OutputArenas.first``)
    current: int = 0  # the extent that takes answers home has no room for (0: none yet)
    retired: list[int] = dataclasses.field(default_factory=list)


class OutputArenas:
    """Owner side: where a worker's (or the broker's) answers are written. ``alloc`` returns
    (extent, offset); ``buf(extent)`` is the mapping to write into. Thread-safe (stream senders
    run on the model's threads); only growth and retirement take the lock.

    Clients of other users (``--local-client-users``) map the broker's segment, so its extent 0
    would let each read, and overwrite, the answers of every other client. With such users, each
    consumer's user has a pool of its own: extents only that user (and the server's) may open,
    the first made on its first answer, numbered in one sequence with every other pool's. A
    consumer needs no word on whose pool an extent is: the completion names the extent, and only
    its own user's can be opened."""

    def __init__(self, first: Arena, first_seg: Segment, server_id: str, cap: int, growth: int, owner: Owner,
                 readers: tuple[int, ...] = ()) -> None:
        self.first = first
        self.first_seg = first_seg
        self.first_buf = first_seg.buf
        self.server_id = server_id
        self.cap = cap
        self.growth = max(growth, ALIGN)
        self.owner = owner
        self._grown: dict[int, tuple[Segment, Arena]] = {}  # extent -> its mapping, while not unlinked
        # One pool for every consumer while only the server's user may open the producer's
        # segment; else a pool per consumer's user, made on its first answer.
        self._shared: _Pool | None = None if readers else _Pool(readers=(), share=cap)
        self._users = len(readers) + 1  # the server's and each other one whose clients may connect
        self._pools: dict[int, _Pool] = {}
        self._next = 1
        self._far: set[int] = set()  # numbers used out of sequence (names ahead were squatted)
        self._lock = threading.Lock()

    # -- the request path --------------------------------------------------------------------------
    def alloc(self, nbytes: int, consumer: int = 0, uid: int = -1) -> tuple[int, int]:
        """(extent, payload offset) of a new block for a consumer of user ``uid`` (its segment's
        owner); raises GrowthRefused when the arena cannot grow."""
        pool = self._shared or self._pools.get(uid) or self._new_pool(uid, nbytes)
        home = pool.home_arena or self.first
        if BLOCK_HEADER + nbytes <= home.capacity:  # (an answer larger than the home extent skips it)
            off = home.alloc(nbytes, consumer)
            if off >= 0:
                return pool.home, off
        return self._alloc_beyond(pool, nbytes, consumer)

    def buf(self, extent: int) -> memoryview:
        return self.first_buf if extent == 0 else self._grown[extent][0].buf

    def segment(self, extent: int) -> Segment | None:
        """The mapping of ``extent``; None once it was unlinked (or never made)."""
        if extent == 0:
            return self.first_seg
        grown = self._grown.get(extent)
        return grown[0] if grown is not None else None

    def free(self, extent: int, off: int) -> None:
        if extent == 0:
            self.first.free(off)
        else:
            grown = self._grown.get(extent)
            if grown is not None:
                grown[1].free(off)

    @property
    def bytes_in_use(self) -> int:
        first = self.first.bytes_in_use if self._shared is not None else 0
        return first + sum(a.bytes_in_use for _, a in list(self._grown.values()))

    def in_use_now(self) -> int:
        """``bytes_in_use`` with each extent's freed blocks given back first (``Arena.in_use_now``)."""
        first = self.first.in_use_now() if self._shared is not None else 0
        return first + sum(a.in_use_now() for _, a in list(self._grown.values()))

    @property
    def capacity(self) -> int:
        """The bytes of every extent answers may go to (extent 0 only while it is shared)."""
        first = self.first.capacity if self._shared is not None else 0
        return first + sum(a.capacity for _, a in list(self._grown.values()))

    # -- growth ------------------------------------------------------------------------------------
    def share_of(self, uid: int) -> int:
        """The most the extents of ``uid``'s answers may hold together: the whole cap for the
        server's user (its frontends and the broker, which give answers back as they send them);
        an equal share for each other user (half the cap with one user named, a third with two),
        the server's counted too, so that the answers one user's clients keep leave room for
        every other user's, large ones included. Before, one user's clients keeping answers in
        extents up to the cap made every larger answer of everyone else a 503."""
        if uid in (-1, 0, os.geteuid()):  # (root, who may open anything, as the server's: access.py)
            return self.cap
        return max(self.cap // self._users // MIB * MIB, MIB)  # (whole MiB, as extents are)

    def _new_pool(self, uid: int, nbytes: int) -> _Pool:
        """The pool of ``uid``'s answers, with its home extent: as large as extent 0, but no larger
        than steady small traffic touches (the broker's extent 0 is 60 MiB), since a pool lives
        as long as its producer and its home counts against the cap all that while."""
        with self._lock:
            pool = self._pools.get(uid)
            if pool is not None:
                return pool
            self._unlink_drained()
            pool = _Pool(readers=others((uid,)) if uid >= 0 else (), share=self.share_of(uid))
            size = _round_up(min(self.first.capacity, DEFAULT_START_BYTES), MIB)
            size = min(size, pool.share)
            if self.capacity + size > self.cap:
                raise GrowthRefused(self._refusal(nbytes, f"the cap of {self.owner.arena} is taken by the extents of "
                                                          f"{len(self._pools)} users' answers "
                                                          f"({self.owner.cap_flag}={self.cap >> 20}): raise it"))
            made = self._make(pool, size, nbytes)
            if made is None:
                raise GrowthRefused(self._refusal(nbytes, "too many of its extents are in use"))
            pool.home, pool.home_arena = made
            self._pools[uid] = pool
            return pool

    def _alloc_beyond(self, pool: _Pool, nbytes: int, consumer: int) -> tuple[int, int]:
        with self._lock:
            self._unlink_drained()
            current = pool.current
            if current:
                off = self._grown[current][1].alloc(nbytes, consumer)
                if off >= 0:
                    return current, off
            grown = self._grow(pool, BLOCK_HEADER + _round_up(max(nbytes, 1), ALIGN), nbytes)
            if grown is None:
                return 0, -1
            extent, arena = grown
            if pool.current:
                pool.retired.append(pool.current)
            pool.current = extent
            off = arena.alloc(nbytes, consumer)
            if off < 0:  # the extent was sized for it: /dev/shm has no page for it
                raise GrowthRefused(self._refusal(nbytes, no_room_text(arena, "the new extent could not hold it")),
                                    shm_full=arena.starved)
            return extent, off

    def _grow(self, pool: _Pool, need: int, response: int) -> tuple[int, Arena] | None:
        """A new extent for ``pool`` that holds ``need``, at least twice the pool's largest; None
        when the cap leaves no room now but would once answers are read (back-pressure, as a full
        arena always was)."""
        largest = (pool.home_arena or self.first).capacity
        if pool.current:
            largest = max(largest, self._grown[pool.current][1].capacity)
        size = _round_up(max(2 * largest, largest + self.growth, need), MIB)
        room = self._room(pool)
        if size > room and self._unlink_idle():
            room = self._room(pool)
        if size > room:
            size = room // MIB * MIB  # what the cap (and the pool's share) leaves, if the answer fits in that
        if size < need:
            if need <= self._most_ever(pool):
                return None
            if pool.share < self.cap:
                raise AnswerTooLarge(self._refusal(response, f"larger than one user's share of {self.owner.arena} "
                                                         f"lets it ever hold ({self.owner.cap_flag}={self.cap >> 20} "
                                                         f"shared by {self._users} users): raise it"))
            raise AnswerTooLarge(self._refusal(response, f"larger than the cap of {self.owner.arena} lets it ever "
                                                     f"hold, {self.owner.cap_flag}={self.cap >> 20}: raise it"))
        return self._make(pool, size, response)

    def _room(self, pool: _Pool) -> int:
        """What a new extent of ``pool`` may take now: what the cap leaves, and its share leaves."""
        room = self.cap - self.capacity
        if pool.share < self.cap:
            room = min(room, pool.share - self._pool_bytes(pool))
        return room

    def _pool_bytes(self, pool: _Pool) -> int:
        """The bytes of ``pool``'s extents (extent 0 is never a limited pool's)."""
        return sum(self._grown[e][1].capacity for e in (pool.home, pool.current, *pool.retired) if e in self._grown)

    def _most_ever(self, pool: _Pool) -> int:
        """The largest answer room ``pool`` could ever be given once every answer is read: its
        home extent, or a new extent as large as the cap (and the pool's share) leaves beside
        what stays (extent 0 while shared; else every user's home extent), in whole MiB as
        ``_grow`` makes them. An answer past it can never be served (a 500), one within it
        later (a 503: retry)."""
        home = (pool.home_arena or self.first).capacity
        if self._shared is not None:
            homes = self.first.capacity
        else:
            homes = sum(self._grown[p.home][1].capacity for p in self._pools.values() if p.home in self._grown)
        most = self.cap - homes
        if pool.share < self.cap:
            most = min(most, pool.share - home)
        return max(most // MIB * MIB, home)

    def _make(self, pool: _Pool, size: int, response: int) -> tuple[int, Arena] | None:
        """A new extent of ``size`` bytes that ``pool``'s readers may open; None while every
        entry of the published sizes' table describes a live extent.

        A name another user made first (a sticky /dev/shm: the server may not remove it) is
        skipped: after a few in sequence the numbers tried are random up to MAX_EXTENTS, which a
        consumer takes from the completion's role word, so no squatting of the names ahead
        stops growth."""
        readers = server_readers() if self._shared is not None else pool.readers
        live = {e % EXTENT_ENTRIES for e in self._grown}
        if len(live) >= EXTENT_ENTRIES:
            return None
        if self._next >= MAX_EXTENTS:
            raise GrowthRefused(self._refusal(response, f"it has grown {MAX_EXTENTS - 1} times; raise "
                                                    f"{self.owner.more_hint}"))
        squatted: list[str] = []
        for extent, in_sequence in try_numbers(self._next, MAX_EXTENTS, self._far,
                                               lambda k: k % EXTENT_ENTRIES not in live, tries=SQUATTED_TRIES):
            name = self.owner.name_of(extent)
            try:
                with space.counting(self.server_id):  # checked and made with no other growth in between
                    space.check(self.server_id, size, f"a {space.mib(size)} output extent of {self.owner.name}",
                                f" ({self.owner.cap_flag}={self.cap >> 20} caps {self.owner.caps})")
                    seg = Segment.create_anew(name, size, readers, taken=0)
            except space.NoRoom as e:
                raise GrowthRefused(self._refusal(response, f"no room in /dev/shm: {e}"), shm_full=True) from None
            except posix_ipc.ExistentialError:
                # Made by another user where the server may not remove it: the number is skipped.
                warn_once(name, f"exists and is not the server's to remove: {self.owner.name} skips it")
                squatted.append(name)
                if in_sequence:
                    self._next = extent + 1
                continue
            except (OSError, posix_ipc.Error) as e:
                raise GrowthRefused(self._refusal(response, f"{name}: {e}")) from None
            break
        else:
            if not squatted:  # (the table's free entries were all missed by the random tries)
                return None
            raise GrowthRefused(self._refusal(response, f"{len(squatted)} names tried for its extents exist and are "
                                                    f"not the server's to remove ({', '.join(squatted[:3])}, ...)"))
        if in_sequence:
            self._next = extent + 1
        else:
            self._far.add(extent)  # (never reused: the sequence skips it when it gets there)
        self.owner.publish(extent, size)  # before any answer in it is published
        arena = Arena(seg.buf, 0, size, seg.populate)
        self._grown[extent] = (seg, arena)
        return extent, arena

    def _refusal(self, need: int, why: str) -> str:
        return f"Failed to increase the shared memory pool size of {self.owner.name} for a {need}-byte response: {why}"

    def tidy(self) -> None:
        """Unlink retired extents whose blocks were all given back (called once a round)."""
        if self._shared is not None:
            if not self._shared.retired:
                return
        elif not any(pool.retired for pool in list(self._pools.values())):
            return
        with self._lock:
            self._unlink_drained()

    def _unlink_idle(self) -> bool:
        """Unlink the extents that take answers now (each pool's ``current``) but hold none: under
        the cap, an idle one would keep a larger answer out for good, since only a growth retires
        it. Whether any was (a pool whose current one goes grows from its home extent again)."""
        unlinked = False
        for pool in [self._shared] if self._shared is not None else list(self._pools.values()):
            current = pool.current
            if current and self._grown[current][1].drained():
                seg, _ = self._grown.pop(current)
                pool.current = 0
                seg.unlink()
                seg.close()
                unlinked = True
        return unlinked

    def _unlink_drained(self) -> None:
        for pool in [self._shared] if self._shared is not None else list(self._pools.values()):
            for extent in list(pool.retired):
                seg, arena = self._grown[extent]
                if arena.drained():
                    pool.retired.remove(extent)
                    del self._grown[extent]
                    seg.unlink()
                    seg.close()

    def close(self) -> None:
        """Unlink every grown extent (its owner is leaving; after a worker's crash the broker does
        it, after the broker's the launcher)."""
        with self._lock:
            for seg, _ in self._grown.values():
                seg.unlink()
                seg.close()
            self._grown.clear()
            self._pools.clear()
            if self._shared is not None:
                self._shared = _Pool(readers=(), share=self.cap)


def worker_arenas(first: Arena, seg: WorkerSegment, server_id: str, num: int, cap: int, growth: int,
                  instance_name: str) -> OutputArenas:
    """A worker's answers: extent 0 in its segment, grown ones ``worker.<n>.arena.<k>`` with
    their sizes in its control object, up to ``--worker-arena-mb``."""
    owner = Owner(f"model instance '{instance_name}'", "the instance's output arena", "one instance's extents",
                  "--worker-arena-mb", f"--backend-config=python,{DEFAULT_BYTES_SETTING}",
                  lambda k: extent_name(server_id, num, k), seg.set_extent_size)
    return OutputArenas(first, seg.seg, server_id, cap, growth, owner, server_readers())


def broker_arenas(seg: BrokerSegment, server_id: str, cap: int) -> OutputArenas:
    """The broker's answers: extent 0 in ``broker.0``, grown ones ``broker.0.arena.<k>`` with
    their sizes in ``tables.0``, up to ``--broker-arena-mb``."""
    assert seg.arena is not None  # (the broker made it)
    owner = Owner("the broker", "the broker's output arena", "its extents", "--broker-arena-mb", "--broker-arena-mb",
                  lambda k: broker_extent_name(server_id, k), seg.set_extent_size)
    return OutputArenas(seg.arena, seg.seg, server_id, max(cap, seg.arena.capacity), DEFAULT_GROWTH_BYTES, owner,
                        server_readers())


# -- consumers ------------------------------------------------------------------------------------
def map_extent(cache: SegmentCache, name: str, expected: int, owner_uid: int) -> Segment:
    """The mapping of the extent ``name`` from ``cache``: ``expected``, the size its producer
    published where no client writes (0: it made none of that number), ``owner_uid`` the
    server's. OSError unless the server's uid owns it at that size: a name in /dev/shm can be made
    by anyone, and an answer is read only from the server's memory."""
    if not expected:
        raise OSError(f"{name} is not an extent the server made")
    seg = cache.get(name)
    if seg.uid != owner_uid or seg.size != expected:
        cache.drop(name)
        raise OSError(f"{name} is not the server's (uid {seg.uid}, {seg.size} bytes)")
    return seg


def map_worker_extent(cache: SegmentCache, server_id: str, num: int, extent: int, control: Segment) -> Segment:
    """Worker ``num``'s extent ``extent`` (``control``: its control object, mapped)."""
    return map_extent(cache, extent_name(server_id, num, extent), WorkerSegment.extent_size_in(control.buf, extent),
                      control.uid)


def map_broker_extent(cache: SegmentCache, server_id: str, extent: int, tables: Segment) -> Segment:
    """The broker's extent ``extent`` (``tables``: ``tables.0``, mapped)."""
    return map_extent(cache, broker_extent_name(server_id, extent), BrokerSegment.extent_size_in(tables.buf, extent),
                      tables.uid)


def unlink_extents(server_id: str, num: int, folder: str = SHM_DIR) -> int:
    """Remove every extent of worker ``num`` (after it exited); returns how many there were."""
    stem = f"{PREFIX}.{server_id}.worker.{num}.arena."
    try:
        names = [e for e in os.listdir(folder) if e.startswith(stem)]
    except FileNotFoundError:
        return 0
    return sum(unlink_shm("/" + n) for n in names)
