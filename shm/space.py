"""Room in /dev/shm for a server's segments, checked before they are made.

Segments are sized with ``ftruncate``, which on tmpfs reserves nothing: a page is taken the
first time it is touched, and a touch that finds the filesystem full kills the process with
SIGBUS. Containers get a small /dev/shm by default (64 MiB under Docker, podman and Kubernetes),
so a server must refuse, with a message that says how to raise it, what would crash it later.

``posix_fallocate`` of a whole segment would reserve the pages, but it also fills them: every
arena would hold its full size in RAM from the start (256 MiB per frontend and per model instance
by default, charged to the container's memory limit) instead of the pages that tensors touch. So
the check counts instead: the room left is the free space less what this server's objects may
still take (each one's size less the pages it holds), and a new segment must fit in what is left.

That keeps the server from filling /dev/shm itself, not another program from filling it after
the check; so no page is touched before ``take_pages`` has taken it (segment.py, arena.py), and
a full /dev/shm is an error where the page was wanted instead of a SIGBUS.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading
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
    """What ``server_id``'s objects may still take: their sizes less the pages they hold.

    Only objects of the server's user count. Anyone may make a file of our names in a
    world-writable /dev/shm, sparse and of any size (a 1 PiB one holds no page), and counting it
    would refuse every growth. Other users' objects under our names are the segments of local
    clients of ``--local-client-users``: the pages they take show in ``free_bytes`` once taken, a
    client's arena takes a block's pages before the block is sent (so the server writes no page not
    taken yet there), and their user could fill /dev/shm anyway; so they are left out, not
    counted with a bound."""
    stems = (f"{PREFIX}.{server_id}.", f"sem.{PREFIX}.{server_id}.")
    me = os.geteuid()
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
        if st.st_uid != me:
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


# madvise(MADV_POPULATE_WRITE) (Linux 5.14): takes the pages of a range as a write would, but
# fails with EFAULT where the write would have been a SIGBUS. Python 3.11's mmap lacks the name.
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def take_pages(mapping: mmap.mmap, name: str, start: int, end: int) -> bool:
    """Take the tmpfs pages of bytes ``start`` to ``end`` of ``mapping`` (of the object ``name``)
    before anything is written there; False when /dev/shm has no room for them. Pages taken
    already cost a walk of their page tables, a few microseconds a MiB."""
    page = mmap.PAGESIZE
    start -= start % page
    end = -(-min(end, len(mapping)) // page) * page
    if end <= start:
        return True
    try:
        mapping.madvise(_POPULATE_WRITE, start, end - start)
        return True
    except OSError as e:
        if e.errno in (errno.EFAULT, errno.ENOMEM, errno.ENOSPC):
            return False
        if e.errno == errno.EINVAL:  # a kernel before 5.14
            return fallocate(SHM_DIR + name, start, end)
        raise


def fallocate(path: str, start: int, end: int) -> bool:
    """``take_pages`` on a kernel without MADV_POPULATE_WRITE: posix_fallocate takes the same
    pages through a descriptor of the object (gone already: no page is wanted there any more)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return True
    try:
        os.posix_fallocate(fd, start, end - start)
        return True
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM):
            return False
        raise
    finally:
        os.close(fd)


def lock_path(server_id: str, folder: str = SHM_DIR) -> str:
    """The file whose lock ``counting`` holds: the server's user's alone (0600, no ACL entry).
    Not the broker segment's file: a local client of another user may open that one, and one
    holding a lock on it would stall every growth of every worker."""
    return folder + object_name(server_id, "space", "lock")


def make_lock(server_id: str, folder: str = SHM_DIR) -> None:
    """Made by the broker before anything is counted (a broker started again finds its own).
    Refused if the name is another user's: that user could hold the lock."""
    fd = os.open(lock_path(server_id, folder), os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise PermissionError(errno.EPERM, f"{lock_path(server_id, folder)} exists and is not this user's alone "
                                               f"(uid {st.st_uid}, mode {st.st_mode & 0o777:o}); remove it")
    finally:
        os.close(fd)


_in_process = threading.RLock()  # the threads of one process (a worker's stream senders) take turns
_depth = 0  # how deep this process is in ``counting`` (a load inside a load holds it once)


@contextlib.contextmanager
def counting(server_id: str, folder: str = SHM_DIR) -> Iterator[None]:
    """Hold the server's lock for counting and making segments: two processes that make
    segments at once (two workers growing, the broker starting a load's workers) would
    otherwise each see the same room and, between them, take more than there is. Reentrant
    within a process. Without its file (the broker is gone) it does not lock."""
    global _depth
    with _in_process:
        if _depth:
            _depth += 1
            try:
                yield
            finally:
                _depth -= 1
            return
        try:
            fd = os.open(lock_path(server_id, folder), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            yield
            return
        try:
            if os.fstat(fd).st_uid == os.geteuid():  # (make_lock made it; never wait on another's file)
                fcntl.flock(fd, fcntl.LOCK_EX)
            _depth = 1
            yield
        finally:
            _depth = 0
            os.close(fd)  # (closing lets go of the lock)
