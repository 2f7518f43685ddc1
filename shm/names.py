"""Names of every shared-memory object and semaphore a server owns, and their cleanup.

All objects are named ``/shmserve.<server-id>.<role>.<n>`` so that one server's objects can be
listed, and removed after a crash, without touching anybody else's.
"""
from __future__ import annotations

import os
import re

import posix_ipc

PREFIX = "shmserve"
SHM_DIR = "/dev/shm"
_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_server_id(server_id: str) -> str:
    """Server ids become part of file names in /dev/shm, so only a safe alphabet is allowed."""
    if not _ID_RE.match(server_id):
        raise ValueError(f"invalid server id {server_id!r}: use 1-64 letters, digits, '_' or '-'")
    return server_id


def object_name(server_id: str, role: str, n: int | str) -> str:
    return f"/{PREFIX}.{server_id}.{role}.{n}"


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


def unlink_semaphore(name: str) -> bool:
    try:
        posix_ipc.unlink_semaphore(name)
        return True
    except posix_ipc.ExistentialError:
        return False


def unlink_shm(name: str) -> bool:
    try:
        posix_ipc.unlink_shared_memory(name)
        return True
    except posix_ipc.ExistentialError:
        return False


def set_title(title: str) -> None:
    """The process title operators see in ``ps`` (setproctitle is a dependency)."""
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:  # pragma: no cover
        pass


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
