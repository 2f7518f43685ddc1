"""Liveness without pids: tickets, locks on the broker segment's file that the kernel drops when
their holder dies.

A pid means nothing across PID namespaces (a client in another container of the pod, sharing
only /dev/shm): there it names no process, or a different one. So the server keys nothing on a
client's pid. Instead each client process takes a *ticket*, a number T in [1, 2**31), by holding
an open-file-description lock (``F_OFD_SETLK``) on byte T of the broker segment's file in
/dev/shm; the broker holds byte 0 (``BROKER_TICKET``). Whoever can open that file asks whether
byte T is held (``F_OFD_GETLK``, which reports a lock without taking it): the kernel releases
the lock when the last descriptor of its holder closes, i.e. when the process exits or is
killed, in any namespace. Holding the lock also makes the ticket unique among live clients, so
it names them: a client segment is ``client.<T>-<k>``, its regions ``/shmclient.<T>.<name>``,
and the arena blocks it must read carry T as their consumer.

One ticket per process and server, kept until the process exits (as a pid was): answers a
closed connection's arrays still point into stay its own. A child made by fork() takes its own.
"""
from __future__ import annotations

import fcntl
import os
import secrets
import struct
import threading

from .names import ID_RE, PREFIX, SHM_DIR, object_name

BROKER_TICKET = 0
MAX_TICKET = (1 << 31) - 1
# Random tickets tried before giving up: live clients hold a few thousand of 2**31 at most, so
# only a process that locked every free byte (any user who may open the file for writing may)
# makes them all fail; a client then gets an error rather than spin for ever.
TAKE_TRIES = 64


class NoTicket(RuntimeError):
    """No free ticket was found: another process holds the locks of every byte tried."""
_FLOCK = struct.Struct("@hhqqi4x")  # struct flock: type, whence, start, len, pid (0 for OFD locks)



def try_lock_byte(fd: int, at: int) -> bool:
    """Take byte ``at`` of ``fd``'s file for this open file description; False if another holds
    it. The kernel lets go when the description is closed, by its process's death included."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, at, 1, 0))
    except (BlockingIOError, PermissionError):
        return False
    return True


def broker_path(server_id: str) -> str:
    return SHM_DIR + object_name(server_id, "broker", 0)


class Tickets:
    """An open descriptor on the broker segment's file, through which tickets are held and asked
    about. The descriptor is close-on-exec; a forked child must not use its parent's (it would
    share the parent's locks), see ``process_ticket``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        self.inode = os.fstat(self.fd).st_ino
        self.own: set[int] = set()

    def hold(self, ticket: int) -> bool:
        """Take ``ticket`` for this process; False if a live process holds it."""
        if not try_lock_byte(self.fd, ticket):
            return False
        self.own.add(ticket)
        return True

    def take(self) -> int:
        """A free ticket, held from now on (a random one: unguessable is not needed, only unique).
        Raises NoTicket after ``TAKE_TRIES`` held ones."""
        for _ in range(TAKE_TRIES):
            ticket = 1 + secrets.randbelow(MAX_TICKET)
            if self.hold(ticket):
                return ticket
        raise NoTicket(f"{TAKE_TRIES} random tickets of {self.path} were all held: a process that may write "
                       f"that file holds locks on its free bytes")

    def held(self, ticket: int) -> bool:
        """Whether a live process holds ``ticket`` (this one included)."""
        if ticket in self.own:
            return True
        if not 0 <= ticket <= MAX_TICKET:
            return False
        got = fcntl.fcntl(self.fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, ticket, 1, 0))
        return _FLOCK.unpack(got)[0] != fcntl.F_UNLCK

    def current(self) -> bool:
        """Whether the file is still the one named (a restarted broker makes a new one)."""
        try:
            return os.stat(self.path).st_ino == self.inode
        except OSError:
            return False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def running_servers() -> list[str]:
    """The ids of the servers running on this host whose broker file this process may open (its
    broker holds byte 0 of it: a server killed with SIGKILL left the file, not the lock): what a
    client that named no running server is told, so that a wrong --id says which are there."""
    prefix, suffix = PREFIX + ".", ".broker.0"
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    found = []
    for name in names:
        server_id = name[len(prefix):-len(suffix)]
        if not (name.startswith(prefix) and name.endswith(suffix) and ID_RE.match(server_id)):
            continue
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, BROKER_TICKET, 1, 0))
            if _FLOCK.unpack(got)[0] != fcntl.F_UNLCK:
                found.append(server_id)
        except OSError:
            pass
        finally:
            os.close(fd)
    return sorted(found)


# -- the client process's own ticket, per server ------------------------------------------------------
_mine: dict[str, tuple[Tickets, int]] = {}
_mine_lock = threading.Lock()


def process_ticket(server_id: str) -> tuple[Tickets, int]:
    """This process's ticket with the server ``server_id`` (taken on first use, or anew once the
    broker's file was replaced by a restarted broker). Raises OSError if there is no broker file,
    NoTicket if no ticket could be had."""
    with _mine_lock:
        got = _mine.get(server_id)
        if got is not None and got[0].current():
            return got
        tickets = Tickets(broker_path(server_id))
        try:
            ticket = tickets.take()
        except NoTicket:
            tickets.close()
            raise
        if got is not None:
            got[0].close()  # the old broker's file: our lock there means nothing any more
        got = _mine[server_id] = (tickets, ticket)
        return got


def _forget_in_child() -> None:
    """After fork(): the inherited descriptors share the parent's locks, so drop them (the
    parent's locks stay: it holds its own descriptors) and take fresh tickets when needed."""
    global _mine_lock
    _mine_lock = threading.Lock()
    for tickets, _ in _mine.values():
        tickets.close()
    _mine.clear()


os.register_at_fork(after_in_child=_forget_in_child)

# -- the server's processes (broker, workers): whom to ask about consumers ------------------------------
_watcher: Tickets | None = None


def watch(server_id: str) -> Tickets:
    """Open the broker's file for this server process's liveness checks (``consumer_alive``)."""
    return watch_file(broker_path(server_id))


def watch_file(path: str) -> Tickets:
    """``watch`` on a given file (the broker's, or a test's)."""
    global _watcher
    _watcher = Tickets(path)
    return _watcher


def stop_watching() -> None:
    global _watcher
    if _watcher is not None:
        _watcher.close()
    _watcher = None


def consumer_alive(ticket: int) -> bool:
    """Whether the consumer of an arena block (a client's ticket) still lives. Without a watcher
    (a process that serves no clients) every consumer counts as alive: nothing is reclaimed early."""
    return _watcher is None or _watcher.held(ticket)
