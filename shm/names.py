"""Names of every shared-memory object and semaphore a server owns, and their cleanup.

All objects are named ``/shmserve.<server-id>.<role>.<n>`` so that one server's objects can be
listed, and removed after a crash, without touching anybody else's.
"""
from __future__ import annotations

import logging
import os
import random
import re
import stat
from typing import Callable, Iterator

import posix_ipc

PREFIX = "shmserve"
SHM_DIR = "/dev/shm"
ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
log = logging.getLogger("shmserve.names")
_rng = random.SystemRandom()  # (names another user must not predict from those made before)
_warned: set[tuple[str, str]] = set()  # (name, why) already logged: a squatted name is met at every sweep


def check_server_id(server_id: str) -> str:
    """Server ids become part of file names in /dev/shm, so only a safe alphabet is allowed."""
    if not ID_RE.match(server_id):
        raise ValueError(f"invalid server id {server_id!r}: use 1-64 letters, digits, '_' or '-'")
    return server_id


def object_name(server_id: str, role: str, n: int | str) -> str:
    return f"/{PREFIX}.{server_id}.{role}.{n}"


def is_client_segment(name: str) -> bool:
    """Whether ``name`` is a client's segment (``/shmserve.<id>.client.<ticket>-<k>``, or the
    broker's own ``client.broker``), which only its own requests use."""
    return name.startswith("/" + PREFIX + ".") and ".client." in name


def extent_name(server_id: str, worker: int, extent: int) -> str:
    """A worker's grown output extent ``extent`` (1, 2, ...; extent 0 lies in its own segment)."""
    return object_name(server_id, "worker", f"{worker}.arena.{extent}")


def broker_extent_name(server_id: str, extent: int) -> str:
    """The broker's grown output extent ``extent`` (1, 2, ...; extent 0 lies in ``broker.0``)."""
    return object_name(server_id, "broker", f"0.arena.{extent}")


RESERVED_PREFIXES = (PREFIX + ".", "sem.")
# The local client's own regions (``Client.create_region``): ``/shmclient.<ticket>.<name>`` (its
# process's liveness ticket, liveness.py). Not in RESERVED_PREFIXES: only the client process
# holding ``<ticket>`` may register one (server/broker/region_access.py).
CLIENT_PREFIX = "shmclient."


def reserved_prefix(name: str) -> str | None:
    """The prefix of the namespace shmserve reserves that ``name`` lies in (clients may never
    register these), including the files that back its semaphores (``sem.shmserve.*``)."""
    bare = name.lstrip("/")
    return next((p for p in RESERVED_PREFIXES if bare.startswith(p)), None)


def is_server_object(name: str) -> bool:
    """True for any name in the namespace shmserve reserves."""
    return reserved_prefix(name) is not None


def list_objects(server_id: str) -> tuple[list[str], list[str]]:
    """(shared-memory names, semaphore names) that belong to ``server_id``."""
    stem = f"{PREFIX}.{server_id}."
    shms: list[str] = []
    sems: list[str] = []
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return shms, sems
    for entry in entries:
        if entry.startswith(stem):
            shms.append("/" + entry)
        elif entry.startswith("sem." + stem):
            sems.append("/" + entry[4:])
    return shms, sems


def warn_once(name: str, why: str) -> None:
    """Log ``name`` and ``why`` the first time they are met together (another user's object at a
    name of ours is met again at every clean-up and every growth)."""
    if (name, why) not in _warned:
        _warned.add((name, why))
        log.warning("%s %s", name, why)


def _unlink(remove: Callable[[str], None], name: str) -> bool:
    """``remove(name)``; False where it was not there, or could not be removed: a directory,
    another user's object in the sticky /dev/shm, a symlink another user owns. Such an object
    is another user's doing, which must not stop a clean-up or a start (it is logged once)."""
    try:
        remove(name)
        return True
    except (posix_ipc.ExistentialError, FileNotFoundError):
        return False
    except (OSError, posix_ipc.Error) as e:
        warn_once(name, f"could not be removed from {SHM_DIR} ({e}); left as it is")
        return False


def unlink_path(path: str) -> bool:
    """``os.unlink`` of a file of ours in /dev/shm (a client's FIFO), as ``_unlink`` removes an
    object: one another user made there stays, logged once."""
    return _unlink(os.unlink, path)


def unlink_semaphore(name: str) -> bool:
    return _unlink(posix_ipc.unlink_semaphore, name)


def unlink_shm(name: str) -> bool:
    return _unlink(posix_ipc.unlink_shared_memory, name)


def remove_stale(name: str) -> None:
    """Remove what a dead process of the server's own user left at ``name`` (a plain file this
    user owns); anything else there (another user's, a directory, a symlink) is left alone, and
    the caller takes another name."""
    try:
        st = os.lstat(SHM_DIR + name)
    except OSError:
        return
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
        unlink_shm(name)


def try_numbers(first: int, limit: int, taken: set[int], usable: Callable[[int], bool] = lambda n: True,
                sequential: int = 4, tries: int = 16) -> Iterator[tuple[int, bool]]:
    """Numbers for a new object whose name ends in a number never reused, until the caller made
    one: (number, whether it is the next in sequence). The first ``sequential`` are the next
    ones from ``first`` (skipping ``taken``: numbers used out of sequence); the rest are random in
    ``[first, limit)``, so that another user who made the next names in /dev/shm (which the
    server may not remove) cannot guess, nor make in advance, every name it tries."""
    n = first
    for _ in range(sequential):
        while n < limit and (n in taken or not usable(n)):
            n += 1
        if n >= limit:
            return
        yield n, True
        n += 1
    for _ in range(tries - sequential):
        if n >= limit:
            return
        pick = _rng.randrange(n, limit)
        if pick not in taken and usable(pick):
            yield pick, False


def set_title(title: str) -> None:
    """The process title operators see in ``ps`` (setproctitle is a dependency)."""
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:  # pragma: no cover
        pass


def title_of(pid: int | str) -> str:
    """A process's command line as ``ps`` shows it (our processes' titles, ``set_title``); ''
    when it is gone or may not be read."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def ours(shms: list[str], sems: list[str]) -> tuple[list[str], list[str]]:
    """Of ``list_objects``' names, those this process's user owns: a local client of another user
    (``--local-client-users``) makes its own segment and FIFO, which a sticky /dev/shm
    lets only that user remove (it does, as it closes)."""
    me = os.geteuid()

    def owned(path: str) -> bool:
        try:
            return me == 0 or os.stat(path, follow_symlinks=False).st_uid == me
        except OSError:  # gone meanwhile
            return False

    return ([n for n in shms if owned(SHM_DIR + n)],
            [n for n in sems if owned(f"{SHM_DIR}/sem.{n.lstrip('/')}")])


def unlink_all(server_id: str) -> int:
    """Remove every object of ``server_id`` its user owns; returns how many were removed."""
    shms, sems = ours(*list_objects(server_id))
    return sum(unlink_shm(n) for n in shms) + sum(unlink_semaphore(n) for n in sems)


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); it is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().split(b") ", 1)[1][:1] != b"Z"
    except (OSError, IndexError):
        return True
