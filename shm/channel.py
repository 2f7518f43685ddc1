"""Layouts of the server's and its clients' shared-memory objects, and how each wakes its receiver.

Each segment starts with a small header, then its rings, then an arena:
- broker.0: the broker's arena (its answers: control replies, ensembles'); beside it tables.0,
  which only the broker writes (lane holders, routes, settings, regions, the departures
  counter), batches.0, the manifests of the batches it sends to workers, and the connect rings
  clients announce themselves on (each guarded by a lock on its file's first byte, since many
  clients write it): connect.0 for the server's own user (its frontends), connect.u<uid> for
  each other user named by --local-client-users, which only that user may open.
- worker.<n>: the lanes clients put requests on and the first extent of the worker's output arena;
  the arena grows into more segments, worker.<n>.arena.<k> (shm/extents.py). Beside it
  control.<n>, which only the server writes: inbox (broker -> worker), outbox (worker -> broker).
- client.<ticket>-<k>: request ring (client -> broker), completion slots (written by whoever answers)
  and the client's arena (request descriptors and input tensors). The ticket is the client
  process's liveness lock (shm/liveness.py), not its pid: the client may live in another PID
  namespace.
Semaphores carry the same names as the segments they wake (POSIX keeps the two apart).
"""
from __future__ import annotations

import contextlib
import os
import struct
import time
from typing import Iterator, Sequence

import numpy as np
import posix_ipc

from .arena import Arena, first_pages
from .liveness import BROKER_TICKET, try_lock_byte
from .names import SHM_DIR, object_name, unlink_path, unlink_shm
from .protocol import CONNECT, RECORD, SLOT, SLOT_ANSWER, SLOT_ANSWER_AT, SLOT_BYTES, SLOT_DONE, SLOT_PENDING
from .ring import Ring
from .published import Published
from .segment import Segment
from .stats import StatsArea
from .untrusted import Fault, Garbage, Layout, check_layout
from .waker import SLEEPING, Waker, fence, flag_view, make_fifo
from .words import store_u32, store_u64

HEADER_BYTES = 4096
# "SHM" and the layout of these objects: a process of another shmserve version (a pod's client
# image updated apart from the server's) is told so, and never reads one layout as another.
# 2: tables.0, batches.0 and control.<n> beside the segments (1 wrote 'S' here); 3: the broker's
# arena grows (its extents' sizes at the end of tables.0, a broker answer's role word names one);
# 5: the broker's identity (this header's words) in tables.0 too, where no client writes; 6: the
# extents' sizes at the end of control.<n>, and 1024 of them (each user has extents of its own), and
# an answer's header says the length of its step traces (shm/answer.py); 7: the broker's and the
# workers' sleeping flags in tables.0 and control.<n>, which clients of other users may only read,
# and connect.0, the connect ring of the server's own user; 8: a connect ring per other user
# (connect.u<uid>) instead of one in broker.0, and the departures counter in tables.0; 9: each
# other user's lanes in an object of its own (worker.<n>.lanes.u<uid>), worker.<n> the server's alone.
LAYOUT = 9
MAGIC = 0x53484D00 | LAYOUT
_FAMILY = 0xFFFFFF00


class OtherLayout(ConnectionError):
    """The server's objects are of another shmserve version's layout."""


class NotTheServers(ConnectionError):
    """An object at one of the server's names was made by another user (before the server made it)."""


def check_magic(name: str, magic: int) -> None:
    """ConnectionError unless ``magic`` is this layout's; OtherLayout when it is shmserve's of
    another version."""
    if magic == MAGIC:
        return
    if magic & _FAMILY == MAGIC & _FAMILY:
        raise OtherLayout(f"{name} was made by another version of shmserve (shared-memory layout "
                          f"{magic & 0xFF:#x}, this one's is {LAYOUT}): run the server and its local "
                          f"clients from the same shmserve version")
    raise ConnectionError(f"{name} is not a shmserve segment")
_HEADER = struct.Struct("<IIQ")  # magic, pid, start time (ns) of the creating process
_LANES_HEADER = struct.Struct("<IIII")  # a user's lanes object: magic, 0, its first lane, their count
_WANT_WAKEUP = struct.Struct("<I")
# A receiver's sleeping flag, then its post word (waker.py): at this offset of a client's segment, of a
# worker's control object and of BROKER_WAKER_OFFSET in tables.0, which clients of other users may only read.
SLEEPING_FLAG_OFFSET = 64
WANT_WAKEUP_OFFSET = 128  # control header: broker sets it when it waits for this instance
# The size of each grown output extent (shm/extents.py), written by its producer before any answer
# in it is published, at the end of control.<n> (a worker's) and of tables.0 (the broker's); a
# consumer maps an extent only at that size. Extent k's entry is k % EXTENT_ENTRIES: at most that
# many extents live at once (with --local-client-users each user's answers have extents of their
# own), and numbers are never reused.
EXTENT_ENTRIES = 1024
MAX_EXTENTS = 1 << 24  # what a slot's role word can name (shm/protocol.py EXTENT_SHIFT)
_EXTENT_SIZE = struct.Struct("<Q")
# control header: the model's own readiness check (is_ready(), workers/readiness.py): whether the
# model has one, how many checks the broker asked for, and the last answer (asks answered, verdict)
READINESS_OFFSET = 512
_READINESS = struct.Struct("<QQQQ")  # has is_ready, asked (broker), answered (worker), verdict (worker)
READY_YES, READY_NO = 1, 2  # verdicts (0: none yet)
R_HAS, R_ASKED, R_ANSWERED, R_VERDICT = range(4)  # its words
LANE_BELLS_OFFSET = 1024  # worker header: one byte per lane, set by its client after a put
NOTIFY_KIND_OFFSET = 20  # client header: how to wake the client
# FUTEX: its thread sleeps on its flag (waker.py); FIFO: an event loop; BROKER: the broker itself
NOTIFY_FUTEX, NOTIFY_FIFO, NOTIFY_BROKER = 0, 1, 2
NOTIFY_KINDS = frozenset({NOTIFY_FUTEX, NOTIFY_FIFO, NOTIFY_BROKER})
GARBAGE_OFFSET = 2048  # control header: per lane, the cookie (and Fault) of a holder that wrote garbage
_FAULT_SHIFT = 56  # a garbage word: Fault << 56 | cookie (cookies count up from 1, never near 2**56)

CONNECT_CAPACITY = 256
REQUEST_CAPACITY = 4096
DEFAULT_SLOTS = 1024
# Where a slot's cancelled word lies, past the fields ``SLOT`` packs (its owner writes it).
CANCEL_AT = SLOT.size
# A direct request's binding, which its owner writes before it puts the lane record: the worker
# sets the taken word when it takes the record, and runs a lane record only if it names a pending
# slot bound to that block and not taken yet (``take_bound``). Every process of a user may write
# that user's lanes (each user's lie in an object of their own: ``lane_range``), but only its owner
# its slots: a forged or replayed record can then run no request but the one its slot holds, and
# that once.
TAKEN_AT = CANCEL_AT + 4
BOUND = struct.Struct("<QQ")  # the request block's offset and length
BOUND_AT = TAKEN_AT + 4
assert BOUND_AT + BOUND.size <= SLOT_BYTES
_TAKE = struct.Struct("<I28xQII")  # state, then (at 32) target, cancelled and taken words
WORKER_RING_CAPACITY = 1024
# Direct lanes: a client with lane i puts requests for default-scheduled models straight on lane i
# of the chosen worker (one producer per lane, so still lock-free), skipping the broker's hop.
LANES = 256
LANE_CAPACITY = 64
LANE_NAME_BYTES = 128
NO_LANE = 0xFFFFFFFF
LANE_PENDING = 0xFFFFFFFE  # until the broker has seen the client's connect record
LANE_REFUSED = 0xFFFFFFFD  # the broker disconnected the client for garbage it wrote (untrusted.py)
ROUTES_BYTES = 1 << 20
SETTINGS_BYTES = 8192  # server settings the broker publishes (log settings; shm/logs.py)
REGIONS_BYTES = 1 << 20  # registered system shm regions (shm/region_table.py)
CUSTOM_METRICS_BYTES = 256 << 10  # a worker's custom metrics (pb_utils.MetricFamily), as JSON
REGION_HOLDS_BYTES = 64 << 10  # the regions a worker's lane requests use (workers/region_holds.py)
MESSAGES_BYTES = 48 << 10  # the payloads of a worker's messages to the broker (its config, why it failed)
_COOKIE = struct.Struct("<Q")
LANE_OFFSET = 24  # client header: the lane the broker gave this client
COOKIE_OFFSET = 32  # client header: the cookie its lane records must carry
PROCESS_OFFSET = 40  # client header: its process's pid and PID namespace (inode), for logs only
_PROCESS = struct.Struct("<II")


_SILENT = bytes(LANES)


def _align(n: int, a: int = 4096) -> int:
    return (n + a - 1) & ~(a - 1)


# tables.0, after the lane holders, routes, settings and regions: the sizes of the broker's grown
# output extents (shm/extents.py), as a worker's control object holds its own.
BROKER_EXTENTS_OFFSET = _align(LANES * LANE_NAME_BYTES) + ROUTES_BYTES + SETTINGS_BYTES + REGIONS_BYTES
# control.<n>, last: the sizes of the worker's grown output extents.
CONTROL_EXTENTS_OFFSET = _align(HEADER_BYTES + 2 * Ring.nbytes(WORKER_RING_CAPACITY, RECORD)) \
    + _align(StatsArea.nbytes()) + CUSTOM_METRICS_BYTES + REGION_HOLDS_BYTES + MESSAGES_BYTES
# tables.0, last: the broker's header words (magic, pid, start time), which processes that tell
# the broker apart from a restarted one read here: broker.0's copy is writable by every client.
BROKER_IDENTITY_OFFSET = BROKER_EXTENTS_OFFSET + 8 * EXTENT_ENTRIES
BROKER_WAKER_OFFSET = _align(BROKER_IDENTITY_OFFSET + _HEADER.size, 64)  # tables.0: the broker's sleeping flag (waker.py)
# tables.0: how many clients have left, which workers watch to unmap what they hold of them
# (where a client could write it, one could make workers keep every departed segment mapped).
DEPARTURES_OFFSET = BROKER_WAKER_OFFSET + 64


def pid_namespace() -> int:
    """This process's PID namespace (the inode of /proc/self/ns/pid; 0 where unknown)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino & 0xFFFFFFFF
    except OSError:
        return 0


def _set_extent_size(buf: memoryview, table: int, extent: int, size: int) -> None:
    _EXTENT_SIZE.pack_into(buf, table + 8 * (extent % EXTENT_ENTRIES), size)


def _extent_size(buf: memoryview, table: int, extent: int) -> int:
    """The size an extents' table at ``table`` in ``buf`` gives extent ``extent`` (0: none)."""
    if not 0 < extent < MAX_EXTENTS or len(buf) < table + 8 * EXTENT_ENTRIES:
        return 0
    return _EXTENT_SIZE.unpack_from(buf, table + 8 * (extent % EXTENT_ENTRIES))[0]


def read_header(seg: Segment) -> tuple[int, int, int]:
    return _HEADER.unpack_from(seg.buf, 0)


def _identity(tables: Segment) -> tuple[int, int]:
    """(pid, start time) of the broker whose ``tables.0`` this is, where only it writes;
    ConnectionError when it is not one of this layout."""
    if tables.size < BrokerSegment.tables_nbytes():
        raise ConnectionError(f"{tables.name} is not a shmserve broker's tables ({tables.size} bytes)")
    magic, pid, started = _HEADER.unpack_from(tables.buf, BROKER_IDENTITY_OFFSET)
    check_magic(tables.name, magic)
    return pid, started


class BrokerSegment:
    """The broker's objects. ``broker.0``, which every client writes: its header and the broker's
    arena (its answers to clients). ``tables.0``, which only the broker writes and clients of
    other users (``readers``) may only read: the lane holders, the routing table, the settings,
    the region table (which workers trust: a lane's holder names the segment its records point
    into, a region the object a worker opens as the server's user) and the departures counter.
    ``batches.0`` (made by the broker only, ``batches``), which no client may even read. The
    connect rings (``connects``: the user each is for, its object): ``connect.0`` for the
    server's own user, ``connect.u<uid>`` for each reader, which only that user may open, so
    that a user who holds its ring's lock or fills its ring keeps only its own clients from
    connecting. The broker holds all of them; any other process the one it may write."""

    def __init__(self, server_id: str, seg: Segment, tables: Segment, create: bool,
                 batches: Segment | None = None, connects: dict[int, Segment] | None = None) -> None:
        self.seg = seg
        self.tables = tables
        self.connects = connects or {}
        self.connect_rings = {uid: Ring(c.buf, HEADER_BYTES, CONNECT_CAPACITY, CONNECT)
                              for uid, c in self.connects.items()}
        self.unmade_connects: list[int] = []  # readers whose ring's name another user had taken (create)
        # batches.0, the broker's and its workers' alone: the manifests of the batches it sends
        # (a manifest names the client segments and offsets a worker reads and answers).
        self.batches = batches
        self.batch_arena = Arena(batches.buf, 0, batches.size, batches.populate) if batches is not None else None
        self.name = seg.name
        off = HEADER_BYTES
        self.arena_offset = off
        toff = _align(LANES * LANE_NAME_BYTES)  # tables.0: the lane holders first, then the documents
        self.routes = Published(tables.buf, toff, ROUTES_BYTES)
        toff += ROUTES_BYTES
        self.settings = Published(tables.buf, toff, SETTINGS_BYTES)
        toff += SETTINGS_BYTES
        self.regions = Published(tables.buf, toff, REGIONS_BYTES)
        assert toff + REGIONS_BYTES == BROKER_EXTENTS_OFFSET  # (then the sizes of the broker's grown extents)
        if create:
            _HEADER.pack_into(seg.buf, 0, MAGIC, os.getpid(), time.time_ns())
            tables.buf[BROKER_IDENTITY_OFFSET:BROKER_IDENTITY_OFFSET + _HEADER.size] = seg.buf[:_HEADER.size]
            for ring in self.connect_rings.values():
                ring.reset()
            self.arena: Arena | None = Arena(seg.buf, off, seg.size - off, seg.populate)
        else:
            _identity(tables)  # (attach checked broker.0's header for another version's)
            self.arena = None
        self.waker = Waker.on_word(tables.buf, BROKER_WAKER_OFFSET)  # (only the broker writes tables.0)
        # Bumped whenever a client leaves, so workers know to unmap what they hold of it.
        self.departures = np.ndarray((1,), dtype=np.uint64, buffer=tables.buf, offset=DEPARTURES_OFFSET)

    @staticmethod
    def tables_nbytes() -> int:
        return DEPARTURES_OFFSET + 8

    def restamp(self) -> bool:
        """Broker side: write broker.0's header again if a client changed it (it may write that
        object, even truncate it: shm/truncation_guard.py), so that clients can connect again; True
        if it had to."""
        identity = self.tables.buf[BROKER_IDENTITY_OFFSET:BROKER_IDENTITY_OFFSET + _HEADER.size]
        if self.seg.buf[:_HEADER.size] == identity:
            return False
        self.seg.buf[:_HEADER.size] = identity
        return True

    def set_extent_size(self, extent: int, size: int) -> None:
        """Broker side: its grown output extent ``extent`` exists with ``size`` bytes (extents.py)."""
        _set_extent_size(self.tables.buf, BROKER_EXTENTS_OFFSET, extent, size)

    @staticmethod
    def extent_size_in(buf: memoryview, extent: int) -> int:
        """The size the broker gave its extent ``extent`` in the ``tables.0`` ``buf`` maps (0: none)."""
        return _extent_size(buf, BROKER_EXTENTS_OFFSET, extent)

    @staticmethod
    def batches_nbytes(arena_bytes: int) -> int:
        """The part of the broker's ``arena_bytes`` that holds batch manifests (a sixteenth, 4 MiB
        by default: a manifest is a few hundred bytes of JSON per request)."""
        return _align(arena_bytes // 16)

    @staticmethod
    def connect_nbytes() -> int:
        """A connect ring's object's bytes: a header (its first byte is the ring's lock) and the ring."""
        return _align(HEADER_BYTES + Ring.nbytes(CONNECT_CAPACITY, CONNECT))

    @staticmethod
    def nbytes(arena_bytes: int, readers: int = 0) -> int:
        """All the objects' bytes, with ``readers`` other users' connect rings."""
        return HEADER_BYTES + arena_bytes + BrokerSegment.tables_nbytes() \
            + (1 + readers) * BrokerSegment.connect_nbytes()

    @classmethod
    def create(cls, server_id: str, arena_bytes: int, readers: tuple[int, ...] = ()) -> "BrokerSegment":
        """``readers``: the other users whose local clients may connect (access.py)."""
        batch_bytes = cls.batches_nbytes(arena_bytes)
        made: list[Segment] = []
        connects: dict[int, Segment] = {}
        unmade: list[int] = []
        try:
            made.append(Segment.create(object_name(server_id, "broker", 0), HEADER_BYTES + arena_bytes - batch_bytes,
                                       readers, taken=HEADER_BYTES + first_pages(arena_bytes)))
            made.append(Segment.create(object_name(server_id, "tables", 0), cls.tables_nbytes(), readers,
                                       readers_write=False))
            made.append(Segment.create(object_name(server_id, "batches", 0), batch_bytes,
                                       taken=first_pages(batch_bytes)))
            connects[os.geteuid()] = Segment.create(connect_name(server_id, os.geteuid(), True), cls.connect_nbytes())
            made.append(connects[os.geteuid()])
            for uid in readers:
                try:
                    connects[uid] = Segment.create(connect_name(server_id, uid, False), cls.connect_nbytes(), (uid,))
                except posix_ipc.ExistentialError:
                    unmade.append(uid)  # (a name someone else took first: that user cannot connect)
                    continue
                made.append(connects[uid])
        except BaseException:
            for seg in made:
                seg.close()
                seg.unlink()
            raise
        seg, tables, batches = made[:3]
        broker = cls(server_id, seg, tables, create=True, batches=batches, connects=connects)
        broker.unmade_connects = unmade
        return broker

    @classmethod
    def attach(cls, server_id: str) -> "BrokerSegment":
        """Map the broker's objects as a client or another server process: its tables writable
        where this process is of the server's user (it lowers the broker's flag there, nothing
        else), read-only for a client of another user; and the connect ring this process may write."""
        seg = Segment.attach(object_name(server_id, "broker", 0))
        tables = None
        try:
            if seg.size < HEADER_BYTES:
                raise ConnectionError(f"{seg.name} is not a shmserve segment ({seg.size} bytes)")
            magic = read_header(seg)[0]
            if magic & _FAMILY == MAGIC & _FAMILY:
                check_magic(seg.name, magic)  # first: another version has no tables.0 (or not as ours)
            tables = _attach_writable_if_ours(object_name(server_id, "tables", 0))
            uid, connect = _own_connect(server_id, seg.uid)
        except BaseException:
            seg.close()
            if tables is not None:
                tables.close()
            raise
        try:
            return cls(server_id, seg, tables, create=False, connects={uid: connect})
        except BaseException:
            seg.close()
            tables.close()
            connect.close()
            raise

    @staticmethod
    def started_ns_of(server_id: str) -> int:
        """The start time of the broker whose ``tables.0`` is there now (which only it writes:
        broker.0's header may be scribbled on); ConnectionError when there is none of this layout."""
        tables = Segment.attach(object_name(server_id, "tables", 0), readonly=True)
        try:
            return _identity(tables)[1]
        finally:
            tables.close()

    @property
    def pid(self) -> int:
        return _identity(self.tables)[0]

    @property
    def started_ns(self) -> int:
        return _identity(self.tables)[1]

    def lane_cookie(self, lane: int) -> int:
        return _COOKIE.unpack_from(self.tables.buf, lane * LANE_NAME_BYTES)[0]

    def lane_client(self, lane: int) -> tuple[str, int]:
        """(client segment name, cookie) of the lane's current holder. Records carry the cookie,
        so a worker can tell a lane's new holder from leftovers of a client that died."""
        off = lane * LANE_NAME_BYTES
        (cookie,) = _COOKIE.unpack_from(self.tables.buf, off)
        return bytes(self.tables.buf[off + 8:off + LANE_NAME_BYTES]).rstrip(b"\0").decode(), cookie

    def set_lane_client(self, lane: int, name: str, cookie: int) -> None:
        off = lane * LANE_NAME_BYTES
        raw = name.encode()[:LANE_NAME_BYTES - 8]
        self.tables.buf[off + 8:off + LANE_NAME_BYTES] = raw + b"\0" * (LANE_NAME_BYTES - 8 - len(raw))
        store_u64(self.tables.buf, off, cookie)  # (workers read it as they take the lane's records)

    def connects_pending(self) -> bool:
        """Broker side: whether a connect record waits on any ring."""
        return any(ring.pending() for ring in self.connect_rings.values())

    @contextlib.contextmanager
    def connect_lock(self, timeout: float = 5.0) -> Iterator[None]:
        """Hold this process's connect ring for one producer: a lock the kernel keeps on the first
        byte of the ring's file and drops when its holder dies, however it dies; a semaphore left
        taken by a client killed mid-announce refused every later one."""
        [connect] = self.connects.values()
        fd = os.open(SHM_DIR + connect.name, os.O_RDWR | os.O_CLOEXEC)
        try:
            deadline = time.monotonic() + timeout
            while not try_lock_byte(fd, 0):
                if time.monotonic() > deadline:
                    raise ConnectionError("the broker's connect ring is locked; is the server alive?")
                time.sleep(0.001)
            yield
        finally:
            os.close(fd)  # (closing lets go of the lock)

    def announce(self, ticket: int, client_name: str, timeout: float = 5.0) -> None:
        """Client side: put a connect record (its ticket, its segment's name) on this process's
        connect ring under its lock, ring the bell."""
        [ring] = self.connect_rings.values()
        with self.connect_lock(timeout):
            deadline = time.monotonic() + timeout
            while not ring.put(ticket, client_name.encode()):
                if time.monotonic() > deadline:
                    raise ConnectionError("the broker's connect ring stays full")
                time.sleep(0.001)
        self.waker.notify()

    def close(self) -> None:
        self.seg.close()
        self.tables.close()
        if self.batches is not None:
            self.batches.close()
        for connect in self.connects.values():
            connect.close()

    def unlink(self) -> None:
        self.seg.unlink()
        self.tables.unlink()
        if self.batches is not None:
            self.batches.unlink()
        for connect in self.connects.values():
            connect.unlink()


def _attach_writable_if_ours(name: str) -> Segment:
    """Map an object only the server writes: writable for a process of the server's user (or
    root), which lowers the receiver's sleeping flag there as it wakes it (waker.py), read-only
    for a client of another user."""
    try:
        return Segment.attach(name)
    except (PermissionError, posix_ipc.PermissionsError):
        return Segment.attach(name, readonly=True)


def connect_name(server_id: str, uid: int, servers: bool) -> str:
    """The connect ring of the server's own user (``connect.0``), or of another user ``uid``."""
    return object_name(server_id, "connect", 0 if servers else f"u{uid}")


def _own_connect(server_id: str, server_uid: int) -> tuple[int, Segment]:
    """The connect ring this process may write, and the user it is for: ``connect.0`` where this
    process may open it (the server's user, or root), else its own user's. PermissionError
    where there is none (a user --local-client-users does not name)."""
    try:
        return server_uid, Segment.attach(object_name(server_id, "connect", 0))
    except (PermissionError, posix_ipc.PermissionsError):
        pass
    try:
        connect = Segment.attach(connect_name(server_id, os.geteuid(), False))
    except posix_ipc.ExistentialError:
        raise PermissionError(f"the server has no connect ring for uid {os.geteuid()}") from None
    if connect.uid != server_uid:  # (a name another user took before the server made it)
        connect.close()
        raise NotTheServers(f"its connect ring for this user, {connect.name}, was made by uid {connect.uid}, not by "
                            f"the server (uid {server_uid}): remove it and restart the server")
    return os.geteuid(), connect


def lanes_name(worker_name: str, uid: int) -> str:
    """``/shmserve.<id>.worker.<n>.lanes.u<uid>``: the lanes of user ``uid``'s clients on worker
    ``worker.<n>`` (``lane_range``), which only that user and the server's may open."""
    return f"{worker_name}.lanes.u{uid}"


def lane_range(uid: int, readers: Sequence[int]) -> range:
    """The lanes the clients of ``uid`` may hold, ``readers`` being the other users whose clients
    may connect (--local-client-users, sorted: ``access.server_readers``): an equal share for each
    of them, the server's user counted (half with one named, a third with two), each in an object
    of its own; the rest are the server's user's (root's too), in the worker's segment. No user
    can then write, empty or scribble on another user's lanes, nor hold them all."""
    share = LANES // (len(readers) + 1)
    own = LANES - len(readers) * share
    if uid in readers:
        first = own + list(readers).index(uid) * share
        return range(first, first + share)
    return range(own)


class LaneBlock:
    """Lanes ``first`` to ``first + count - 1``, lying in one object: a bell each (a byte at
    LANE_BELLS_OFFSET, which a client sets after each put and the worker clears before it drains
    the lane), then the rings from HEADER_BYTES; their head and tail counters also as two strided
    views, so that one numpy compare finds work. The worker then looks at ``count`` contiguous
    bells (one compare, 70 ns) instead of every lane's counters, 512 cache lines a look."""

    def __init__(self, buf: memoryview, first: int, count: int) -> None:
        lane_bytes = Ring.nbytes(LANE_CAPACITY, RECORD)
        self.first = first
        self.count = count
        self.rings = [Ring(buf, HEADER_BYTES + i * lane_bytes, LANE_CAPACITY, RECORD) for i in range(count)]
        self.heads = np.ndarray((count,), dtype=np.uint64, buffer=buf, offset=HEADER_BYTES, strides=(lane_bytes,))
        self.tails = np.ndarray((count,), dtype=np.uint64, buffer=buf, offset=HEADER_BYTES + 8,
                                strides=(lane_bytes,))
        self.bells = buf[LANE_BELLS_OFFSET:LANE_BELLS_OFFSET + count]
        self.silent = bytes(count)

    @staticmethod
    def nbytes(count: int) -> int:
        return _align(HEADER_BYTES + count * Ring.nbytes(LANE_CAPACITY, RECORD))

    def reset(self) -> None:
        self.heads[:] = 0
        self.tails[:] = 0

    def rung(self) -> bool:
        return self.bells.tobytes() != self.silent

    def take_rung(self, lanes: list[int]) -> None:
        """Append the lanes whose bell rang to ``lanes``, clearing their bells: those a client set
        to 1, and any other byte not 0 (which only a process writing what the library never would
        leaves there: left set, it would keep the worker from ever sleeping)."""
        raw = self.bells.tobytes()
        if raw == self.silent:
            return
        found = 0
        i = raw.find(1)
        while i >= 0:
            lanes.append(self.first + i)
            self.bells[i] = 0
            found += 1
            i = raw.find(1, i + 1)
        if found != self.count - raw.count(0):
            for i in np.flatnonzero(np.frombuffer(raw, dtype=np.uint8) > 1).tolist():
                lanes.append(self.first + i)
                self.bells[i] = 0

    def pending(self) -> list[int]:
        """Lanes holding records."""
        if self.tails.tobytes() == self.heads.tobytes():
            return []
        return [self.first + i for i in np.flatnonzero(self.tails != self.heads).tolist()]

    def waiting(self) -> int:
        """The records waiting on these lanes, each lane counting at most its capacity (whatever
        was written in its counters)."""
        if self.tails.tobytes() == self.heads.tobytes():
            return 0
        return int(np.clip((self.tails - self.heads).astype(np.int64), 0, LANE_CAPACITY).sum())


def _attach_lanes(name: str, server_uid: int) -> Segment:
    """A client's map of its user's lanes object ``name``, which must be the server's: another
    user may have made one at that name (where the server's is gone) to read what is put there."""
    seg = Segment.attach(name)
    if seg.uid != server_uid or seg.size < LaneBlock.nbytes(0):
        seg.close()
        raise ConnectionError(f"{name} is not the server's (uid {seg.uid}, {seg.size} bytes)")
    magic, _, first, count = _LANES_HEADER.unpack_from(seg.buf, 0)
    try:
        check_magic(name, magic)
        if first + count > LANES or seg.size < LaneBlock.nbytes(count):
            raise ConnectionError(f"{name} is not a shmserve lanes object")
    except ConnectionError:
        seg.close()
        raise
    return seg


def control_name(worker_name: str) -> str:
    """``/shmserve.<id>.control.<n>``, the server-only half of worker segment ``.../worker.<n>``."""
    prefix, _, num = worker_name.rpartition(".worker.")
    return f"{prefix}.control.{num}"


class WorkerSegment:
    """A worker's objects. ``worker.<n>``, which only the server's user writes: the lanes of that
    user's clients (the frontends, its local clients) and the first extent of its output arena
    (clients free the answers they read). ``worker.<n>.lanes.u<uid>`` for each other user whose
    clients may connect (``readers``: --local-client-users): its clients' lanes (``lane_range``),
    which only that user (and the server's) may open, so that no user writes another's lanes.
    ``control.<n>``, which only the broker and the worker write and clients of other users may
    only read: the worker's sleeping flag, inbox (a batch names the requests the worker reads and
    answers), outbox and its messages, the extents' sizes consumers check, the readiness, garbage
    and want-wakeup words, statistics, custom metrics and region holds. Clients map the control
    object too, writable where they are of the server's user (they lower the flag as they wake
    the worker) and read-only otherwise (``attach``); and the lanes of their own user only."""

    def __init__(self, seg: Segment, control: Segment | None, create: bool, blocks: list[LaneBlock],
                 users: list[Segment] | None = None, name: str = "") -> None:
        self.seg = seg
        self.name = name or seg.name
        self.users = users or []  # the lanes objects mapped here (the worker and the broker: every user's)
        self.blocks = blocks
        # Lane i's ring and bell (its block's bells and its index there); None: not mapped here.
        self.lanes: list[Ring | None] = [None] * LANES
        self._bells: list[tuple[memoryview, int] | None] = [None] * LANES
        for block in blocks:
            for i in range(block.count):
                self.lanes[block.first + i] = block.rings[i]
                self._bells[block.first + i] = (block.bells, i)
        self.arena_offset = _align(HEADER_BYTES + LANES * Ring.nbytes(LANE_CAPACITY, RECORD))
        self.arena_size = seg.size - self.arena_offset
        self.control = control
        if control is not None:
            coff = HEADER_BYTES
            self.inbox = Ring(control.buf, coff, WORKER_RING_CAPACITY, RECORD)
            coff += Ring.nbytes(WORKER_RING_CAPACITY, RECORD)
            self.outbox = Ring(control.buf, coff, WORKER_RING_CAPACITY, RECORD)
            coff = _align(coff + Ring.nbytes(WORKER_RING_CAPACITY, RECORD))
            # Written by the worker, read by the broker's housekeeping: who to disconnect.
            self.garbage = np.ndarray((LANES,), dtype=np.uint64, buffer=control.buf, offset=GARBAGE_OFFSET)
            self.stats = StatsArea(control.buf, coff)  # see stats.py: written by the worker, summed by the broker
            coff = _align(coff + StatsArea.nbytes())
            # The model's own metrics (workers/custom_metrics.py), read by the broker at scrape time.
            self.custom_metrics = Published(control.buf, coff, CUSTOM_METRICS_BYTES)
            coff += CUSTOM_METRICS_BYTES
            # The regions its unfinished lane requests name, read by the broker to defer unregisters.
            self.region_holds = Published(control.buf, coff, REGION_HOLDS_BYTES)
            coff += REGION_HOLDS_BYTES
            self.messages_offset = coff  # the payloads of its outbox's messages (an arena)
            assert coff + MESSAGES_BYTES == CONTROL_EXTENTS_OFFSET  # (then the extents' sizes)
        if create:
            assert control is not None
            _HEADER.pack_into(seg.buf, 0, MAGIC, 0, time.time_ns())
            _HEADER.pack_into(control.buf, 0, MAGIC, 0, time.time_ns())
            self.inbox.reset()
            self.outbox.reset()
            for block in blocks:
                block.reset()
        # In the control object, which only the broker and the worker write (clients map it read-only)
        self.waker = Waker.on_word(control.buf, SLEEPING_FLAG_OFFSET) if control is not None else None

    def messages(self) -> Arena:
        """Owner side (the worker): the arena its outbox's payloads are written in."""
        assert self.control is not None
        return Arena(self.control.buf, self.messages_offset, MESSAGES_BYTES)

    def readiness(self) -> tuple[int, int, int, int]:
        """(has is_ready, asks, asks answered, verdict): see READINESS_OFFSET."""
        assert self.control is not None
        return _READINESS.unpack_from(self.control.buf, READINESS_OFFSET)

    def set_readiness_word(self, index: int, value: int) -> None:
        """One word of the readiness block, each written by one side only (see _READINESS)."""
        assert self.control is not None
        store_u64(self.control.buf, READINESS_OFFSET + 8 * index, value)

    def set_extent_size(self, extent: int, size: int) -> None:
        """Worker side: extent ``extent`` (1 .. MAX_EXTENTS-1) exists with ``size`` bytes."""
        assert self.control is not None
        _set_extent_size(self.control.buf, CONTROL_EXTENTS_OFFSET, extent, size)

    @staticmethod
    def extent_size_in(buf: memoryview, extent: int) -> int:
        """The size the worker gave extent ``extent`` in the control object ``buf`` maps; 0 for
        one it never made or out of range."""
        return _extent_size(buf, CONTROL_EXTENTS_OFFSET, extent)

    def report_garbage(self, lane: int, cookie: int, fault: Fault) -> None:
        """Worker side: the holder of ``lane`` with ``cookie`` wrote garbage (the broker
        disconnects it). A word per lane, rewritten, never cleared: cookies are never reused."""
        self.garbage[lane] = (int(fault) << _FAULT_SHIFT) | (cookie & ((1 << _FAULT_SHIFT) - 1))

    def garbage_reports(self) -> list[tuple[int, int, Fault]]:
        """Broker side: (lane, cookie, fault) of every lane a report names."""
        out = []
        for lane in np.flatnonzero(self.garbage).tolist():
            word = int(self.garbage[lane])
            try:
                fault = Fault(word >> _FAULT_SHIFT)
            except ValueError:
                continue  # torn or scribbled on: the worker rewrites it on the next garbage
            out.append((lane, word & ((1 << _FAULT_SHIFT) - 1), fault))
        return out

    def restamp_lanes(self) -> None:
        """Write each user's lanes object's header again (the worker): one its user truncated
        was grown back with zeros, and that user's clients could no longer map it."""
        for user, block in zip(self.users, self.blocks[1:]):
            if _LANES_HEADER.unpack_from(user.buf, 0) != (MAGIC, 0, block.first, block.count):
                _LANES_HEADER.pack_into(user.buf, 0, MAGIC, 0, block.first, block.count)

    def lanes_pending(self) -> list[int]:
        """Lanes holding records."""
        return [lane for block in self.blocks for lane in block.pending()]

    def lanes_waiting(self, others: bool = True) -> int:
        """The records waiting on the lanes (``LaneBlock.waiting``): on the server's user's
        alone without ``others`` (counters no other user can write)."""
        return sum(block.waiting() for block in (self.blocks if others else self.blocks[:1]))

    def ring_bell(self, lane: int) -> None:
        at = self._bells[lane]
        if at is not None:
            at[0][at[1]] = 1

    def bells_rung(self) -> bool:
        for block in self.blocks:
            if block.rung():
                return True
        return False

    def ring_pending_bells(self) -> None:
        """Ring the bell of every lane holding records: a client killed between its put and its
        bell left a record no bell announces (drained, it is skipped by its stale cookie)."""
        for lane in self.lanes_pending():
            self.ring_bell(lane)

    def take_rung_lanes(self) -> list[int]:
        """The lanes whose bell rang, with their bells cleared. The fence orders the clearing
        before the caller's reads of the lanes' tails: a put it misses rings the bell again."""
        lanes: list[int] = []
        for block in self.blocks:
            block.take_rung(lanes)
        if lanes:
            fence()
        return lanes

    @staticmethod
    def lanes_nbytes(arena_bytes: int) -> int:
        """``worker.<n>``'s bytes (the server's user's lanes, then its first extent)."""
        return _align(HEADER_BYTES + LANES * Ring.nbytes(LANE_CAPACITY, RECORD)) + arena_bytes

    @staticmethod
    def control_nbytes() -> int:
        return CONTROL_EXTENTS_OFFSET + 8 * EXTENT_ENTRIES

    @staticmethod
    def nbytes(arena_bytes: int, users: int = 0) -> int:
        """Every object's bytes, with ``users`` other users' lanes objects."""
        share = LANES // (users + 1)
        return (WorkerSegment.lanes_nbytes(arena_bytes) + WorkerSegment.control_nbytes()
                + users * LaneBlock.nbytes(share))

    @classmethod
    def create(cls, name: str, arena_bytes: int, readers: tuple[int, ...] = ()) -> "WorkerSegment":
        """``readers``: the other users whose local clients may call it (access.py), sorted.
        posix_ipc.ExistentialError where one of its names is another user's (nothing is left)."""
        made: list[Segment] = []
        try:
            seg = Segment.create(name, cls.lanes_nbytes(arena_bytes), (),
                                 taken=cls.lanes_nbytes(0) + first_pages(arena_bytes))
            made.append(seg)
            control = Segment.create(control_name(name), cls.control_nbytes(), readers, readers_write=False)
            made.append(control)
            blocks = [LaneBlock(seg.buf, 0, len(lane_range(os.geteuid(), readers)))]
            users = []
            for uid in readers:
                lanes = lane_range(uid, readers)
                user = Segment.create(lanes_name(name, uid), LaneBlock.nbytes(len(lanes)), (uid,))
                made.append(user)
                _LANES_HEADER.pack_into(user.buf, 0, MAGIC, 0, lanes.start, len(lanes))
                users.append(user)
                blocks.append(LaneBlock(user.buf, lanes.start, len(lanes)))
        except BaseException:
            for done in made:
                done.close()
                done.unlink()
            raise
        return cls(seg, control, True, blocks, users)

    @classmethod
    def attach(cls, name: str, control: bool = True, control_writable: bool = True,
               readers: tuple[int, ...] | None = None) -> "WorkerSegment":
        """Map worker segment ``name`` with its control object: writable where this process is of
        the server's user, else read-only (a client of another user, whose waker only reads the
        sleeping flag there); ``control_writable=False``: read-only (a reader of its statistics);
        ``control=False``: the lanes alone (they cannot wake it). ``readers`` (the worker): every
        user's lanes, ``readers`` being the other users (``create``'s); None (a client): its own
        user's alone, in ``worker.<n>`` for the server's user, else in its user's lanes object,
        which must be the server's (the control object's owner's)."""
        seg: Segment | None = None
        ctl: Segment | None = None
        users: list[Segment] = []
        try:
            ctl = (_attach_writable_if_ours(control_name(name)) if control_writable else
                   Segment.attach(control_name(name), readonly=True)) if control else None
            if ctl is not None and ctl.size < cls.control_nbytes():
                raise ConnectionError(f"{ctl.name} is not a shmserve worker's control object ({ctl.size} bytes)")
            me = os.geteuid()
            server_uid = ctl.uid if ctl is not None else os.stat(SHM_DIR + name).st_uid
            if readers is None and me not in (server_uid, 0):
                users.append(_attach_lanes(lanes_name(name, me), server_uid))
                first, count = _LANES_HEADER.unpack_from(users[0].buf, 0)[2:]
                seg = users[0]  # (a client of another user maps no more of it)
                return cls(seg, ctl, False, [LaneBlock(seg.buf, first, count)], users, name)
            seg = Segment.attach(name)
            # (a client of the server's user knows not which lanes are other users': it maps all
            # of this object's, and uses the one the broker gave it)
            blocks = [LaneBlock(seg.buf, 0, len(lane_range(server_uid, readers or ())))]
            for uid in readers or ():
                lanes = lane_range(uid, readers or ())
                # (at the size the broker made it: its user may have truncated it meanwhile)
                users.append(Segment.attach(lanes_name(name, uid), size=LaneBlock.nbytes(len(lanes))))
                blocks.append(LaneBlock(users[-1].buf, lanes.start, len(lanes)))
            return cls(seg, ctl, False, blocks, users, name)
        except BaseException:
            for done in (seg, ctl, *users):
                if done is not None:
                    done.close()
            raise

    def set_pid(self, pid: int) -> None:
        struct.pack_into("<I", self.seg.buf, 4, pid)

    @property
    def want_wakeup(self) -> bool:
        assert self.control is not None
        return _WANT_WAKEUP.unpack_from(self.control.buf, WANT_WAKEUP_OFFSET)[0] != 0

    @want_wakeup.setter
    def want_wakeup(self, value: bool) -> None:
        assert self.control is not None
        store_u32(self.control.buf, WANT_WAKEUP_OFFSET, 1 if value else 0)  # (a worker reads it at any time)

    def close(self) -> None:
        if self.seg not in self.users:
            self.seg.close()
        for user in self.users:
            user.close()
        if self.control is not None:
            self.control.close()

    def unlink(self) -> None:
        """Owner side (the broker): remove every object of this worker's."""
        self.seg.unlink()
        unlink_shm(control_name(self.name))
        for user in self.users:
            user.unlink()


class ClientSegment:
    """``fifo=True`` wakes the client through a FIFO an asyncio loop can watch, else a futex on its flag."""

    def __init__(self, seg: Segment, slots: int, create: bool, fifo: bool = False, notify: int | None = None,
                 ticket: int = 0, readers: tuple[int, ...] = ()) -> None:
        self.seg = seg
        self.name = seg.name
        off = HEADER_BYTES
        self.requests = Ring(seg.buf, off, REQUEST_CAPACITY, RECORD)
        off += Ring.nbytes(REQUEST_CAPACITY, RECORD)
        self.slots_offset = off
        self.nslots = slots
        self.slot_states = np.ndarray((slots,), dtype=np.uint32, buffer=seg.buf, offset=off,
                                      strides=(SLOT_BYTES,))
        off = _align(off + slots * SLOT_BYTES)
        self.arena_offset = off
        self.layout = Layout(slots, off, seg.size)  # what its records are checked against (untrusted.py)
        self.fifo_path = f"/dev/shm{seg.name}.fifo"
        self.fifo_fd: int | None = None
        flag = flag_view(seg.buf, SLEEPING_FLAG_OFFSET)
        if create:
            kind = notify if notify is not None else NOTIFY_FIFO if fifo else NOTIFY_FUTEX
            _HEADER.pack_into(seg.buf, 0, MAGIC, ticket, time.time_ns())
            _PROCESS.pack_into(seg.buf, PROCESS_OFFSET, os.getpid(), pid_namespace())
            struct.pack_into("<III", seg.buf, 16, slots, kind, LANE_PENDING)
            self.requests.reset()
            self.slot_states[:] = 0
            if kind == NOTIFY_BROKER:
                pass  # answers for the broker itself: its own flag is woken (tables.0)
            elif fifo:
                self.fifo_fd = make_fifo(self.fifo_path, readers)
                flag[0] = SLEEPING  # the owner's loop waits on the FIFO from the start
            self.arena: Arena | None = Arena(seg.buf, off, seg.size - off, seg.populate)
        else:
            self.arena = None
        self.notify_kind = struct.unpack_from("<I", seg.buf, NOTIFY_KIND_OFFSET)[0]
        if self.notify_kind == NOTIFY_FUTEX:
            self.waker = Waker.on_word(seg.buf, SLEEPING_FLAG_OFFSET)
        else:
            self.waker = Waker(flag, fifo_path=self.fifo_path if self.notify_kind == NOTIFY_FIFO else None,
                               fifo_owner=seg.uid)

    @staticmethod
    def nbytes(slots: int, arena_bytes: int) -> int:
        return _align(HEADER_BYTES + Ring.nbytes(REQUEST_CAPACITY, RECORD) + slots * SLOT_BYTES) + arena_bytes

    @classmethod
    def create(cls, name: str, arena_bytes: int, ticket: int, slots: int = DEFAULT_SLOTS, fifo: bool = False,
               notify: int | None = None, readers: tuple[int, ...] = ()) -> "ClientSegment":
        """``ticket``: the creating process's liveness ticket (shm/liveness.py), kept in the
        header where the other segments keep their pid. ``readers``: the server's user, when it
        is not ours (access.py)."""
        seg = Segment.create(name, cls.nbytes(slots, arena_bytes), readers,
                             taken=cls.nbytes(slots, 0) + first_pages(arena_bytes))
        return cls(seg, slots, create=True, fifo=fifo, notify=notify, ticket=ticket, readers=readers)

    @classmethod
    def attach(cls, name: str) -> "ClientSegment":
        """Map a client's segment (the broker and workers do), its header checked against its
        size first: a client may have written anything there (raises ``untrusted.Garbage``).
        Its owner is the client's user, so only an object its owner alone could write is one
        (PermissionError otherwise: ``Segment.attach``)."""
        seg = Segment.attach(name, owner_only=True, zero=True)  # (truncated by its client: zeroed here)
        try:
            if seg.size < HEADER_BYTES:
                raise Garbage(Fault.HEADER, f"{name} has {seg.size} bytes")
            check_magic(name, read_header(seg)[0])
            slots, notify_kind = struct.unpack_from("<II", seg.buf, 16)
            check_layout(seg.size, slots, notify_kind, NOTIFY_KINDS, HEADER_BYTES,
                         Ring.nbytes(REQUEST_CAPACITY, RECORD), SLOT_BYTES)
            return cls(seg, slots, create=False)
        except BaseException:
            seg.close()
            raise

    def cancel_pending(self) -> int:
        """Set the cancelled word of every pending slot (its owner died or was disconnected):
        workers then drop its requests they have not run, and a running model sees
        ``is_cancelled()``. Returns how many."""
        pending = np.flatnonzero(self.slot_states == SLOT_PENDING).tolist()
        for slot in pending:
            self.cancel(slot)
        return len(pending)

    def disconnected(self) -> bool:
        """Whether the broker refused this connection for what it wrote (``LANE_REFUSED``)."""
        return self.lane == LANE_REFUSED

    @property
    def ticket(self) -> int:
        """The creator's liveness ticket (shm/liveness.py), from the segment's name
        (``client.<ticket>-<k>``, checked against the ticket's lock when the broker took the
        connect record; ``client.broker``: the broker's), never from the header the creator may
        rewrite later."""
        tail = self.name.rsplit(".", 1)[-1]
        return BROKER_TICKET if tail == "broker" else int(tail.split("-", 1)[0])

    def process(self) -> tuple[int, int]:
        """(pid, PID namespace inode) the creator wrote: its pid means something here only if the
        namespace is ours (``pid_namespace()``), and even then it is the client's word."""
        return _PROCESS.unpack_from(self.seg.buf, PROCESS_OFFSET)

    @property
    def lane(self) -> int:
        return struct.unpack_from("<I", self.seg.buf, LANE_OFFSET)[0]

    @lane.setter
    def lane(self, value: int) -> None:
        store_u32(self.seg.buf, LANE_OFFSET, value)  # (the client polls it: never a passing 0, lane 0)

    @property
    def cookie(self) -> int:
        return struct.unpack_from("<Q", self.seg.buf, COOKIE_OFFSET)[0]

    @cookie.setter
    def cookie(self, value: int) -> None:
        store_u64(self.seg.buf, COOKIE_OFFSET, value)

    def set_target(self, slot: int, worker: int) -> None:
        """Record which worker a direct request went to (worker + 1; 0: through the broker), so the
        broker can fail it if that worker dies."""
        store_u64(self.seg.buf, self.slots_offset + slot * SLOT_BYTES + 32, worker)

    def target(self, slot: int) -> int:
        return struct.unpack_from("<Q", self.seg.buf, self.slots_offset + slot * SLOT_BYTES + 32)[0]

    def bind(self, slot: int, offset: int, length: int) -> None:
        """Owner side, before a direct request's lane record: the block the request in ``slot``
        lies in, not taken yet (``take_bound``)."""
        base = self.slots_offset + slot * SLOT_BYTES
        BOUND.pack_into(self.seg.buf, base + BOUND_AT, offset, length)
        store_u32(self.seg.buf, base + TAKEN_AT, 0)

    def bound(self, slot: int) -> tuple[int, int]:
        """(offset, length) of the block ``bind`` bound ``slot`` to."""
        return BOUND.unpack_from(self.seg.buf, self.slots_offset + slot * SLOT_BYTES + BOUND_AT)

    def taken(self, slot: int) -> bool:
        """Whether the worker took the lane record of the request in ``slot``."""
        return struct.unpack_from("<I", self.seg.buf, self.slots_offset + slot * SLOT_BYTES + TAKEN_AT)[0] != 0

    def unbind(self, slot: int) -> None:
        """Owner side, for a request that goes through the broker: no lane record can take the
        slot (one left by an earlier use, written again)."""
        base = self.slots_offset + slot * SLOT_BYTES
        store_u32(self.seg.buf, base + TAKEN_AT, 1)
        BOUND.pack_into(self.seg.buf, base + BOUND_AT, 0, 0)

    def take_bound(self, slot: int, offset: int, length: int, worker: int) -> bool:
        """Worker side: whether a lane record for ``slot`` and this block is the owner's request
        to this worker, pending and not taken yet; if so, it is taken now. (Only the owner and
        the server write the slot, and only this worker takes records of its lanes.)"""
        base = self.slots_offset + slot * SLOT_BYTES
        buf = self.seg.buf
        state, target, _, taken = _TAKE.unpack_from(buf, base)
        if state != SLOT_PENDING or target != worker + 1 or taken or BOUND.unpack_from(buf, base + BOUND_AT) != (
                offset, length):
            return False
        store_u32(buf, base + TAKEN_AT, 1)
        return True

    def cancel(self, slot: int) -> None:
        """The owner gave up on the request in ``slot``: its worker's model sees it through
        ``cancelled`` (Triton's ``is_cancelled``); the slot stays pending until it is answered."""
        store_u32(self.seg.buf, self.slots_offset + slot * SLOT_BYTES + CANCEL_AT, 1)

    def uncancel(self, slot: int) -> None:
        """A slot taken for a new request starts uncancelled (before it is marked pending)."""
        store_u32(self.seg.buf, self.slots_offset + slot * SLOT_BYTES + CANCEL_AT, 0)

    def cancelled(self, slot: int) -> bool:
        return struct.unpack_from("<I", self.seg.buf, self.slots_offset + slot * SLOT_BYTES + CANCEL_AT)[0] != 0

    def complete(self, slot: int, status: int, role: int, num: int, offset: int, length: int) -> None:
        """Answer a request: the answer's fields first (never the state or target words, which
        others poll: protocol.py), state last; the caller then calls ``waker.notify``."""
        base = self.slots_offset + slot * SLOT_BYTES
        SLOT_ANSWER.pack_into(self.seg.buf, base + SLOT_ANSWER_AT, status, role, num, offset, length)
        self.slot_states[slot] = SLOT_DONE  # one aligned store, after the fields

    def read_slot(self, slot: int) -> tuple[int, int, int, int, int, int, int]:
        """(state, status, role, segment number, offset, length, target) of a slot."""
        return SLOT.unpack_from(self.seg.buf, self.slots_offset + slot * SLOT_BYTES)

    def set_slot_state(self, slot: int, state: int) -> None:
        self.slot_states[slot] = state

    def close(self) -> None:
        self.waker.close()
        if self.fifo_fd is not None:
            os.close(self.fifo_fd)
            self.fifo_fd = None
        self.seg.close()

    def unlink(self) -> None:
        """Remove the segment's name and its FIFO's (one another user made may stay: logged once)."""
        unlink_path(self.fifo_path)
        self.seg.unlink()
