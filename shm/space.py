"""Room in /dev/shm for a server's segments, checked before they are made.

Segments are sized with ``ftruncate``, which on tmpfs reserves nothing: a page is taken the
first time it is touched, and a touch that finds the filesystem full kills the process with
SIGBUS. Containers get a small /dev/shm by default (64 MiB under Docker, podman and Kubernetes),
so a server must refuse, with a message that says how to raise it, what would crash it later.

``posix_fallocate`` would reserve the pages, but it also fills them: every arena would hold its
full size in RAM from the start (256 MiB per frontend and per model instance by default, charged
to the container's memory limit) instead of the pages that tensors touch. So the check counts
instead: the room left is the free space less what this server's objects may still take (each
one's size less the pages it holds), and a new segment must fit in what is left.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from typing import Iterator

from .names import PREFIX, SHM_DIR, object_name

MIB = 1 << 20
HOW_TO_RAISE = ("raise it with 'docker run --shm-size' or 'podman run --shm-size', or in Kubernetes mount a "
                "memory-backed emptyDir (medium: Memory, sizeLimit) at /dev/shm (docs/deploy.md)")


class NoRoom(OSError):
    """/dev/shm cannot hold a segment the server is about to make (errno ENOSPC)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def mib(n: int, up: bool = True) -> str:
    """Bytes as whole MiB: a need rounded up, room rounded down, so that the two never read
    as equal when one does not fit in the other."""
    return f"{-(-n // MIB) if up else n // MIB} MiB"


def free_bytes(folder: str = SHM_DIR) -> int:
    """What an unprivileged writer may still put in ``folder``'s filesystem."""
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def unbacked_bytes(server_id: str, folder: str = SHM_DIR) -> int:
    """What ``server_id``'s objects may still take: their sizes less the pages they hold."""
    stems = (f"{PREFIX}.{server_id}.", f"sem.{PREFIX}.{server_id}.")
    total = 0
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return 0
    for entry in entries:
        if not entry.name.startswith(stems):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:  # removed while we looked
            continue
        total += max(0, st.st_size - st.st_blocks * 512)
    return total


def room(server_id: str, folder: str = SHM_DIR) -> int:
    """What a new segment of ``server_id`` may use without taking pages its other objects count on."""
    return free_bytes(folder) - unbacked_bytes(server_id, folder)


def check(server_id: str, need: int, what: str, note: str = "", folder: str = SHM_DIR) -> None:
    """Raise NoRoom, with the one line an operator needs, when ``need`` bytes do not fit
    (``note``: what else the operator should know, such as the flags that set the sizes)."""
    left = room(server_id, folder)
    if left < need:
        raise NoRoom(f"{what} needs {mib(need)} of shared memory{note}, and {folder} has {mib(max(left, 0), up=False)} "
                     f"left; {HOW_TO_RAISE}")


@contextlib.contextmanager
def counting(server_id: str, folder: str = SHM_DIR) -> Iterator[None]:
    """Hold the server's lock for counting and making a segment (a lock on its broker segment's
    file): two workers that grow at once would otherwise each see the same room and, between
    them, take more than there is. Without that file (the broker is gone) it does not lock."""
    try:
        fd = os.open(folder + object_name(server_id, "broker", 0), os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (closing lets go of the lock)
